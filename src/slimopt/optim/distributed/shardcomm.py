"""How a row-sharded (FSDP2) parameter is spread over ranks, and the collectives of slimopt's sharded step.

FSDP2 shards dim 0 in ``torch.chunk`` sizes: with c = ceil(m / W) rows per rank, rank r holds rows
[r c, min((r + 1) c, m)), so the last ranks may hold fewer rows, or none. ``Rows`` records that split (and the
process group and mesh that go with it); every collective of ``sharded.py`` goes through the functions here,
which pad ragged row blocks to c rows so that one ``all_gather_into_tensor`` / ``gather`` moves them, and are
no-ops in one process.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Rows", "is_sharded", "chunk_bounds", "rows_of", "all_reduce", "reduce_scatter_rows", "gather_rows",
           "gather_rows_to_root", "broadcast", "chosen_per_rank", "gather_var_rows", "gather_equal", "chunk_rows",
           "chunks_of", "padded_to_chunks", "unpad_rows", "gather_row_chunks", "hold",
           "held_whole"]


def is_sharded(t: Any) -> bool:
    """True for a DTensor (an FSDP2 parameter or gradient). torch.distributed.tensor takes ~1.5 s to import, so it
    is not imported here: until something else has imported it, no tensor can be a DTensor."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


# ----------------------------------------------------------------------------------------------------------------
# how rows are spread over ranks


@dataclass(frozen=True)
class Rows:
    """A contiguous split of `total` rows over the ranks of `group`: this rank holds rows [start, stop).

    One process (or a replicated tensor) is ``Rows(total, 0, total)``. ``mesh`` / ``placements`` are the
    parameter's, to rebuild DTensors for checkpoints; ``chunked`` says the split follows ``torch.chunk`` (FSDP2's
    and DTensor's), which only row splits of the parameter itself do.
    """

    total: int
    start: int
    stop: int
    group: Any = None
    world: int = 1
    rank: int = 0
    mesh: Any = None
    placements: tuple = ()
    chunked: bool = True

    @property
    def local(self) -> int:
        return self.stop - self.start

    @property
    def chunk(self) -> int:
        """Rows per rank before the tail (torch.chunk): the padded length of an all-gather."""
        return max(1, -(-self.total // self.world))

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def sub(self, total: int, start: int, stop: int) -> "Rows":
        """Another split over the same ranks (e.g. the chosen rows of a ``rows`` projector)."""
        return Rows(total, start, stop, self.group, self.world, self.rank, self.mesh, self.placements, False)


def chunk_bounds(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s rows when `total` rows are split as torch.chunk splits them over `world`."""
    c = -(-total // world) if total else 0
    start = min(rank * c, total)
    return start, min(start + c, total)


def chunks_of(rows: Rows, total: int) -> Rows:
    """`total` rows of a tensor that is not the parameter (a left projection's r subspace rows, a right basis's n
    rows, a factored moment's n column means) split over the ranks of `rows` as torch.chunk splits them, so that a
    checkpoint saves them as a DTensor laid out like the parameter: this rank's share."""
    start, stop = chunk_bounds(total, rows.world, rows.rank)
    return Rows(total, start, stop, rows.group, rows.world, rows.rank, rows.mesh, rows.placements)


def chunk_rows(total: int, world: int, rank: int) -> int:
    """How many of `total` rows `rank` holds under ``chunk_bounds``."""
    start, stop = chunk_bounds(total, world, rank)
    return stop - start


def rows_of(p: Tensor) -> Rows:
    """The row split of a parameter: trivial for a plain tensor, FSDP2's Shard(0) split for a DTensor.

    Raises ValueError for placements other than Shard(0) on one mesh dimension and Replicate on the others
    (tensor parallelism, sharding on another dim): slimopt steps FSDP2 and HSDP layouts.
    """
    total = p.shape[0] if p.dim() > 0 else 1
    if not is_sharded(p):
        return Rows(total, 0, total)
    from torch.distributed.tensor import Replicate, Shard
    mesh, placements = p.device_mesh, tuple(p.placements)
    shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    bad = [pl for pl in placements if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0))]
    if bad or len(shard_dims) > 1:
        raise ValueError(f"slimopt steps DTensor parameters sharded on dim 0 over one mesh dimension (FSDP2, HSDP); "
                         f"got placements {placements}")
    if not shard_dims:  # replicated everywhere: every rank steps the whole tensor
        return Rows(total, 0, total, mesh=mesh, placements=placements)
    d = shard_dims[0]
    group = mesh.get_group(mesh_dim=d)
    world, rank = mesh.size(d), mesh.get_local_rank(mesh_dim=d)
    start, stop = chunk_bounds(total, world, rank)
    local = p.to_local().shape[0] if p.dim() > 0 else 1
    if local != stop - start:
        raise ValueError(f"a DTensor shard holds {local} rows where torch.chunk gives {stop - start} "
                         f"(rows {start}:{stop} of {total}); slimopt needs FSDP2's even chunking")
    return Rows(total, start, stop, group, world, rank, mesh, placements)


# ----------------------------------------------------------------------------------------------------------------
# collectives (every one goes through these, so their volume is easy to follow)


def all_reduce(t: Tensor, rows: Rows, op=None) -> Tensor:
    """Sum (or `op`) of t over the shard group, in place; a no-op in one process."""
    if rows.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=rows.group)
    return t


def reduce_scatter_rows(t: Tensor, rows: Rows) -> tuple[Any, Tensor]:
    """Start the sum over the group of t (rows.total, ...), each rank receiving its chunk's rows (rows.local of a
    (rows.chunk, ...) tensor, zero-padded rows after them): (the collective's work to wait on, that tensor). One
    ``reduce_scatter_tensor`` of t padded to rows.chunk rows a rank."""
    out = t.new_empty((rows.chunk,) + tuple(t.shape[1:]))
    work = dist.reduce_scatter_tensor(out, padded_to_chunks(t, rows), group=rows.group, async_op=True)
    return work, out


def padded_to_chunks(t: Tensor, rows: Rows) -> Tensor:
    """t (rows.total, ...) with zero rows after it up to rows.chunk rows a rank (contiguous): what a reduce-scatter
    into equal chunks takes."""
    missing = rows.chunk * rows.world - t.shape[0]
    return (torch.cat([t, t.new_zeros((missing,) + tuple(t.shape[1:]))]) if missing else t).contiguous()


def gather_rows(local: Tensor, rows: Rows) -> Tensor:
    """All-gather a row-sharded tensor: local (rows.local, ...) -> (rows.total, ...) on every rank."""
    if not rows.distributed:
        return local
    c = rows.chunk
    padded = local.new_zeros((c,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((c * rows.world,) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=rows.group)
    return unpad_rows(out, rows)


def unpad_rows(stacked: Tensor, rows: Rows) -> Tensor:
    """Rows of `stacked` (world * chunk, ...) in chunk layout -> (total, ...): drop each rank's padding."""
    c = rows.chunk
    parts = []
    for r in range(rows.world):
        s, e = chunk_bounds(rows.total, rows.world, r)
        parts.append(stacked[r * c: r * c + (e - s)])
    return torch.cat(parts)


def gather_rows_to_root(local: Tensor, rows: Rows) -> Tensor | None:
    """Gather a row-sharded tensor on the first rank of the group: (rows.total, ...) there, None elsewhere."""
    if not rows.distributed:
        return local
    c = rows.chunk
    padded = local.new_zeros((c,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    root = dist.get_global_rank(rows.group, 0)
    bufs = [torch.empty_like(padded) for _ in range(rows.world)] if rows.rank == 0 else None
    dist.gather(padded, gather_list=bufs, dst=root, group=rows.group)
    return unpad_rows(torch.cat(bufs), rows) if rows.rank == 0 else None


def broadcast(t: Tensor, rows: Rows) -> Tensor:
    """Broadcast t in place from the first rank of the group."""
    if rows.distributed:
        dist.broadcast(t, src=dist.get_global_rank(rows.group, 0), group=rows.group)
    return t


def chosen_per_rank(index: Tensor, rows: Rows) -> list[int]:
    """How many of the chosen global rows (`index`) each rank of the group holds (known everywhere: the index is
    replicated and the split is torch.chunk's)."""
    out = []
    for r in range(rows.world):
        s, e = chunk_bounds(rows.total, rows.world, r)
        out.append(int(((index >= s) & (index < e)).sum().item()))
    return out


def gather_row_chunks(items: list[tuple[Tensor, Rows]]) -> list[Tensor]:
    """All-gather several row-sharded tensors at once (each t (rows.local, ...) of its rows.total): one collective a
    process group and dtype instead of one a tensor, each padded to rows.chunk rows as ``gather_rows`` sends it.
    Returns each whole (rows.total, ...) on every rank, in the order given."""
    out: list[Tensor | None] = [None] * len(items)
    by_group: dict[tuple, list[int]] = {}
    for i, (t, rows) in enumerate(items):
        by_group.setdefault((id(rows.group), t.dtype), []).append(i)
    for picked in by_group.values():
        sizes = [items[i][1].chunk * math.prod(items[i][0].shape[1:]) for i in picked]
        mine = items[picked[0]][0].new_zeros(sum(sizes))
        at = 0
        for i, size in zip(picked, sizes):
            mine[at: at + items[i][0].numel()] = items[i][0].reshape(-1)
            at += size
        every = gather_equal(mine, items[picked[0]][1])  # row k: rank k's parts, side by side
        at = 0
        for i, size in zip(picked, sizes):
            t, rows = items[i]
            stacked = every[:, at: at + size].reshape((rows.world * rows.chunk,) + tuple(t.shape[1:]))
            out[i] = unpad_rows(stacked, rows)
            at += size
    return out


def hold(pairs) -> dict[int, tuple[Tensor, int, Tensor]]:
    """(this rank's part, the whole tensor it is part of) pairs as a step keeps them: {id(part): (part, its version
    now, whole)}, for ``held_whole``."""
    return {id(part): (part, part._version, whole) for part, whole in pairs}


def held_whole(held: dict | None, part: Tensor) -> Tensor | None:
    """The whole tensor `held` (``hold``) keeps for `part`, where part has not changed since; else None."""
    known = held.get(id(part)) if held else None
    return known[2] if known is not None and known[0] is part and known[1] == part._version else None


def gather_equal(t: Tensor, rows: Rows) -> Tensor:
    """All-gather a 1-D tensor as long on every rank of the group: (world, its length), row r rank r's."""
    out = t.new_empty(rows.world * t.numel())
    dist.all_gather_into_tensor(out, t.contiguous(), group=rows.group)
    return out.view(rows.world, t.numel())


def gather_var_rows(local: Tensor, rows: Rows, counts: list[int]) -> Tensor:
    """All-gather rows split unevenly, `counts[r]` on rank r: (sum(counts), ...) on every rank. One all-gather,
    padded to the largest count."""
    if not rows.distributed:
        return local
    c = max(1, max(counts))
    padded = local.new_zeros((c,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((c * rows.world,) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=rows.group)
    return torch.cat([out[i * c: i * c + counts[i]] for i in range(rows.world)])
