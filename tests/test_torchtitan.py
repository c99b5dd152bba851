"""slimopt inside torchtitan 0.3 (slimopt.integrations.torchtitan), on CPU with gloo: torchtitan's llama3 debug model
through its own parallelize_llama, LR schedulers, clipping and checkpoint manager (tests/distributed/
torchtitan_worker.py says what each launch checks). Skipped where torchtitan is not installed
(``pip install -e ".[torchtitan]"`` installs the pinned version). About three minutes on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util

import pytest
from launch import read_report, run_worker

CASES = ["adamw", "adamw8bit", "galore8bit", "frugal", "frugal_head", "taco", "muon8bit"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason='torchtitan is not installed: pip install -e ".[torchtitan]"'),
]


def _launch(nproc: int | None, phase: str, out: str, *extra: str) -> dict:
    run_worker(nproc, "torchtitan_worker.py", out, *extra, phase=phase)
    return read_report(out, f"report_{phase}_{nproc or 1}.json")


def test_the_job_configs_select_slimopt_and_take_command_line_settings(tmp_path):
    report = _launch(None, "config", str(tmp_path))
    for name, flavor in [("llama3_debugmodel_slimopt", "debugmodel"), ("llama3_1b_slimopt", "1B"),
                         ("llama3_8b_slimopt", "8B")]:
        parsed = report["parsed"][name]
        assert parsed["optimizer"] == "SlimOptimizersContainer.Config"
        assert parsed["checkpoint"] == "SlimCheckpointManager.Config"
        assert (parsed["method"], parsed["rank"], parsed["lr"], parsed["flavor"]) == ("frugal", 16, 0.002, flavor)
    assert report["parsed"]["llama3_8b_slimopt"]["update_gap"] == 500  # the config's own, kept
    # torchtitan's llama3 names partition as Hugging Face names do
    kinds = report["kinds"]
    assert kinds.pop("tok_embeddings.weight") == "embedding" and kinds.pop("lm_head.weight") == "head"
    assert {n for n, k in kinds.items() if k == "other"} == {n for n in kinds if "norm" in n}
    assert sum(k == "projectable" for k in kinds.values()) == 6 * 5  # wqkv, wo, w1, w2, w3 in 6 blocks
    # two model parts (pipeline stages): an optimizer each, one flat state dict that resumes exactly
    parts = report["parts"]
    assert parts["optimizers"] == 2 and parts["diff"] == 0.0
    assert parts["names"] == ["layers", "lm_head", "norm", "tok_embeddings"]
    # benchmarks/torchtitan_gpu.sh's options parse, and torchtitan reads slimopt's offline assets
    gpu = report["gpu_script"]
    assert gpu["runs"]["torch-adamw"]["optimizer"] == "OptimizersContainer.Config"
    assert gpu["runs"]["taco"]["method"] == "taco" and gpu["runs"]["taco"]["flavor"] == "1B"
    assert gpu["runs"]["taco"]["seq_len"] == 2048 and gpu["runs"]["taco"]["dataset_path"].endswith("text")
    assert gpu["vocab"] == 8192 and gpu["eos"] is not None
    assert gpu["batch"] == gpu["labels"] == [2, 64] and gpu["shifted"] and gpu["max_id"] < gpu["vocab"]


def test_two_ranks_resume_exactly_and_equal_slimopts_own_fsdp2_run(tmp_path):
    report = _launch(2, "save", str(tmp_path))
    assert sorted(report) == sorted(CASES)
    for case, r in report.items():
        assert r["resumed_diff"] == 0.0, case  # through SlimCheckpointManager, at the same world size
        assert r["own_fsdp_diff"] == 0.0, case  # torchtitan's clipping and schedulers, slimopt's FSDP2 loop
        assert r["groups"] == {"embedding": 1, "projectable": 10, "other": 5, "head": 1}
    # torchtitan's schedulers scale every group alike: linear warmup over 2 steps, then decay
    rates = report["adamw"]["rates"]
    factors = [[lr / base for lr, base in zip(step, rates[-1])] for step in rates]
    assert all(len({round(f, 12) for f in step}) == 1 for step in factors)
    assert len({step[0] for step in rates}) >= 4


@pytest.fixture(scope="module")
def saved_unclipped(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("torchtitan"))
    _launch(2, "save", out, "--max-norm", "1e9")
    return out


@pytest.mark.parametrize("world", [1, 4])
def test_a_two_rank_checkpoint_resumes_at_another_world_size(saved_unclipped, world):
    report = _launch(world, "load", saved_unclipped, "--max-norm", "1e9")
    assert "SlimCheckpointManager" in report.pop("stock_manager")
    assert sorted(report) == sorted(CASES)
    for case, r in report.items():
        assert r["resharded_diff"] == 0.0, (case, world)
