"""The command line keeps the peers out of the way: `slimopt methods` imports neither torch nor any peer, peer
availability is read without importing the peer, and the load chatter of torchao, torch and bitsandbytes never
reaches the terminal, while everything else those libraries log still does. `--no-progress` means no progress bar
from anyone (transformers', datasets', the hub's), and the libraries' own settings come back after the run."""

import logging
import os
import sys

import pytest
from launch import run_python

from slimopt import peer_logs
from slimopt.hushed import progress_bars_off

BAR_MARKS = ("%|", "it/s", "s/it")  # what every tqdm bar draws, finished or not

PEER_MODULES = ("torch", "torchao", "bitsandbytes", "galore_torch", "apollo_torch", "transformers")


def _python(code: str):
    return run_python("-c", code, timeout=300)


def test_methods_imports_no_torch_and_no_peer():
    res = _python("import sys; from slimopt.cli import main; rc = main(['methods']); "
                  f"print('LOADED', sorted(m for m in {PEER_MODULES!r} if m in sys.modules)); sys.exit(rc)")
    assert res.returncode == 0, res.stderr
    assert "LOADED []" in res.stdout
    assert "galore-torch" in res.stdout and "taco" in res.stdout and "lora" in res.stdout
    assert res.stderr == ""


def test_peer_availability_imports_no_peer():
    res = _python("import sys; from slimopt.peers import available_peers; a = available_peers(); "
                  "print(sorted(m for m in ('torchao', 'bitsandbytes', 'galore_torch', 'apollo_torch') "
                  "if m in sys.modules)); print(a['torch-adamw'])")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["[]", "None"]


@pytest.mark.slow
def test_a_command_that_loads_transformers_prints_no_chatter():
    """`slimopt memory` builds a model through transformers, which imports torchao when it is installed."""
    res = _python("import sys; from slimopt.cli import main; "
                  "sys.exit(main(['memory', '--model', 'tiny', '--method', 'adamw']))")
    assert res.returncode == 0, res.stderr
    for fragments in peer_logs.CHATTER.values():
        for fragment in fragments:
            assert fragment not in res.stderr and fragment not in res.stdout


@pytest.mark.slow
def test_the_compare_forkserver_preload_prints_no_chatter():
    """`slimopt compare` runs each method in a process forked from a server that first imports _PRELOAD."""
    from slimopt.compare.runner import _PRELOAD

    res = _python("import importlib; " + "; ".join(f"importlib.import_module({m!r})" for m in _PRELOAD))
    assert res.returncode == 0, res.stderr
    for fragments in peer_logs.CHATTER.values():
        for fragment in fragments:
            assert fragment not in res.stderr


def test_the_filter_drops_only_the_chatter(caplog):
    peer_logs.hush()
    peer_logs.hush()  # idempotent: one filter per logger
    for name in peer_logs.CHATTER:
        assert sum(isinstance(f, peer_logs._DropChatter) for f in logging.getLogger(name).filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load %s: %s", "/x/_C_mxfp8.so", "Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "E")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "no network")
        logging.getLogger("torchao").warning("a quantization setting was ignored")
    assert [r.getMessage() for r in caplog.records] == ["a quantization setting was ignored"]


def _bar_settings() -> tuple:
    """(transformers' bars on, datasets' bars off, the hub's per-group settings)."""
    import datasets
    import huggingface_hub.utils.tqdm  # noqa: F401  (the module; huggingface_hub.utils.tqdm is also a class)
    from transformers.utils import logging as hf_logging

    hub = sys.modules["huggingface_hub.utils.tqdm"]
    return hf_logging.is_progress_bar_enabled(), datasets.are_progress_bars_disabled(), dict(hub.progress_bar_states)


@pytest.fixture
def bar_env(monkeypatch):
    """The libraries' settings as this test found them come back afterwards, and no environment variable of theirs
    decides for them."""
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        if os.environ.get(name) is not None:
            pytest.skip(f"{name} is set: it overrides any setting made in code")
    import datasets
    from transformers.utils import logging as hf_logging

    tf_on, ds_off, hub_states = _bar_settings()
    yield
    hub = sys.modules["huggingface_hub.utils.tqdm"]
    (hf_logging.enable_progress_bar if tf_on else hf_logging.disable_progress_bar)()
    (datasets.disable_progress_bars if ds_off else datasets.enable_progress_bars)()
    hub.progress_bar_states.clear()
    hub.progress_bar_states.update(hub_states)


def test_progress_bars_off_silences_every_library_and_restores_each(bar_env):
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    # a process's own mix: transformers' bars on, datasets' off, the hub's on but for one group
    hf_logging.enable_progress_bar()
    enable_progress_bars()
    disable_progress_bars("huggingface_hub.xet")
    datasets.disable_progress_bars()
    before = _bar_settings()
    with progress_bars_off():
        assert isinstance(hf_logging.tqdm(range(3)), hf_logging.EmptyTqdm)  # transformers' save/load bars
        assert datasets.are_progress_bars_disabled()
        assert are_progress_bars_disabled() and are_progress_bars_disabled("huggingface_hub.lfs")
    assert _bar_settings() == before
    assert are_progress_bars_disabled("huggingface_hub.xet") and not are_progress_bars_disabled()

    # and the other way round: what was off stays off, what was on comes back on, after an error too
    hf_logging.disable_progress_bar()
    datasets.enable_progress_bars()
    before = _bar_settings()
    with pytest.raises(RuntimeError), progress_bars_off():
        assert datasets.are_progress_bars_disabled()
        raise RuntimeError("a failed run")
    assert _bar_settings() == before


def test_train_no_progress_draws_no_bar(tmp_path, capfd, bar_env):
    """`slimopt train --no-progress --out` saves the final model without transformers' "Writing model shards" bar
    (nor any other), and leaves the libraries' settings as they were."""
    from pretrain_helpers import VOCAB, write_corpus

    from slimopt.cli import main

    corpus = write_corpus(tmp_path, chapters=40)
    before = _bar_settings()
    out = tmp_path / "run"
    rc = main(["train", "--model", "tiny", "--data", str(corpus), "--vocab-size", str(VOCAB), "--seq-len", "32",
               "--batch-size", "8", "--max-steps", "2", "--eval-tokens", "256", "--threads", "1",
               "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--no-progress"])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert (out / "final" / "model.safetensors").is_file()  # the save the bar came from did happen
    assert "adamw: 2 steps" in captured.out
    for mark in BAR_MARKS:
        assert mark not in captured.out and mark not in captured.err, captured.err
    assert _bar_settings() == before


@pytest.mark.slow
def test_finetune_draws_no_bar(tmp_path, capfd, bar_env):
    """`slimopt finetune` prints one line per run and turns the Trainer's bars off; transformers' model-loading
    bar stays away too."""
    from slimopt.cli import main

    before = _bar_settings()
    rc = main(["finetune", "--tasks", "kjv-testament", "--methods", "adamw", "--max-steps", "1", "--batch-size", "4",
               "--max-train-samples", "8", "--max-eval-samples", "8", "--max-length", "16", "--threads", "1",
               "--out", str(tmp_path / "out")])
    captured = capfd.readouterr()
    assert rc == 0, captured.err
    assert "adamw on kjv-testament" in captured.out
    for mark in BAR_MARKS:
        assert mark not in captured.out and mark not in captured.err, captured.err
    assert _bar_settings() == before
