"""`slimopt train --offload host` (and device-only int8 weights on the CPU) stops before its first step, with one
line, when the host cannot hold the master, the state and the step's temporaries; a run that fits is not
stopped."""

import pytest
from helpers import run_cli

from slimopt.train.host_memory import HOST_BYTES_ENV, available_host_bytes


def _args(corpus, cache, out, *extra):
    return ["train", "--model", "tiny", "--data", str(corpus), "--vocab-size", "512", "--seq-len", "32",
            "--batch-size", "8", "--max-steps", "2", "--threads", "1", "--cache-dir", str(cache), "--no-progress",
            "--no-save-model", "--eval-every", "0", "--eval-tokens", "1024", "--out", str(out), *extra]


@pytest.mark.parametrize("placement,budget,hint", [
    (["--weights", "int8", "--offload", "host"], "16MiB", "--master bf16 needs"),
    (["--weights", "int8", "--offload", "none"], "10MiB", "--method ternary_adamw needs"),
    (["--weights", "int8", "--offload", "host"], "1MiB", "no smaller setting fits"),
])
def test_a_run_the_host_cannot_hold_stops_before_its_first_step(data, tmp_path, capsys, monkeypatch, placement,
                                                                 budget, hint):
    corpus, cache = data
    out = tmp_path / "run"
    # tiny LLaMA, 8 x 32 tokens, adamw, all on the CPU: about 18 MiB planned with an fp32 host master, 15 with a
    # bf16 one; 12 for device-only int8 weights, 8 with ternary_adamw's state
    monkeypatch.setenv(HOST_BYTES_ENV, budget)
    rc, _, err = run_cli(_args(corpus, cache, out, *placement), capsys)
    lines = [line for line in err.splitlines() if line.startswith("slimopt train:")]
    assert rc != 0 and len(lines) == 1, err
    assert "host memory: this run needs" in lines[0] and f"available (${HOST_BYTES_ENV})" in lines[0], lines[0]
    assert hint in lines[0], lines[0]
    assert not (out / "metrics.jsonl").exists() or '"event": "train"' not in (out / "metrics.jsonl").read_text()


def test_a_tiny_run_that_fits_is_not_stopped(data, tmp_path, capsys, monkeypatch):
    corpus, cache = data
    monkeypatch.delenv(HOST_BYTES_ENV, raising=False)
    rc, stdout, err = run_cli(_args(corpus, cache, tmp_path / "run", "--weights", "int8", "--offload", "host"),
                              capsys)
    assert rc == 0, err
    assert "2 steps" in stdout


def test_the_stand_in_for_free_memory_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(HOST_BYTES_ENV, "2GiB")
    assert available_host_bytes() == 2 * 2**30
    monkeypatch.setenv(HOST_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=HOST_BYTES_ENV):
        available_host_bytes()
    monkeypatch.delenv(HOST_BYTES_ENV)
    assert available_host_bytes() > 0
