"""Whole-matrix work under FSDP2, per rank: the eager step's scheme against owner ranks (``optim.distributed.owners``).

The eager step ("today" below: what every step did before owner ranks, and the reference) all-gathers each Muon
matrix on every rank and iterates on all of them, and an SVD refresh gathers every gradient on the group's first
rank and decomposes it there. With owner ranks (the fast step) each matrix's rows go to one rank (all-to-all),
which computes it, and the result comes back. For a LLaMA size on W ranks this counts, per
rank, the work (multiply-adds of the cost models in ``owners``) and the bytes received in a step or a refresh
(its own rows excluded), and reports the largest rank's: what the slowest rank waits for.

    python -m slimopt.bench.whole_matrix 1b 8 64
"""

from __future__ import annotations

from typing import Any

import torch

from slimopt.optim.distributed import exchange
from slimopt.optim.distributed.owners import muon_cost, randomized_svd_cost, svd_cost
from slimopt.optim.distributed.shardcomm import chunk_rows as _rows
from slimopt.optim.routes import whole_queue

__all__ = ["matrices", "compare_schemes", "markdown_table"]


def matrices(size: str = "1b", vocab: int = 32000) -> list[tuple[int, tuple[int, int]]]:
    """(index, shape) of every attention and MLP weight of a LLaMA size, in the optimizer's order (the matrices
    Muon and GaLore act on)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimopt.optim.algorithm.partition import classify
    from slimopt.models.llama import LLAMA_SIZES

    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **LLAMA_SIZES[size])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    kinds = classify(model).values()
    return [(i, tuple(p.shape)) for i, (p, kind) in enumerate(kinds) if kind == "projectable"]


def compare_schemes(shapes: list[tuple[int, tuple[int, int]]], world: int, kind: str, rank: int = 512,
                    ns_steps: int = 5, power_iters: int = 1, oversample: int = 8) -> dict[str, Any]:
    """For `kind` "muon" (bf16 rows, every step), "svd" or "randomized_svd" (fp32 gradients, bases of `rank`
    columns on GaLore's default side, at a refresh): the largest rank's work and received bytes with the eager
    step's scheme ("today": every rank iterates each Muon matrix; the first rank decomposes every refresh and
    broadcasts each basis whole) and with owner ranks as the fast step runs them (``routes/whole_queue.py``: the
    matrices in runs of a bounded size, each run planned and exchanged in turn; an owner sends Muon's result and a
    left basis back by rows, a right basis whole to every rank, a refresh's with a status value), and the total
    work. The busiest rank's owner work is the sum over runs of each run's busiest."""
    size = 2 if kind == "muon" else 4

    def cost(m, n):
        if kind == "muon":
            return muon_cost(m, n, ns_steps)
        if kind == "svd":
            return svd_cost(m, n)
        return randomized_svd_cost(m, n, min(rank + oversample, m, n), power_iters)

    def result(m, n):  # (shape, by rows) of what an owner computes
        if kind == "muon":
            return (m, n), True
        k = min(rank, m, n)
        return ((m, k), True) if m < n else ((n, k), False)  # GaLore's default side: left for a wide matrix

    total = sum(cost(m, n) for _, (m, n) in shapes)
    runs = whole_queue.runs([((), i, shape, size) for i, shape in shapes], world)
    plans = [exchange.plan([(i, (m, n), size, cost(m, n)) for _, i, (m, n), _ in run], world) for run in runs]
    owner_of = {job.index: owner for plan in plans for job, owner in zip(plan.jobs, plan.owners)}
    status = 0 if kind == "muon" else 4
    today_bytes, owner_bytes = [0] * world, [0] * world
    for i, (m, n) in shapes:
        (rm, rc), by_rows = result(m, n)
        for r in range(world):
            mine = _rows(m, world, r) * n * size
            share = (_rows(rm, world, r) if by_rows else rm) * rc * size
            if kind == "muon" or r == 0:
                today_bytes[r] += m * n * size - mine  # Muon: every rank gathers; a refresh: the first rank
            else:
                today_bytes[r] += rm * rc * 4  # the whole basis, broadcast
            owner_bytes[r] += m * n * size - mine if owner_of[i] == r else share + status
    largest = max((cost(m, n) for _, (m, n) in shapes), default=0.0)
    return {"kind": kind, "world": world, "matrices": len(shapes), "total_work": total,
            "today_work": total, "owner_work": sum(max(p.loads) for p in plans),
            "owner_bound": sum(sum(j.cost for j in p.jobs) / world + max(j.cost for j in p.jobs) for p in plans),
            "runs": len(runs), "largest_job": largest, "today_bytes": max(today_bytes), "owner_bytes": max(owner_bytes)}


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
