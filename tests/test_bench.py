"""The benchmark harness: its CPU mode on a tiny config fills a row for every method (or says why it cannot),
its state counts equal the planner's, the refresh timing scores bases correctly, and bad input fails clearly."""

import json
import sys

import pytest
import torch
from helpers import ODD_LLAMA
from transformers import LlamaConfig

import slimopt
from slimopt.bench.harness import BenchConfig, check_planner, goals, run_bench, split_variant
from slimopt.bench.refresh import time_refresh
from slimopt.bench.tables import bench_table
from slimopt.cli import main
from slimopt.peers import PEERS

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


FAST_PEERS = [p for p in PEERS if not p.startswith("torchao")]  # torchao compiles per shape: a minute on CPU


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A local config folder (no weights): a LLaMA small enough that every method steps in milliseconds."""
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(**ODD_LLAMA).save_pretrained(path)
    return str(path)


def _status_ok(status: str) -> bool:
    return status == "ok" or status == "not installed" or status.startswith("needs CUDA")


def test_cpu_mode_fills_every_row(tiny_dir, tmp_path, capsys, monkeypatch):
    # apollo-torch made unimportable for this test: its rows must then say "not installed"
    monkeypatch.setitem(sys.modules, "apollo_torch", None)
    methods = list(slimopt.methods()) + FAST_PEERS
    argv = ["bench", "--model", tiny_dir, "--methods", ",".join(methods), "--steps", "1", "--warmup", "0",
            "--refresh-shape", "48x80", "--refresh-rank", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == methods
    for name, r in rows.items():
        assert _status_ok(r["status"]), (name, r["status"])
        assert f"| {name} |" in text
    assert rows["apollo"]["status"] == rows["apollo-mini"]["status"] == "not installed"
    assert rows["galore-torch-8bit"]["status"].startswith("needs CUDA")
    for name, r in rows.items():
        if r["status"] != "ok":
            continue
        assert r["step_ms"] > 0 and r["peak_bytes"] > 0
        assert r["planned_state_bytes"] == r["state_bytes"], name  # the planner is exact for every row here
    assert rows["signsgd"]["state_bytes"] == 4 * len(list(torch.nn.Module.parameters(_meta(tiny_dir))))
    assert rows["frugal_rho0"]["state_bytes_per_param_projectable"] < 0.1
    assert rows["adamw8bit"]["state_bytes"] < rows["adamw"]["state_bytes"]
    assert rows["galore"]["refresh_ms"] is not None and rows["adamw"]["refresh_ms"] is None
    assert {r["status"] for r in data["refresh"]} == {"ok"}
    assert "GPU run pending" in text and "x AdamW time" in text and "x AdamW paired" in text
    for name, r in rows.items():  # every CPU row timed in alternation with fused AdamW too
        assert r["status"] != "ok" or (r["paired_ratio"] > 0 and r["paired_ref_ms"] > 0), name
    assert "CPU step goals" in text and "adamw8bit <= 2.5x fused torch AdamW" in text
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert data["command"].startswith("slimopt bench --model ")


def _meta(path):
    from slimopt.bench.planner import load_config, meta_model
    return meta_model(load_config(path)[1], "bf16")


@pytest.mark.slow
def test_cpu_mode_with_torchao(tiny_dir):
    res = run_bench(BenchConfig(model=tiny_dir, methods=["torchao-adamw8bit", "torchao-adamw4bit"], steps=1,
                                warmup=1, refresh=False))
    for r in res["rows"]:
        assert r["status"] == "ok" and r["planned_state_bytes"] == r["state_bytes"]


def test_variants_and_table(tiny_dir):
    res = run_bench(BenchConfig(model=tiny_dir, methods=["adamw", "adamw+state_bits=8", "torch-adamw-fused"],
                                steps=1, warmup=0, refresh=False))
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["adamw+state_bits=8"]["state_bytes"] < rows["adamw"]["state_bytes"]
    table = bench_table(res["rows"])
    assert "| adamw+state_bits=8 | slimopt | state_bits=8 |" in table and "| torch-adamw-fused | peer | - |" in table
    assert rows["adamw+state_bits=8"]["settings"] == {"state_bits": 8} and rows["adamw"]["settings"] == {}
    assert split_variant("galore+rank=64+compile=true") == ("galore", {"rank": 64, "compile": True})


def test_refresh_scores_bases():
    rows = {r["name"]: r for r in time_refresh((64, 96), 8, "cpu", reps=1)}
    assert rows["slimopt svd (torch.linalg.svd)"]["energy_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert rows["slimopt randomized_svd (2 power iterations)"]["energy_ratio"] > 0.99
    assert rows["galore-torch projector (full SVD)"]["energy_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert all(r["ms"] > 0 for r in rows.values())


def test_planner_check_on_cpu(tiny_dir):
    rows = check_planner(tiny_dir, ["adamw", "bnb-adamw8bit"], batch=2, seq=16, device="cpu")
    for r in rows:
        assert r["status"] == "ok" and r["ratio"] == pytest.approx(1.0, abs=0.01), r


def test_goals_wait_for_the_gpu():
    rows = [{"method": "adamw8bit", "status": "ok", "step_ms": 5.0, "state_bytes_per_param": 2.03},
            {"method": "bnb-adamw8bit", "status": "ok", "step_ms": 4.0, "state_bytes_per_param": 2.03}]
    cpu = {g["goal"]: g["verdict"] for g in goals(rows, "cpu")}
    assert cpu["slimopt AdamW8bit step faster than bitsandbytes (52.6 ms on the H200)"] == "GPU run pending"
    assert cpu["slimopt AdamW8bit <= 2.04 B/param state"] == "met"


def test_cpu_step_goals_read_the_paired_ratio():
    from slimopt.bench.harness import cpu_goals

    rows = [{"method": "adamw8bit", "status": "ok", "paired_ratio": 2.4, "paired_ms": 24.0, "paired_ref_ms": 10.0},
            {"method": "galore", "status": "ok", "paired_ratio": 3.0, "paired_ms": 30.0, "paired_ref_ms": 10.0},
            {"method": "taco", "status": "failed: x"}, {"method": "lion8bit", "status": "ok", "paired_ratio": 9.0,
                                                         "paired_ms": 90.0, "paired_ref_ms": 10.0}]
    got = {g["goal"]: g["verdict"] for g in cpu_goals(rows)}
    assert got == {"adamw8bit <= 2.5x fused torch AdamW": "met",
                   "galore <= 2x fused torch AdamW": "missed by 1.50x"}


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny", "--methods", "adamw,nope"], "unknown method(s) nope"),
    (["--model", "no-such-model", "--methods", "adamw"], "unknown model 'no-such-model'"),
    (["--model", "tiny", "--methods", "adamw", "--steps", "0"], "steps must be an integer >= 1"),
    (["--model", "tiny", "--methods", "adamw", "--device", "cuda"], "no CUDA device"),
    (["--model", "tiny", "--methods", "adamw+rank"], "expected NAME+KEY=VALUE"),
])
def test_bench_bad_input(argv, message, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", *argv, "--no-refresh"]) == 2
    err = capsys.readouterr().err
    assert "slimopt bench: error:" in err and message in err


def test_bench_bad_refresh_shape(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--refresh-shape", "2048"])
    assert exc.value.code == 2 and "expected MxN" in capsys.readouterr().err
