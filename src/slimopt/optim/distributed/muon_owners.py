"""Muon's iteration under FSDP2 by owner ranks: each matrix orthogonalized once, on one rank.

Every rank holds a block of each matrix's rows (``shardcomm.Rows``, torch.chunk's split). ``owners.plan_owners``
gives each matrix an owner, balanced by the iteration's cost (``owners.muon_cost``) and made alike on every rank
from the matrices' shapes. Per bucket of the plan, one ``all_to_all_single`` sends each rank's rows of every
matrix to its owner (in the iteration's dtype), the owners iterate (same-shape matrices stacked), and one
``all_to_all_single`` sends each rank its rows of the results. Summed over ranks the iteration runs once a matrix
(the all-gather scheme of ``muon_sharded`` runs it W times), and a rank's bytes are its rows out and back, plus,
on an owner, the other ranks' rows in and out (``sent_bytes``). The matrices the owners assemble are the ones one
process iterates, so the result is one process's (bit for bit where the stacked products are; tests/
test_fsdp_owners.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slimopt.optim.distributed.owners import Job, OwnerPlan, muon_cost, plan_owners
from slimopt.optim.distributed.shardcomm import chunk_bounds

__all__ = ["exchange", "plan", "sent_bytes"]


@lru_cache(maxsize=64)
def _plan(jobs: tuple[Job, ...], world: int) -> OwnerPlan:
    return plan_owners(list(jobs), world, bucket_bytes=1 << 62)  # the queue already bounds a bucket's bytes


def plan(shapes: Sequence[tuple[int, tuple[int, int], int]], world: int, ns_steps: int) -> OwnerPlan:
    """The owner plan of matrices (parameter index, whole shape, element size) iterated together, made once per
    such list (every rank makes the same one)."""
    jobs = tuple(Job(i, (m, n), m * n * size, muon_cost(m, n, ns_steps)) for i, (m, n), size in shapes)
    return _plan(jobs, world)


def _rows(total: int, world: int, rank: int) -> int:
    s, e = chunk_bounds(total, world, rank)
    return e - s


def exchange(queue: list, iterate: Callable[[list[Tensor]], list[Tensor]], ns_steps: int) -> list[Tensor]:
    """This rank's rows of the orthogonalized matrices of `queue` (``muon_batch.Pending``s sharing one process
    group and dtype: ``x`` this rank's rows, ``rows`` their split), each iterated by its owner with `iterate`."""
    rows0 = queue[0].rows
    world, rank, group = rows0.world, rows0.rank, rows0.group
    owner_plan = plan([(q.index, q.shape, q.x.element_size()) for q in queue], world, ns_steps)
    out: list[Tensor | None] = [None] * len(queue)
    for bucket in owner_plan.buckets:
        bucket = sorted(bucket)  # queue order within a bucket, alike on every rank
        mine = [i for i in bucket if owner_plan.owners[i] == rank]
        # rows to the owners: for each destination, this rank's rows of its matrices, in bucket order
        sends = [[queue[i].x.reshape(-1) for i in bucket if owner_plan.owners[i] == d] for d in range(world)]
        in_splits = [sum(t.numel() for t in parts) for parts in sends]
        out_splits = [sum(_rows(queue[i].shape[0], world, s) * queue[i].shape[1] for i in mine)
                      for s in range(world)]
        received = _all_to_all([t for parts in sends for t in parts], in_splits, out_splits, queue[0].x, group)
        # the whole matrices this rank owns: every source's rows, in rank order
        pieces = received.split(out_splits)
        wholes: list[list[Tensor]] = [[] for _ in mine]
        for s in range(world):
            counts = [_rows(queue[i].shape[0], world, s) for i in mine]
            parts = pieces[s].split([c * queue[i].shape[1] for c, i in zip(counts, mine)]) if mine else ()
            for k, i in enumerate(mine):
                wholes[k].append(parts[k].view(counts[k], queue[i].shape[1]))
        results = iterate([torch.cat(w) for w in wholes]) if mine else []
        # each rank's rows of the results back, in bucket order
        backs = []
        for s in range(world):
            for k, i in enumerate(mine):
                start, stop = chunk_bounds(queue[i].shape[0], world, s)
                backs.append(results[k][start:stop].reshape(-1))
        mine_from = [[i for i in bucket if owner_plan.owners[i] == d] for d in range(world)]
        back_in = [sum(queue[i].x.numel() for i in mine_from[d]) for d in range(world)]
        returned = _all_to_all(backs, out_splits, back_in, queue[0].x, group)
        for d, piece in enumerate(returned.split(back_in)):
            if not mine_from[d]:
                continue
            for i, part in zip(mine_from[d], piece.split([queue[i].x.numel() for i in mine_from[d]])):
                out[i] = part.view(queue[i].x.shape)
    return out  # type: ignore[return-value]


def _all_to_all(parts: list[Tensor], in_splits: list[int], out_splits: list[int], like: Tensor, group) -> Tensor:
    """One ``all_to_all_single``: parts concatenated, in_splits[d] elements to rank d, out_splits[s] from rank s."""
    send = torch.cat(parts) if parts else like.new_empty(0)
    recv = like.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    return recv


def sent_bytes(shapes: Sequence[tuple[int, tuple[int, int], int]], world: int, rank: int, ns_steps: int) -> int:
    """Bytes `rank` sends to other ranks for one run of these matrices (index, whole shape, element size): its rows
    of each matrix it does not own, and, of each it owns, the other ranks' rows of the result."""
    owner_plan = plan(shapes, world, ns_steps)
    total = 0
    for (_, (m, n), size), owner in zip(shapes, owner_plan.owners):
        mine = _rows(m, world, rank)
        total += (m - mine) * n * size if owner == rank else mine * n * size
    return total
