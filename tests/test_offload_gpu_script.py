"""benchmarks/offload_gpu.py (the GPU stage of int8 weights with a host master) runs its three placements on a CPU."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("offload_gpu", ROOT / "benchmarks" / "offload_gpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_offload_script_runs_every_placement_on_cpu(tmp_path):
    script = _script()
    assert script.main(["--model", "tiny", "--device", "cpu", "--steps", "3", "--batch", "2", "--seq", "32",
                        "--eval-tokens", "1024", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "offload.json").read_text())
    rows = record["placements"]
    assert [(r["weights"], r["offload"]) for r in rows.values()] == [("dtype", "none"), ("int8", "host"),
                                                                     ("int8", "none")]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] >= 0
        assert 0 < r["val_loss"] < 20 and 0 < r["train_loss"] < 20  # a vocabulary of 4096: ln 4096 = 8.3 at start
    # the same seed and batches: the three placements start from the same model and see the same tokens
    assert max(r["train_loss"] for r in rows.values()) - min(r["train_loss"] for r in rows.values()) < 0.05
    table = (tmp_path / "offload.md").read_text()
    assert table.count("\n| ") == 4 and "failed" not in table


def test_offload_script_refuses_too_few_steps(capsys):
    script = _script()
    with pytest.raises(SystemExit) as stop:
        script.main(["--steps", "2"])
    assert stop.value.code == 2
    assert "--steps must be at least 3" in capsys.readouterr().err
