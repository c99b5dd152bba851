"""Under FSDP2 a rank holds its share of the optimizer state: after one step of each method on issue 45's LLaMA
(tests/distributed/state_worker.py, 2 and 4 ranks, gloo), the busiest rank's ``slimopt.state_nbytes`` is at most
1.10 x one process's / W. What stays on every rank (step counters, coordinates) and the padding of each shard's
last quantization block and column chunk are all that may exceed the share. The plan of it
(``bench.rank_state``) is what a rank measures, and docs/distributed.md's table is that plan. A checkpoint that
holds TACO's history whole (as before it was split by columns) still loads."""

from __future__ import annotations

import os
import sys

import pytest
from launch import read_report, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "distributed"))

import common as C  # noqa: E402
import state_worker as W  # noqa: E402

import slimopt  # noqa: E402
from slimopt.bench.rank_state import markdown_table, rank_state, rank_table  # noqa: E402

DOCS = os.path.join(HERE, "..", "docs", "distributed.md")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _one_process() -> dict[str, int]:
    out = {}
    for method in W.METHODS:
        model = W.make_model()
        opt = W.build(model, method)
        C.set_grads(model, 1)
        opt.step()
        out[method] = slimopt.state_nbytes(opt)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_the_busiest_rank_holds_its_share_of_the_state(world, tmp_path):
    run_worker(world, "state_worker.py", tmp_path)
    report = read_report(tmp_path, f"state_{world}.json")
    one = _one_process()
    for method, ranks in report.items():
        assert len(ranks) == world
        assert max(ranks) <= 1.10 * one[method] / world, (method, ranks, one[method])
        assert sum(ranks) >= one[method] * 0.99, (method, ranks, one[method])  # nothing is lost
        # the plan: one process's bytes exactly, the busiest rank's within its shards' block padding
        planned, planned_one = rank_state(W.make_model(), method, world, step=1, **W.settings(method))
        assert planned_one == one[method], method
        assert abs(planned - max(ranks)) <= 0.005 * max(ranks), (method, planned, ranks)
    # TACO's per-column history: 3 tensors for each of the 14 matrices, loaded from their whole form
    assert read_report(tmp_path, f"taco_whole_{world}.json") == {"compared": 3 * 14}


def test_the_docs_table_is_the_plan():
    with open(DOCS, encoding="utf-8") as f:
        assert markdown_table(rank_table()) in f.read()
