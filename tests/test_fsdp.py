"""Every slimopt method under FSDP2 with 2 and 4 ranks (torchrun, gloo, CPU), and DCP checkpoints resharded
2 -> 4 ranks and 2 ranks -> one process.

Two torchrun launches run all the checks of tests/distributed/fsdp_worker.py (its docstring lists them): one with
2 ranks (FSDP == one process, counted collectives == the predicted volume, agreement of every random choice,
state_nbytes, save, same-size resume), one with 4 ranks (resume of the 2-rank checkpoints, stepping shards that
hold no rows, against the uninterrupted run; HSDP 2 x 2 == one process). The one-process resume runs here.
About two and a half minutes on 2 busy CPU cores.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from launch import read_report, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "distributed"))

import common as C  # noqa: E402

from slimopt.optim.distributed import distcheckpoint  # noqa: E402

# one thread, as the workers run: with two, a CPU with AVX-512 (Intel Xeon, 2026-12-02) splits Muon's matmuls
# differently and the in-process resume lands an fp32 ulp away from the two-rank run
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("fsdp"))
    run_worker(2, "fsdp_worker.py", out, phase="save")
    return out


def test_two_ranks_match_one_process_count_their_collectives_and_resume(saved):
    report = read_report(saved, "report_save_2.json")
    assert sorted(report) == sorted(C.CASES)
    for case, r in report.items():
        assert r["agreed_tensors"] > 0
        assert r["state_bytes_total"] >= r["state_bytes_rank"]
        for c in r["collectives"]:
            assert c["counted"] == c["expected_step"] + c["expected_refresh"], (case, c)
    # what docs/distributed.md says: elementwise methods send nothing; GaLore's left projections all-reduce every
    # step and its refreshes gather the gradient
    assert all(c["counted"] == 0 for case in ("adamw", "adamw8bit", "signsgd", "frugal", "badam")
               for c in report[case]["collectives"])
    galore = {c["step"]: c for c in report["galore"]["collectives"]}
    assert galore[3]["expected_refresh"] > 0 and galore[2]["expected_refresh"] == 0
    assert galore[2]["counted"] > 0


@pytest.mark.parametrize("case", list(C.CASES))
def test_two_rank_checkpoint_resumes_in_one_process(saved, case):
    path = os.path.join(saved, case)
    final = torch.load(path + ".final.pt", weights_only=True)
    model = C.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the checkpoint must overwrite these
    opt = C.build(model, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to load in a single process"
        distcheckpoint.load(path, model, opt)
    C.run_steps(model, opt, C.K1 + 1, C.K1 + C.K2)
    C.compare(final, model, opt, (2, 1), C.K1 + C.K2, f"{case} saved at 2 ranks, resumed in one process")


def test_four_ranks_resume_the_two_rank_checkpoints_and_hsdp_matches_one_process(saved):
    text = run_worker(4, "fsdp_worker.py", saved, phase="load")
    assert sum(line.endswith("): ok") for line in text.splitlines()) == len(C.CASES)
    assert "mixed_a under HSDP: ok" in text and "mixed_b under HSDP: ok" in text
    assert "layer-wise: 8 cases equal" in text


def test_layerwise_updates_under_fsdp2_equal_the_ordinary_step(saved):
    # 2 ranks here; the 4-rank launch above checks it again
    report = read_report(saved, "report_layerwise_2.json")
    assert report == {f"{case}/{accumulation}": "equal" for case in ("adamw8bit", "galore", "frugal", "taco")
                      for accumulation in (1, 2)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_method_at_its_defaults_equals_one_process(world, tmp_path):
    """The fast routes (fused=True) on row shards: every named method under FSDP2 ends within 1e-6 of one process
    on exact gradients (tests/distributed/defaults_worker.py), each through the route it takes in one process."""
    import slimopt
    run_worker(world, "defaults_worker.py", tmp_path)
    report = read_report(tmp_path, f"defaults_{world}.json")
    assert sorted(report) == sorted(slimopt.methods())
    for method, r in report.items():
        assert r["max_diff"] <= 1e-6 and r["col_diff"] <= 1e-6, (method, r)
    # the column sums of ternary_adamw's factored v are summed over the ranks after its step, while the next
    # forward and backward run: one all-reduce left running a step
    assert report["ternary_adamw"]["left_running"] == (1 if world > 1 else 0)
    assert "c_kernel" in report["adamw8bit"]["routes"] and "multi_tensor_adamw" in report["adamw"]["routes"]
    assert ("taco_sharded" if world > 1 else "taco_c_kernel") in report["taco"]["routes"]
    assert "projected" in report["galore"]["routes"] and "multi_tensor_free" in report["frugal"]["routes"]
