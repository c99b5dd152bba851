"""The command line keeps the peers out of the way: `slimopt methods` imports neither torch nor any peer, peer
availability is read without importing the peer, and the load chatter of torchao, torch and bitsandbytes never
reaches the terminal, while everything else those libraries log still does."""

import logging
import subprocess
import sys

import pytest

from slimopt import peer_logs

PEER_MODULES = ("torch", "torchao", "bitsandbytes", "galore_torch", "apollo_torch", "transformers")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


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
    from slimopt.train.compare import _PRELOAD

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
