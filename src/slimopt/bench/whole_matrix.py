"""Whole-matrix work under FSDP2, per rank: today's scheme against owner ranks (``optim.distributed.owners``).

Today every rank all-gathers each Muon matrix and iterates on all of them, and an SVD refresh gathers every
gradient on the group's first rank and decomposes it there. With owner ranks each matrix's rows go to one rank
(all-to-all), which computes it, and the result's rows come back. For a LLaMA size on W ranks this counts, per
rank, the work (multiply-adds of the cost models in ``owners``) and the bytes received in a step or a refresh
(its own rows excluded), and reports the largest rank's: what the slowest rank waits for.

    python -m slimopt.bench.whole_matrix 1b 8 64
"""

from __future__ import annotations

from typing import Any

import torch

from slimopt.optim.distributed import muon_owners
from slimopt.optim.distributed.owners import Job, muon_cost, plan_owners, randomized_svd_cost, svd_cost
from slimopt.optim.routes import muon_batch

__all__ = ["matrices", "compare_schemes", "markdown_table"]


def matrices(size: str = "1b", vocab: int = 32000) -> list[tuple[int, tuple[int, int]]]:
    """(index, shape) of every attention and MLP weight of a LLaMA size, in the optimizer's order (the matrices
    Muon and GaLore act on)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimopt.optim.algorithm.partition import classify
    from slimopt.train.models import LLAMA_SIZES

    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **LLAMA_SIZES[size])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    kinds = classify(model).values()
    return [(i, tuple(p.shape)) for i, (p, kind) in enumerate(kinds) if kind == "projectable"]


def _rows(m: int, world: int, rank: int) -> int:
    """Rows of an m-row matrix on `rank` under FSDP2 (``torch.chunk`` sizes)."""
    c = -(-m // world)
    return max(0, min(m, (rank + 1) * c) - rank * c)


def compare_schemes(shapes: list[tuple[int, tuple[int, int]]], world: int, kind: str, rank: int = 512,
                    ns_steps: int = 5, power_iters: int = 1, oversample: int = 8) -> dict[str, Any]:
    """For `kind` "muon" (bf16 rows, every step), "svd" or "randomized_svd" (fp32 gradients, bases of `rank`
    columns on GaLore's default side, at a refresh): the largest rank's work and received bytes today and with
    owner ranks, and the total work. Today's refresh decomposes everything on the first rank and broadcasts each
    basis whole; an owner sends a left basis back as row blocks and a right basis to every rank. Muon's owners
    are planned as its step runs them (``routes.muon_batch``): the step's matrices in runs of a bounded size, each
    run planned and exchanged in turn, so the busiest rank's work is the sum over runs of each run's busiest."""
    size = 2 if kind == "muon" else 4

    def cost(m, n):
        if kind == "muon":
            return muon_cost(m, n, ns_steps)
        if kind == "svd":
            return svd_cost(m, n)
        return randomized_svd_cost(m, n, min(rank + oversample, m, n), power_iters)

    jobs = [Job(i, (m, n), m * n * size, cost(m, n)) for i, (m, n) in shapes]
    total = sum(j.cost for j in jobs)
    if kind == "muon":
        runs = [[(i, shape, sz) for _, i, shape, sz in run]
                for run in muon_batch.runs([((), i, shape, size) for i, shape in shapes], world)]
        plans = [muon_owners.plan(run, world, ns_steps) for run in runs]
        owner_work = sum(max(p.loads) for p in plans)
        bound = sum(sum(j.cost for j in p.jobs) / world + max(j.cost for j in p.jobs) for p in plans)
        # an exchange is symmetric: a rank receives what it sends
        owner_bytes = [sum(muon_owners.sent_bytes(run, world, r, ns_steps) for run in runs) for r in range(world)]
        today_bytes = [sum(m * n * size - _rows(m, world, r) * n * size for _, (m, n) in shapes)
                       for r in range(world)]  # every rank gathers the whole of every matrix
        return {"kind": kind, "world": world, "matrices": len(jobs), "total_work": total, "today_work": total,
                "owner_work": owner_work, "owner_bound": bound, "runs": len(runs),
                "largest_job": max((j.cost for j in jobs), default=0.0),
                "today_bytes": max(today_bytes), "owner_bytes": max(owner_bytes)}
    plan = plan_owners(jobs, world)
    today_work = [total if r == 0 else 0.0 for r in range(world)]
    today_bytes, owner_bytes = [0] * world, [0] * world
    for j, owner in zip(jobs, plan.owners):
        m, n = j.shape
        k = min(rank, m, n)
        left = m < n  # GaLore's default side: a left basis (m x r) for a wide matrix, else a right one (n x r)
        for r in range(world):
            mine = _rows(m, world, r) * n * size
            if r == 0:
                today_bytes[r] += m * n * size - mine  # the gradient, gathered on the first rank
            else:
                today_bytes[r] += (m if left else n) * k * 4  # the whole basis, broadcast
            if r == owner:
                owner_bytes[r] += m * n * size - mine  # the other ranks' rows, to compute the matrix
            else:
                owner_bytes[r] += (_rows(m, world, r) if left else n) * k * 4  # its rows of a left or a right basis
    largest = max((j.cost for j in jobs), default=0.0)
    return {"kind": kind, "world": world, "matrices": len(jobs), "total_work": total,
            "today_work": max(today_work), "owner_work": max(plan.loads), "owner_bound": total / world + largest,
            "runs": 1, "largest_job": largest, "today_bytes": max(today_bytes), "owner_bytes": max(owner_bytes)}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows of ``compare_schemes`` as the table of docs/distributed.md (work: the largest rank's share of the
    total; GB = 10^9 bytes received by the largest rank)."""
    lines = ["| work | W | matrices | largest rank's work, today / owners (x total) | largest rank's bytes, today / "
             "owners (GB) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['world']} | {r['matrices']} | {r['today_work'] / r['total_work']:.3f} / "
                     f"{r['owner_work'] / r['total_work']:.3f} | {r['today_bytes'] / 1e9:.2f} / "
                     f"{r['owner_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    size = sys.argv[1] if len(sys.argv) > 1 else "1b"
    worlds = [int(w) for w in sys.argv[2:]] or [8, 64]
    shapes = matrices(size)
    print(markdown_table([compare_schemes(shapes, w, kind) for kind in ("muon", "svd", "randomized_svd")
                          for w in worlds]))
