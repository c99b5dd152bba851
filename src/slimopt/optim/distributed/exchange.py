"""Whole matrices computed by owner ranks under FSDP2: rows in by one all-to-all, results out by another.

Every rank holds a block of each matrix's rows (``shardcomm.Rows``, torch.chunk's split), and some work needs the
whole matrix (Muon's iteration, a refresh's decomposition). ``owners.plan_owners`` gives each matrix an owner,
balanced by the work's cost and made alike on every rank from the matrices' shapes. ``exchange`` then runs one
bucket of the plan at a time: one ``all_to_all_single`` sends each rank's rows of every matrix to its owner, the
owners compute their whole matrices, and one ``all_to_all_single`` sends the results back: a result split by rows
like the matrix (Muon's update, a left basis), or whole to every rank (a right basis), each optionally with a
status value from its owner (a failed decomposition). The matrices the owners assemble are the ones one process
holds, so the results are one process's. ``sent_bytes`` is what a rank sends, for the communication planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slimopt.optim.distributed.owners import Job, OwnerPlan, plan_owners
from slimopt.optim.distributed.shardcomm import Rows, chunk_bounds
from slimopt.optim.distributed.shardcomm import chunk_rows as _rows

__all__ = ["Part", "plan", "exchange", "sent_bytes"]


@dataclass
class Part:
    """This rank's part of one matrix to compute whole: its parameter's index, the whole (m, n) shape, this rank's
    rows x (its element type is the exchange's), their split, the whole result's shape, and whether the result
    comes back by rows (like the matrix: its first dimension is m) or whole to every rank."""

    index: int
    shape: tuple[int, int]
    x: Tensor
    rows: Rows
    result: tuple[int, int]
    by_rows: bool = True


@lru_cache(maxsize=64)
def _plan(jobs: tuple[Job, ...], world: int) -> OwnerPlan:
    return plan_owners(list(jobs), world, bucket_bytes=1 << 62)  # the queue already bounds a run's bytes


def plan(items: Sequence[tuple[int, tuple[int, int], int, float]], world: int) -> OwnerPlan:
    """The owner plan of matrices (parameter index, whole shape, element size, cost) computed together, made once
    per such list (every rank makes the same one)."""
    return _plan(tuple(Job(i, (m, n), m * n * size, cost) for i, (m, n), size, cost in items), world)


def _back(part: Part, world: int, rank: int, status: bool) -> int:
    """Elements of part's result that go to `rank`: its rows, or all of it; and a status value."""
    m, cols = part.result
    return (_rows(m, world, rank) if part.by_rows else m) * cols + int(status)


def exchange(parts: list[Part], costs: list[float],
             compute: Callable[[list[int], list[Tensor]], list[tuple[Tensor, float]]],
             status: bool = False) -> list[tuple[Tensor, float]]:
    """For each part, (this rank's share of its result: its rows or the whole, the owner's status value or 0.0),
    each matrix computed once by its owner: compute(positions in `parts`, their whole matrices) -> [(result,
    status)]. All parts share one process group and element type, and every rank passes the same matrices in the
    same order."""
    rows0 = parts[0].rows
    world, rank, group = rows0.world, rows0.rank, rows0.group
    owner_plan = plan([(q.index, q.shape, q.x.element_size(), c) for q, c in zip(parts, costs)], world)
    owners = owner_plan.owners
    out: list[tuple[Tensor, float] | None] = [None] * len(parts)
    for bucket in owner_plan.buckets:
        bucket = sorted(bucket)  # the parts' order within a bucket, alike on every rank
        by_owner = [[i for i in bucket if owners[i] == d] for d in range(world)]
        mine = by_owner[rank]
        # rows to the owners: for each destination, this rank's rows of its matrices
        in_splits = [sum(parts[i].x.numel() for i in by_owner[d]) for d in range(world)]
        out_splits = [sum(_rows(parts[i].shape[0], world, s) * parts[i].shape[1] for i in mine) for s in range(world)]
        received = _all_to_all([parts[i].x.reshape(-1) for d in range(world) for i in by_owner[d]], in_splits,
                               out_splits, parts[0].x, group)
        # the whole matrices this rank owns: every source's rows, in rank order
        wholes: list[list[Tensor]] = [[] for _ in mine]
        for s, piece in enumerate(received.split(out_splits)):
            counts = [_rows(parts[i].shape[0], world, s) for i in mine]
            for k, (i, chunk) in enumerate(zip(mine, piece.split([c * parts[i].shape[1] for c, i in zip(counts, mine)])
                                               if mine else ())):
                wholes[k].append(chunk.view(counts[k], parts[i].shape[1]))
        results = compute(mine, [torch.cat(w) for w in wholes]) if mine else []
        # each rank's share of the results back
        backs = []
        for s in range(world):
            for (result, code), i in zip(results, mine):
                if parts[i].by_rows:
                    start, stop = chunk_bounds(parts[i].result[0], world, s)
                    result = result[start:stop]
                backs.append(result.reshape(-1).to(parts[0].x.dtype))
                if status:
                    backs.append(parts[0].x.new_full((1,), code))
        back_in = [sum(_back(parts[i], world, rank, status) for i in by_owner[d]) for d in range(world)]
        back_out = [sum(_back(parts[i], world, s, status) for i in mine) for s in range(world)]
        returned = _all_to_all(backs, back_out, back_in, parts[0].x, group)
        for d, piece in enumerate(returned.split(back_in)):
            sizes = [_back(parts[i], world, rank, status) for i in by_owner[d]]
            for i, chunk in zip(by_owner[d], piece.split(sizes) if sizes else ()):
                m, cols = parts[i].result
                values = chunk[: chunk.numel() - int(status)]
                shape = ((_rows(m, world, rank) if parts[i].by_rows else m), cols)
                out[i] = (values.view(shape), float(chunk[-1]) if status else 0.0)
    return out  # type: ignore[return-value]


def _all_to_all(parts: list[Tensor], in_splits: list[int], out_splits: list[int], like: Tensor, group) -> Tensor:
    """One ``all_to_all_single``: parts concatenated, in_splits[d] elements to rank d, out_splits[s] from rank s."""
    send = torch.cat(parts) if parts else like.new_empty(0)
    recv = like.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv


def sent_bytes(items: Sequence[tuple[int, tuple[int, int], int, float, tuple[int, int], bool]], world: int, rank: int,
               status: bool = False) -> int:
    """Bytes `rank` sends to the other ranks for one exchange of these matrices (index, whole shape, element size,
    cost, result shape, result by rows): its rows of each matrix it does not own, and, of each it owns, the other
    ranks' shares of the result (and their status values)."""
    owner_plan = plan([item[:4] for item in items], world)
    total = 0
    for (_, (m, n), size, _, (rm, rc), by_rows), owner in zip(items, owner_plan.owners):
        if owner != rank:
            total += _rows(m, world, rank) * n * size
            continue
        for s in range(world):
            if s != rank:
                total += ((_rows(rm, world, s) if by_rows else rm) * rc + int(status)) * size
    return total
