"""SlimOptimizer steps for parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 turns every parameter and its gradient into a DTensor sharded on dim 0 (``Shard(0)``): each rank holds a
contiguous block of rows, in ``torch.chunk`` sizes (the last ranks may hold fewer rows, or none). ``update`` is the
sharded twin of ``SlimOptimizer._update``: it works on the local rows (``to_local()``) and communicates only where
a method's step spans rows held by different ranks. docs/distributed.md gives the design and the communication
volume of every choice; in short:

- Elementwise and row-wise work (AdamW, Lion, SGDM, signSGD, the codecs, ``block``) runs on the local shard with
  no communication. Quantization blocks are cut per local shard and never straddle two ranks; when the local
  element count of every shard is a multiple of the block size (any matrix whose row length is a multiple of
  256), they are exactly the blocks of a single-process run, whatever the world size.
- ``factored`` second moments keep their row means local and all-reduce the column sums (n values a step).
- Orthonormal projections of a row-sharded G (m x n): a right projection G Q (Q: n x r, replicated) is local.
  A left projection Q^T G sums over rows: each rank holds its rows of Q, and the (r x n) projection is
  all-reduced every step; its moments are replicated. (``proj_side="right"`` avoids that cost; see the docs.)
- Refreshes: ``svd`` gathers G on the first rank of the shard group, decomposes it there and broadcasts the basis
  (the simple fallback); ``randomized_svd`` runs the range finder of ``projectors.randomized_basis`` with the same
  random sketch on sharded rows: products with G^T are all-reduced (n x k), products with G are all-gathered
  (m x k), and the small QRs and SVDs run on every rank on identical data; ``random``, ``columns``, ``rows`` and
  ``block`` draw the same seeded choice on every rank and need no communication (``rows``: every rank keeps the
  chosen rows it holds).
- Muon orthogonalizes whole matrices: the momentum is updated on the local rows, the rows to orthogonalize are
  all-gathered in the iteration's dtype (bf16: 2 bytes a value), and every rank iterates on the whole matrix and
  keeps its rows (``muon.direction``): the same step as one process, bit for bit.
- TACO (arXiv 2610.02199) picks, per column, the largest entry over all rows: a max-loc all-reduce of one
  packed 64-bit key per column (|value|, row, sign) for the bare direction; with a history, the stored entries'
  gradients are all-reduced (k x n) and every rank's k best candidates merged by k max-loc all-reduces, and
  the history (k x n, a few bytes per column) is replicated. Both are exact: the same step as one process.
- Random choices are pure functions of (seed, parameter index, refresh index), so every rank draws the same
  bases, coordinates and blocks; ``check_agreement`` verifies once, at the first sharded step, that all ranks
  index the same parameters with the same shapes. Stochastic rounding reads the single-process counter-based
  stream from the shard's first element (noise.py): every shard draws the numbers its elements draw in one
  process.

The optimizer state holds plain local tensors (the shard of each moment, replicated bases, indices and steps);
``slimopt.optim.portable`` turns it into DTensors for ``torch.distributed.checkpoint``. The row split and the
collectives are in ``shardcomm.py``, the distributed refreshes in ``sharded_bases.py``, TACO's max-loc steps in
``sharded_taco.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import compiled
from . import muon
from . import projectors as P
from . import taco
from .codecs import FactoredCodec, factored_means, resolve_codecs
from .noise import CounterStream
from .rules import MOMENTS, PARAM_STREAM, advance, apply_update, comp_of, direction, rounding_of
from .shardcomm import (Rows, all_reduce, chosen_per_rank, chunk_bounds, gather_var_rows, is_sharded,  # noqa: F401
                        rows_of)
from .sharded_bases import randomized_basis, rows_of_basis, svd_basis
from .sharded_taco import pack_keys, taco_update, unpack_keys  # noqa: F401

__all__ = ["Rows", "Space", "is_sharded", "rows_of", "update", "check_agreement", "moment_codecs",
           "RowShardedFactored", "local_selection"]

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
    """Adafactor-style second moment (``FactoredCodec``) of a 2-D moment whose rows are spread over ranks: the
    row means are local, the column means span every row, so encode all-reduces the column sums (n values).
    decode divides by mean(col), which equals the mean of v (and of the row means) without communication."""

    def __init__(self, rows: Rows):
        self.rows = rows

    def decode(self, key, state, shape):
        if len(shape) != 2:
            return super().decode(key, state, shape)
        row, col = state[key], state[key + "_col"]
        denom = col.mean().clamp_min(torch.finfo(torch.float32).tiny)
        return torch.outer(row, col) / denom

    def encode(self, key, x, state, generator=None):
        if x.dim() != 2 or key + "_col" not in state:
            return super().encode(key, x, state, generator)
        col = all_reduce(x.sum(dim=0, dtype=torch.float64), self.rows) / max(1, self.rows.total)
        state[key].copy_(factored_means(x, 1, x.shape[1]))
        state[key + "_col"].copy_(col.float())


@dataclass(frozen=True)
class Space:
    """The tensor a rule runs on (a gradient or its projection): global shape, and its rows across ranks
    (``rows`` None: every rank holds all of it, identically)."""

    shape: torch.Size
    rows: Rows | None

    @property
    def split(self) -> bool:
        return self.rows is not None and self.rows.distributed


def moment_codecs(opt, group: dict[str, Any], space: Space, dtype: torch.dtype) -> list[tuple[str, Any]]:
    """The codecs of a rule's moments, chosen from the *global* element count (the same on every rank and in one
    process: a shard below ``SMALL_NUMEL`` of a large tensor is not stored fp32). A factored second moment of a
    row-split 2-D tensor becomes ``RowShardedFactored``."""
    m_spec, v_spec = resolve_codecs(group["codec"], group["m_codec"], group["v_codec"], group["state_bits"])
    numel = math.prod(space.shape)
    out = []
    for key, role in MOMENTS[group["rule"]]:
        codec = opt._codec(m_spec if role == "m" else v_spec, role, numel, dtype)
        if codec.name == "factored" and len(space.shape) == 2 and space.split:
            codec = RowShardedFactored(space.rows)
        out.append((key, codec))
    return out


def _stream(group, space: Space, *parts: int) -> CounterStream:
    """The stochastic-rounding stream of one moment (or of the weight): the single-process stream (keyed by the
    group's seed and `parts`) read from the shard's first element, so that every shard draws the numbers of its
    elements in the single-process step."""
    offset = space.rows.start * math.prod(space.shape[1:]) if space.rows is not None else 0
    return P.stream(group["seed"], *parts).at(offset)


def _local_shape(space: Space) -> torch.Size:
    if space.rows is None:
        return space.shape
    return torch.Size((space.rows.local,) + tuple(space.shape[1:]))


def init_moments(state: dict[str, Tensor], codecs, local_shape: torch.Size, device) -> None:
    """Zero moments of the local shape and a fresh ``moment_step`` (as ``SlimOptimizer._init_moments``)."""
    for key, codec in codecs:
        state.update(codec.init(key, local_shape, device))
    state["moment_step"] = torch.zeros((), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# the step


def update(opt, p: Tensor, group: dict[str, Any]) -> None:
    """One step of a DTensor parameter from its DTensor gradient, on the local shard (see the module docstring).

    Follows ``SlimOptimizer._update`` line by line; what differs is where rows of other ranks are needed.
    """
    grad = p.grad
    if not is_sharded(grad):
        raise ValueError("a DTensor parameter needs a DTensor gradient (FSDP2 sets one); got a "
                         f"{type(grad).__name__}")
    if tuple(grad.placements) != tuple(p.placements) or grad.device_mesh != p.device_mesh:
        raise ValueError(f"gradient placements {tuple(grad.placements)} differ from the parameter's "
                         f"{tuple(p.placements)}")
    if grad.is_complex() or p.is_complex():
        raise RuntimeError("slimopt does not support complex parameters or gradients")
    cache = opt.__dict__.setdefault("_slimopt_rows", {})  # rows_of costs ~0.5 ms (mesh lookups): once per param
    rows = cache.get(id(p))
    if rows is None or (p.dim() and rows.local != p.to_local().shape[0]):
        rows = cache[id(p)] = rows_of(p)
    check_agreement(opt, rows)
    p_loc, g_loc = p.to_local(), grad.to_local()
    state = opt.state[p]
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    step = advance(state["step"])
    g = g_loc if g_loc.dtype in (torch.float32, torch.float64) else g_loc.float()
    layout = opt._layout(p, group)
    space = Space(p.shape, rows)

    full, coef, resid = None, 0.0, None
    if layout == "none":
        if _fused(opt, p, p_loc, group, state, g, space):
            return
        full, coef = _stateful(opt, p, group, state, g, step, space)
    elif layout == "block":
        def fresh() -> None:
            init_moments(state, moment_codecs(opt, group, space, p.dtype), _local_shape(space), p_loc.device)

        # the active blocks are a pure function of (seed, refresh index): the same on every rank
        if opt._block_turn(p, group, state, step, fresh):
            full, coef = _stateful(opt, p, group, state, g, step, space)
        else:
            resid = g
    else:
        full, coef, resid = _projected(opt, p, group, state, g, step, layout, rows, g_loc.dtype)

    rounding = rounding_of(group, p_loc)  # the shard's own compensation, and the shard's rounding stream
    gen = _stream(group, space, opt._where[p][2], step, PARAM_STREAM) if rounding == "stochastic" \
        else None
    apply_update(p_loc, full, coef, resid, group, comp_of(state, p_loc, rounding), gen)


def _fused(opt, p, p_loc, group, state, g, space: Space) -> bool:
    """The compiled full-space AdamW step on the local shard, where it applies (no collective inside)."""
    if not group["compile"] or group["rule"] != "adamw" or rounding_of(group, p_loc) != "nearest":
        return False
    codecs = moment_codecs(opt, group, space, p.dtype)
    if not compiled.supported(codecs) or any(isinstance(c, RowShardedFactored) for _, c in codecs):
        return False
    if codecs[0][0] not in state:
        init_moments(state, codecs, _local_shape(space), p_loc.device)
    compiled.adamw_step(p_loc, g, state, codecs, group, advance(state["moment_step"]))
    return True


def _stateful(opt, p, group, state, g: Tensor, step: int, space: Space) -> tuple[Tensor, float]:
    """The rule on g (local rows of `space`, fp32) against codec-stored moments of the same local shape."""
    if taco.owns(group, space.shape):
        norm_shape = p.shape if p.dim() == 2 else space.shape
        if space.split:
            return taco_update(state, g, group, norm_shape, space.rows)
        return taco.update(state, g, group, norm_shape)
    codecs = moment_codecs(opt, group, space, p.dtype)
    if codecs[0][0] not in state:
        init_moments(state, codecs, g.shape, g.device)
    age = advance(state["moment_step"])
    mom = {key: codec.decode(key, state, g.shape) for key, codec in codecs}
    if group["rule"] == "muon" and space.split:  # the iteration needs the whole matrix: all-gather its rows
        d, c = muon.direction(g, mom["momentum_buffer"], group, p.shape, rows=space.rows)
    else:
        d, c = direction(group["rule"], g, mom, age, group, shape=p.shape)
    index = opt._where[p][2]
    for i, (key, codec) in enumerate(codecs):
        gen = _stream(group, space, index, step, i) if codec.needs_generator else None
        codec.encode(key, mom[key], state, generator=gen)
    return d, c


# ----------------------------------------------------------------------------------------------------------------
# projections


def local_selection(index: Tensor, rows: Rows) -> tuple[Tensor, int]:
    """The chosen global rows (sorted `index`) that this rank holds, as local row numbers, and how many chosen rows
    come before them (their position in the (r, n) subspace tensor)."""
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


def _space_of(projector: str, side: str | None, shape: torch.Size, r: int, rows: Rows, state) -> Space:
    m, n = shape
    r = effective_rank(projector, r, shape, state)
    if projector in P.ORTHO_PROJECTORS:
        return Space(torch.Size((r, n)), None) if side == "left" else Space(torch.Size((m, r)), rows)
    if projector == "columns":
        return Space(torch.Size((m, r)), rows)
    sel, before = local_selection(state["proj_index"], rows)
    return Space(torch.Size((r, n)), rows.sub(r, before, before + sel.numel()))


def _projected(opt, p, group, state, g: Tensor, step: int, projector: str, rows: Rows, grad_dtype: torch.dtype):
    """The projected step of a shard: g is its fp32 gradient, grad_dtype the gradient's own dtype (what
    ``proj_dtype="grad"`` projects in). A left projection sums the ranks' partial products in fp32 after each is
    rounded to the products' dtype, so in a 16-bit one it differs from the single-process step by those roundings."""
    shape = p.shape
    side = P.side_for(shape, group["proj_side"]) if projector in P.ORTHO_PROJECTORS else None
    r = P.subspace_rank(shape, projector, side, group["rank"], group["density"])
    if r == 0:
        return None, 0.0, g
    key = "proj" if projector in P.ORTHO_PROJECTORS else "proj_index"
    if key not in state or P.refresh_due(step, group["update_gap"]):
        _refresh(opt, p, group, state, g, step, projector, side, r, key, rows)
    basis = state[key]
    if projector == "rows":
        basis, _ = local_selection(basis, rows)
    ortho = projector in P.ORTHO_PROJECTORS
    mm = P.matmul_dtype(group["proj_dtype"], grad_dtype, g.device) if ortho else g.dtype
    q = basis.to(mm) if ortho else basis
    low = P.down(projector, side, g.to(mm), q).to(g.dtype)
    if side == "left":
        low = all_reduce(low.contiguous(), rows)  # Q^T G = sum over ranks of Q_local^T G_local: (r, n)
    space = _space_of(projector, side, shape, r, rows, state)
    d, c = _stateful(opt, p, group, state, low, step, space)
    full = P.up(projector, side, d.to(mm), q, g.shape).to(g.dtype)
    whole = r == (shape[0] if side == "left" or projector == "rows" else shape[1])
    resid = None if group["free_rule"] == "none" or whole else P.residual(projector, side, g, low, basis)
    return full, c * float(group["scale"]), resid


def _refresh(opt, p, group, state, g: Tensor, step: int, projector: str, side: str | None, r: int, key: str,
             rows: Rows) -> None:
    """Choose the subspace anew, identically on every rank; keep / reset / rotate the moments."""
    index = opt._where[p][2]
    gen = P.generator(p.device, group["seed"], index, P.refresh_index(step, group["update_gap"]))
    m, n = p.shape
    old = state.get(key)
    new = None
    if projector in ("svd", "randomized_svd"):
        if projector == "svd":
            new, status = svd_basis(g, r, side, rows)
        else:
            new, status = randomized_basis(g, r, side, gen, group["oversample"], group["power_iters"], rows)
        if status == "nonfinite":
            opt._warn_once("nonfinite", "slimopt: a non-finite gradient reached a subspace refresh; keeping the "
                           "previous subspace (warned once)")
        elif status != "ok":
            opt._warn_once("svd", f"slimopt: the subspace decomposition failed ({status}); keeping the previous "
                           "subspace (warned once)")
        if new is None and old is None:
            new = rows_of_basis(P.random_basis(m if side == "left" else n, r, gen, g.device, g.dtype), side, rows)
    elif projector == "random":
        new = rows_of_basis(P.random_basis(m if side == "left" else n, r, gen, g.device, g.dtype), side, rows)
    else:
        new = P.random_coordinates(n if projector == "columns" else m, r, gen, g.device)
    if new is None:
        return
    if projector in P.ORTHO_PROJECTORS and p.dtype in (torch.bfloat16, torch.float16):
        new = new.to(p.dtype)
    if old is not None:
        _carry_moments(opt, p, group, state, projector, side, r, rows, old, new, step)
    state[key] = new

def _carry_moments(opt, p, group, state, projector, side, r, rows: Rows, old: Tensor, new: Tensor,
                   step: int) -> None:
    """on_refresh for a sharded parameter: keep, reset or rotate the moments into the new subspace."""
    shape = p.shape
    key = "proj_index" if projector == "rows" else "proj"
    old_space = _space_of(projector, side, shape, r, rows, {key: old})
    new_space = _space_of(projector, side, shape, r, rows, {key: new})
    if taco.owns(group, old_space.shape):
        if group["on_refresh"] != "keep":
            taco.reset(state)
        return
    old_codecs = moment_codecs(opt, group, old_space, p.dtype)
    if old_codecs[0][0] not in state:
        return
    new_codecs = moment_codecs(opt, group, new_space, p.dtype)
    mode = group["on_refresh"]
    if mode == "reset":
        init_moments(state, new_codecs, _local_shape(new_space), p.to_local().device)
        return
    if mode == "keep" and (projector != "rows" or not rows.distributed):
        return  # the same local rows: nothing moves
    index = opt._where[p][2]
    rot = None
    if mode == "project" and projector in P.ORTHO_PROJECTORS and side == "left":
        # R = Q_new^T Q_old sums over the rows of both bases, which are split like the parameter's: (r, r)
        rot = all_reduce(new.float().transpose(0, 1) @ old.float(), rows)
    moved = projector == "rows" and (old_space.rows.start, old_space.rows.stop) != (new_space.rows.start,
                                                                                   new_space.rows.stop)
    moments = {}
    for key_m, codec in old_codecs:
        # the codec's best estimate (an error-feedback residual included), as SlimOptimizer._refresh rotates it
        x = getattr(codec, "estimate", codec.decode)(key_m, state, _local_shape(old_space))
        if mode == "keep":
            # rows: moment row j stays at position j of the (r, n) subspace tensor, and position j now sits on
            # the rank that holds the newly chosen row: gather the (r, n) moment, keep the new local part.
            x = gather_var_rows(x, rows, chosen_per_rank(old, rows))[new_space.rows.start: new_space.rows.stop]
        elif rot is not None:
            x = (rot * rot if opt._role(group, key_m) == "v" else rot) @ x
        elif projector == "rows":
            old_sel, _ = local_selection(old, rows)
            new_sel, _ = local_selection(new, rows)
            x = P.rotate("rows", None, old_sel, new_sel, x, squared=False) if old_sel.numel() else \
                x.new_zeros((new_sel.numel(), x.shape[1]))
        else:
            x = P.rotate(projector, side, old, new, x, squared=opt._role(group, key_m) == "v")
        moments[key_m] = x.contiguous()
    if mode == "keep" and not moved:
        return  # this rank's part did not move: its stored moments stand as they are
    for key_m, codec in new_codecs:
        if moved:
            state.update(codec.init(key_m, _local_shape(new_space), p.to_local().device))
        elif hasattr(codec, "clear_feedback"):
            codec.clear_feedback(key_m, state)  # the carried residual was in the old coordinates
    for i, (key_m, codec) in enumerate(new_codecs):
        gen = _stream(group, new_space, index, step, i, 1) if codec.needs_generator else None
        codec.encode(key_m, moments[key_m], state, generator=gen)
