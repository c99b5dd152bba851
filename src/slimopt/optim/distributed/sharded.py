"""A parameter as its step sees it: a window of the whole tensor, which for an FSDP2 parameter is this rank's rows.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns every parameter and its gradient into a DTensor sharded on
dim 0 (``Shard(0)``): each rank holds a contiguous block of rows, in ``torch.chunk`` sizes (the last ranks may hold
fewer rows, or none). A rank's rows are elements [offset, offset + local numel) of the flattened tensor, which is
all an element-wise step needs to know: it runs on the local tensor through the same routes as a plain tensor
(``routes.py``), drawing its stochastic rounding from the one counter-based stream at `offset` (noise.py) and
keeping its moments' blocks on the local elements (the blocks of one process wherever the shard's first element
starts a block: any matrix whose rows hold whole blocks, or whose shards do). ``Target`` is that view, for a plain
tensor too (offset 0, one process's rows).

Details: docs/modules.md, ``slimopt.optim.distributed.sharded``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.codecs import FactoredCodec, FactoredRows, Window, factored_means, resolve_codecs
from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES, MOMENTS, PARAM_STREAM
from slimopt.optim.distributed.shardcomm import (  # noqa: F401
    Rows,
    all_reduce,
    chosen_per_rank,
    chunk_bounds,
    gather_rows,
    gather_var_rows,
    held_whole,
    is_sharded,
    reduce_scatter_rows,
    rows_of,
    chunks_of,
)

__all__ = ["Rows", "Space", "Target", "Streams", "is_sharded", "rows_of", "target_of", "check_agreement", "moment_codecs",
           "RowShardedFactored", "local_selection", "space_of", "chunks_of", "local_shape", "effective_rank"]


# ----------------------------------------------------------------------------------------------------------------
# the window a step runs on


class Target:
    """One parameter at one step: ``param`` as the optimizer holds it (its state's key), ``p`` and ``grad`` the
    tensors the step reads and writes (the whole tensor, or this rank's rows of an FSDP2 parameter), ``rows``
    where those rows lie (one process: all of them) and ``index`` the parameter's position in the optimizer (its
    random streams' key)."""

    __slots__ = ("param", "p", "grad", "rows", "index")

    def __init__(self, param: Tensor, p: Tensor, grad: Tensor, rows: Rows, index: int) -> None:
        self.param, self.p, self.grad, self.rows, self.index = param, p, grad, rows, index

    @property
    def shape(self) -> torch.Size:
        """The whole tensor's shape."""
        return self.param.shape

    @property
    def split(self) -> bool:
        """Whether other ranks hold rows of this tensor."""
        return self.rows.distributed

    @property
    def offset(self) -> int:
        """The flat position of the window's first element in the whole tensor."""
        return self.rows.start * math.prod(self.param.shape[1:])

    def space(self) -> "Space":
        return Space(self.param.shape, self.rows if self.rows.distributed else None)

    def streams(self, group: dict[str, Any], step: int, moment_offset: int | None = None) -> "Streams":
        """The step's random streams, read from this window's elements (moments: from `moment_offset`, the
        window's own offset unless the moments live in a subspace of another shape)."""
        return Streams(group["seed"], self.index, step, self.offset,
                       self.offset if moment_offset is None else moment_offset, self.rows.start)


class Streams:
    """``stream(i, start)``: the counter-based stream (noise.py) of moment i (or of the weight's stochastic
    rounding, ``rules.PARAM_STREAM``) of one parameter at one step, read from element `start` of the window: the
    whole tensor's stream from the window's offset, so every window and every shard draws what its elements draw
    in one process. ``columns(a, k)``: a column window's own stream (its elements are no range of the tensor's)."""

    __slots__ = ("seed", "index", "step", "weight_offset", "moment_offset", "row0")

    def __init__(self, seed: int, index: int, step: int, weight_offset: int, moment_offset: int, row0: int) -> None:
        self.seed, self.index, self.step = seed, index, step
        self.weight_offset, self.moment_offset, self.row0 = weight_offset, moment_offset, row0

    def __call__(self, i: int, start: int):
        offset = self.weight_offset if i == PARAM_STREAM else self.moment_offset
        return P.stream(self.seed, self.index, self.step, i).at(offset + start)

    def columns(self, first: int, width: int):
        """The weight's stream for the column window [first, first + width): keyed by the window, read from this
        rank's first row of it."""
        return P.stream(self.seed, self.index, self.step, PARAM_STREAM).fork(first).at(self.row0 * width)


def _local(t: Tensor) -> Tensor:
    # DTensor.to_local() is an autograd function (some microseconds a call); a step reads the tensor itself
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def target_of(opt, param: Tensor, grad: Tensor | None = None) -> Target:
    """The step's view of `param` and its gradient (param.grad unless given): the tensors and rows it steps, from a
    cache of each parameter's rows (``rows_of`` costs ~0.5 ms of mesh look-ups)."""
    grad = param.grad if grad is None else grad
    if grad.is_sparse:
        raise RuntimeError("slimopt does not support sparse gradients (use a dense embedding)")
    cache = opt._geometry
    known = cache.get(param)
    if known is None or known[2] is not type(grad):
        known = cache[param] = _geometry(opt, param, grad)
    rows, index, _, dtensor = known
    if dtensor:
        return Target(param, _local(param), _local(grad), rows, index)
    return Target(param, param, grad, rows, index)


def _geometry(opt, param: Tensor, grad: Tensor) -> tuple[Rows, int, type, bool]:
    """(rows, index, the gradient's type, whether it is a DTensor) of a parameter: checked once, when first seen
    with such a gradient."""
    if grad.is_complex() or param.is_complex():
        raise RuntimeError("slimopt does not support complex parameters or gradients")
    if is_sharded(param):
        if not is_sharded(grad):
            raise ValueError("a DTensor parameter needs a DTensor gradient (FSDP2 sets one); got a "
                             f"{type(grad).__name__}")
        if tuple(grad.placements) != tuple(param.placements) or grad.device_mesh != param.device_mesh:
            raise ValueError(f"gradient placements {tuple(grad.placements)} differ from the parameter's "
                             f"{tuple(param.placements)}")
        rows = rows_of(param)
        check_agreement(opt, rows)
    else:
        total = param.shape[0] if param.dim() > 0 else 1
        rows = Rows(total, 0, total)
    return rows, opt._where[param][2], type(grad), is_sharded(param)


# ----------------------------------------------------------------------------------------------------------------
# agreement between ranks


def check_agreement(opt, rows: Rows) -> None:
    """Once per optimizer: every rank of the shard group indexes the same parameters, with the same global shapes
    and settings, in the same order. Seeded choices are functions of the parameter index, so a rank that built its
    groups in another order would silently draw other subspaces; this turns that into a ValueError."""
    if getattr(opt, "_slimopt_ranks_agree", False) or not rows.distributed:
        return
    mine = []
    for gi, group in enumerate(opt.param_groups):
        keys = ("rule", "projector", "rank", "density", "update_gap", "seed", "proj_side", "proj_dtype", "codec",
                "m_codec", "v_codec", "state_bits")
        settings = tuple(str(group.get(k)) for k in keys)
        for p in group["params"]:
            mine.append((gi, opt._where[p][2], tuple(p.shape), str(p.dtype), settings))
    everyone: list = [None] * rows.world
    dist.all_gather_object(everyone, mine, group=rows.group)
    for r, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise ValueError(f"ranks disagree on the optimizer's parameters: rank {rows.rank} and group rank {r} "
                             f"differ at parameter position {diff} (index, shape, dtype or settings); build the "
                             f"model and the optimizer the same way on every rank")
    opt._slimopt_ranks_agree = True


# ----------------------------------------------------------------------------------------------------------------
# codecs


class RowShardedFactored(FactoredCodec):
    """Adafactor-style second moment (``FactoredCodec``) of a 2-D moment whose rows are spread over ranks: each rank
    keeps the means of its rows and of its chunk of the columns (split as torch.chunk splits them,
    ``shardcomm.chunks_of``), so that nothing of it is on every rank between steps. Decoding needs every column
    mean, and the new column sums span every row: its window (``open``, ``ShardFactoredRows``; the C kernel and the
    eager windows alike) all-reduces the sums and the next step decodes with that result; the whole-tensor
    decode / encode here gather the means and reduce-scatter the sums. mean(col) equals the mean of v (and of the
    row means)."""

    def __init__(self, rows: Rows):
        self.rows = rows
        # the chunks of column means created zero, by id (every rank creates its chunk of a moment at the same step)
        self.fresh: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def columns(self, n: int) -> Rows:
        """This rank's chunk of n columns."""
        return chunks_of(self.rows, n)

    def whole_columns(self, key, state, n: int) -> Tensor:
        """Every column mean, gathered from the ranks' chunks."""
        return gather_rows(state[key + "_col"], self.columns(n))

    def init(self, key, shape, device):
        if len(shape) != 2:
            return super().init(key, shape, device)
        chunk = torch.zeros(self.columns(shape[1]).local, dtype=torch.float32, device=device)
        self.fresh[id(chunk)] = chunk
        return {key: torch.zeros(shape[0], dtype=torch.float32, device=device), key + "_col": chunk}

    def nbytes(self, shape):
        if len(shape) != 2:
            return super().nbytes(shape)
        return 4 * (shape[0] + self.columns(shape[1]).local)

    def decode(self, key, state, shape):
        if len(shape) != 2:
            return super().decode(key, state, shape)
        row, col = state[key], self.whole_columns(key, state, shape[1])
        denom = col.mean().clamp_min(torch.finfo(torch.float32).tiny)
        return torch.outer(row, col) / denom

    def encode(self, key, x, state, generator=None, noise=None):
        if x.dim() != 2 or key + "_col" not in state:
            return super().encode(key, x, state, generator)
        columns = self.columns(x.shape[1])
        work, mine = reduce_scatter_rows(x.sum(dim=0, dtype=torch.float64), columns)
        state[key].copy_(factored_means(x, 1, x.shape[1]))
        work.wait()
        state[key + "_col"].copy_((mine[: columns.local] / max(1, self.rows.total)).float())

    def open(self, key, state, shape):
        if len(shape) != 2 or key + "_col" not in state:
            return super().open(key, state, shape)
        return ShardFactoredRows(key, state, shape, self)


class ShardFactoredRows(FactoredRows):
    """``codecs.FactoredRows`` of a row shard: it decodes with every column mean, and the column sums of every rank's
    rows are all-reduced (with the step's others, left running after the step) before each rank keeps its chunk of
    the means divided by all the rows. The next step's windows decode with every mean that all-reduce gave
    (``Batch.hold_columns``), so no collective waits in a step; only a window with nothing held (the first step, a
    load) gathers them, at its first read (a window opened for its pointers alone gathers nothing)."""

    def __init__(self, key: str, state, shape: torch.Size, codec: RowShardedFactored) -> None:
        Window.__init__(self, FactoredCodec(), key, state)
        self.cols = shape[1]
        self.group_rows = codec.rows
        self.columns = codec.columns(shape[1])
        self.rows = codec.rows.total  # the column means divide by every rank's rows
        self.col_sum = torch.zeros(self.cols, dtype=torch.float64, device=state[key].device)
        self.codec = codec
        self.batch = None
        self._whole: Tensor | None = None
        self._denom: Tensor | None = None

    @property
    def col(self) -> Tensor:
        """Every column mean, as the last step stored them (zeros for a moment created this step)."""
        if self._whole is None:
            chunk = self.state[self.key + "_col"]
            if self.codec.fresh.get(id(chunk)) is chunk and chunk._version == 0:
                self._whole = chunk.new_zeros(self.cols)
            else:  # held for the step where the last step's all-reduce wrote the chunk (a load: gathered)
                held = held_whole(self.batch.columns if self.batch is not None else None, chunk)
                self._whole = held if held is not None else gather_rows(chunk, self.columns)
        return self._whole

    @property
    def denom(self) -> Tensor:
        """The mean of v: the mean of the column means."""
        if self._denom is None:
            self._denom = self.col.mean().clamp_min(torch.finfo(torch.float32).tiny)
        return self._denom

    def defer_to(self, batch) -> None:
        self.batch = batch

    def close(self):
        if self.batch is not None:  # summed with the step's other column sums in one all-reduce, started at the end
            # of the step and finished by the next (only the next step reads the column means)
            self.batch.reduce(self.group_rows, self.col_sum, "sum", self._write, after_step=True)
            return
        self._write(all_reduce(self.col_sum, self.group_rows))

    def _write(self, col_sum: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's chunk of the column means from every rank's sums; returns the chunk and every mean."""
        whole = (col_sum / self.rows).float()
        chunk = self.state[self.key + "_col"]
        chunk.copy_(whole[self.columns.start: self.columns.stop])
        return chunk, whole


@dataclass(frozen=True)
class Space:
    """The tensor a rule runs on (a gradient or its projection): global shape, and its rows across ranks
    (``rows`` None: every rank holds all of it, identically)."""

    shape: torch.Size
    rows: Rows | None

    @property
    def split(self) -> bool:
        return self.rows is not None and self.rows.distributed

    @property
    def offset(self) -> int:
        """The flat position of this rank's first element of the space."""
        return self.rows.start * math.prod(self.shape[1:]) if self.rows is not None else 0


def moment_codecs(opt, group: dict[str, Any], space: Space, dtype: torch.dtype) -> list[tuple[str, Any]]:
    """The codecs of a rule's moments, chosen from the *global* element count (the same on every rank and in one
    process: a shard below ``SMALL_NUMEL`` of a large tensor is not stored fp32). A factored second moment of a
    row-split 2-D tensor becomes ``RowShardedFactored``. Kept by what decides them (read the list, do not change
    it)."""
    split = space.split
    key = (group["rule"], group["codec"], group["m_codec"], group["v_codec"], group["state_bits"], tuple(space.shape),
           dtype, space.rows if split else None)
    codecs = opt._codec_lists.get(key)
    if codecs is not None:
        return codecs
    m_spec, v_spec = resolve_codecs(group["codec"], group["m_codec"], group["v_codec"], group["state_bits"])
    numel = math.prod(space.shape)
    codecs = []
    for k, role in MOMENTS[group["rule"]]:
        codec = opt._codec(m_spec if role == "m" else v_spec, role, numel, dtype)
        if codec.name == "factored" and len(space.shape) == 2 and split:
            codec = RowShardedFactored(space.rows)
        codecs.append((k, codec))
    opt._codec_lists[key] = codecs
    return codecs


def local_shape(space: Space) -> torch.Size:
    """The shape of this rank's part of `space`."""
    if space.rows is None:
        return space.shape
    return torch.Size((space.rows.local,) + tuple(space.shape[1:]))


# ----------------------------------------------------------------------------------------------------------------
# projections


def local_selection(index: Tensor, rows: Rows) -> tuple[Tensor, int]:
    """The chosen global rows (sorted `index`) that this rank holds, as local row numbers, and how many chosen rows
    come before them (their position in the (r, n) subspace tensor)."""
    if not rows.distributed:
        return index, 0
    mine = (index >= rows.start) & (index < rows.stop)
    before = int((index < rows.start).sum().item())
    return index[mine] - rows.start, before


def effective_rank(projector: str, r: int, shape, state) -> int:
    """The subspace size the moments really have: the stored basis's columns; an SVD-based basis has at most
    min(m, n) of them even when r asks for more."""
    if projector not in P.ORTHO_PROJECTORS:
        return r
    if "proj" in state:
        return state["proj"].shape[1]
    return min(r, *shape) if projector in ("svd", "randomized_svd") else r


def space_of(group: dict[str, Any], projector: str, side: str | None, shape: torch.Size, r: int, rows: Rows,
             state) -> Space:
    """Where a projected step's subspace tensor (its gradient, direction and moments) lives: a left projection's
    (r, n) split by its rows over the ranks (``chunks_of``), or on every rank where the group's rule needs the
    whole matrix (Muon, TACO); a right one's (m, r) and ``columns``' (m, r) in the parameter's rows, the ``rows``
    projector's (r, n) in the chosen rows each rank holds."""
    m, n = shape
    r = effective_rank(projector, r, shape, state)
    split = rows if rows.distributed else None
    if projector in P.ORTHO_PROJECTORS:
        if side != "left":
            return Space(torch.Size((m, r)), split)
        whole = split is None or group["rule"] not in ELEMENTWISE_RULES
        return Space(torch.Size((r, n)), None if whole else chunks_of(rows, r))
    if projector == "columns":
        return Space(torch.Size((m, r)), split)
    if split is None:
        return Space(torch.Size((r, n)), None)
    sel, before = local_selection(state["proj_index"], rows)
    return Space(torch.Size((r, n)), rows.sub(r, before, before + sel.numel()))
