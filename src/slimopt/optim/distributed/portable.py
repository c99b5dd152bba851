"""A world-size-free form of SlimOptimizer's state, for ``torch.distributed.checkpoint`` (DCP) and resharding.

Inside the optimizer a sharded parameter's state is what one rank needs (its rows of each moment, quantized per
local shard; its chunks of the rest: ``sharded.py``). Those layouts depend on the world size, so a checkpoint
stores another form, in which every tensor is either

- **row-sharded like its parameter**: dim 0 is the parameter's rows; saved as a DTensor with the parameter's mesh
  and placements (a plain tensor in one process), so DCP reshards it to any world size;
- **chunked**: dim 0 (or dim 1: TACO's (k, n) history) split over the same ranks as torch.chunk splits it
  (``shardcomm.chunks_of``: a left projection's subspace rows, a right basis's n rows, column statistics); or
- **replicated**: the same on every rank (steps, ``proj_index``, TACO's history of a left projection's subspace,
  Muon's subspace momentum under a left projection), saved once.

Details: docs/modules.md, ``slimopt.optim.distributed.portable``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm import quant as Q
from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.codecs import BlockCodec, TernaryCodec
from slimopt.optim.algorithm.rules import COMP_KEY, ELEMENTWISE_RULES
from slimopt.optim.distributed import sharded as S

__all__ = ["LAYOUT", "COUNTERS", "portable_state", "wanted", "is_portable", "to_portable", "saved_state",
           "import_param", "layout_of", "move_state"]

LAYOUT = "slimopt-portable-1"
COUNTERS = ("step", "moment_step")  # 0-D fp32 CPU tensors in the optimizer, in either form
_REPLICATED_KEYS = COUNTERS + ("proj_index",)


@contextlib.contextmanager
def portable_state(opt) -> Iterator[None]:
    """Make ``opt.state_dict()`` return the portable form (it does by itself when parameters are DTensors)."""
    before = getattr(opt, "_portable_state", False)
    opt._portable_state = True
    try:
        yield
    finally:
        opt._portable_state = before


def wanted(opt) -> bool:
    return getattr(opt, "_portable_state", False) or any(
        S.is_sharded(p) for g in opt.param_groups for p in g["params"])


def is_portable(state_dict: dict[str, Any]) -> bool:
    return any(g.get("state_layout") == LAYOUT for g in state_dict.get("param_groups", []))


# ----------------------------------------------------------------------------------------------------------------
# what lives where


def _side(p, group) -> str | None:
    if group["projector"] in P.ORTHO_PROJECTORS and p.dim() == 2:
        return P.side_for(p.shape, group["proj_side"])
    return None


def layout_of(opt, p: Tensor, group: dict[str, Any], key: str) -> str:
    """``"rows"`` (dim 0 is the parameter's rows: saved sharded like it), ``"chunks"`` (dim 0 is split over the
    parameter's ranks as torch.chunk splits it: a left projection's subspace rows, a right basis's rows; saved
    sharded like it too, ``chunks_for``), ``"columns"`` (dim 1 split so) or ``"replicated"`` for a portable key."""
    if key in _REPLICATED_KEYS:
        return "replicated"
    if key.startswith("taco_"):  # each rank keeps its columns, but of a left projection's subspace, which is whole
        if _side(p, group) == "left":
            return "replicated"
        return "chunks" if key == "taco_absmax" else "columns"
    if key.endswith("_col"):  # a factored moment's column means: in chunks of the columns (sharded.RowShardedFactored)
        return "chunks"
    if key == COMP_KEY:  # the weight's Kahan compensation: the weight's shape
        return "rows"
    layout = opt._layout(p, group)
    if layout in ("none", "block"):
        return "rows"
    left = _side(p, group) == "left"
    if key == "proj":
        return "rows" if left else "chunks"
    if not left:
        return "rows"
    return "chunks" if group["rule"] in ELEMENTWISE_RULES else "replicated"  # Muon's iteration: the whole matrix


def chunks_for(p: Tensor, rows: S.Rows, key: str, space: S.Space | None) -> S.Rows:
    """This rank's share of a ``"chunks"`` key (p's rows split as `rows`), whose dim 0 holds in all a right
    basis's n, a factored moment's or TACO's column count or a left projection's r."""
    columns = key.endswith("_col") or key.startswith("taco_")
    total = p.shape[1] if key == "proj" else space.shape[1] if columns else space.shape[0]
    return S.chunks_of(rows, total)


def _space(opt, p, group, state_or_index: dict[str, Tensor], rows: S.Rows) -> tuple[S.Space | None, Tensor | None]:
    """(the moments' Space, the local chosen rows of a ``rows`` projector or None); Space None when the parameter
    keeps no subspace (density 0)."""
    layout = opt._layout(p, group)
    if layout in ("none", "block"):
        return S.Space(p.shape, rows), None
    side = _side(p, group)
    r = P.subspace_rank(p.shape, layout, side, group["rank"], group["density"])
    if r == 0:
        return None, None
    if layout == "rows":
        if "proj_index" not in state_or_index:
            return None, None
        sel, _ = S.local_selection(state_or_index["proj_index"], rows)
        return S.space_of(group, layout, side, p.shape, r, rows, state_or_index), sel
    return S.space_of(group, layout, side, p.shape, r, rows, state_or_index), None


def _placements(rows: S.Rows, dim: int) -> tuple:
    """p's placements with its row split moved to `dim`."""
    if dim == 0:
        return rows.placements
    from torch.distributed.tensor import Shard
    return tuple(Shard(dim) if isinstance(pl, Shard) else pl for pl in rows.placements)


def _param_rows_tensor(local: Tensor, p: Tensor, rows: S.Rows, dim: int = 0) -> Tensor:
    """A tensor whose dim `dim` is this rank's share (`rows`) of a split laid out like p's rows -> a DTensor with
    p's mesh, split on `dim` (or itself in one process)."""
    if not S.is_sharded(p):
        return local
    from torch.distributed.tensor import DTensor
    shape = tuple(local.shape[:dim]) + (rows.total,) + tuple(local.shape[dim + 1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local.contiguous(), rows.mesh, _placements(rows, dim), run_check=False, shape=shape,
                              stride=stride)


def _local_rows(value: Tensor, p: Tensor, rows: S.Rows, dim: int = 0) -> Tensor:
    """This rank's share (`rows`) of dim `dim` of a saved tensor split like p's rows (a DTensor laid out so, any
    DTensor, or a full tensor)."""
    if S.is_sharded(value):
        if (S.is_sharded(p) and value.device_mesh == p.device_mesh
                and tuple(value.placements) == _placements(rows, dim)):
            return value.to_local()
        value = value.full_tensor()
    if value.dim() <= dim or value.shape[dim] != rows.total:
        raise ValueError(f"a saved state tensor of shape {tuple(value.shape)} needs {rows.total} entries on dim "
                         f"{dim} (the parameter's split there)")
    return value.narrow(dim, rows.start, rows.local)


def _replicated(value: Tensor) -> Tensor:
    return value.full_tensor() if S.is_sharded(value) else value


# ----------------------------------------------------------------------------------------------------------------
# what a saved state may hold


def counter(value: Any, key: str, where: str) -> Tensor:
    """A saved step counter in the optimizer's form: a 0-D fp32 tensor on the CPU (advanced there without a device
    sync). torch.optim loads a Python number for ``step`` (older and hand-edited checkpoints hold ``12.0``), so a
    number is taken as well as a one-element tensor."""
    number = None
    if isinstance(value, Tensor) and value.numel() == 1:
        number = float(_replicated(value).item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not number >= 0 or not number.is_integer():  # NaN and inf fail here too
        raise ValueError(f"{where}: {key!r} must be a whole number >= 0 (a Python number or a one-element tensor), "
                         f"got {value!r}")
    return torch.tensor(number, dtype=torch.float32)


def saved_state(values: dict[str, Any], where: str) -> dict[str, Tensor]:
    """One parameter's saved state with its counters in the optimizer's form; anything but tensors (and numbers for
    the counters) is refused, naming `where`, before it could fail a later step."""
    out = {}
    for key, value in values.items():
        if key in COUNTERS:
            out[key] = counter(value, key, where)
        elif isinstance(value, Tensor):
            out[key] = value
        else:
            raise ValueError(f"{where}: {key!r} is a {type(value).__module__}.{type(value).__qualname__}; "
                             f"SlimOptimizer's state holds tensors only (and numbers for {', '.join(COUNTERS)})")
    return out


# ----------------------------------------------------------------------------------------------------------------
# codecs: packed per-shard blocks <-> one code per element


def _row_len(shape) -> int:
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def _compact_scale(shape, block: int) -> bool:
    """Blocks never cross rows (so one scale per (row, block) describes them for any row split)."""
    return len(shape) >= 2 and _row_len(shape) % block == 0


def _unpack(codec, key: str, state, local_shape: torch.Size) -> dict[str, Tensor]:
    """Portable tensors of a blockwise codec's moment: codes, scale (and residual bits), local rows first."""
    n = math.prod(local_shape)
    b = codec.block_size
    nb = state[key + "_scale"].shape[0]
    if isinstance(codec, BlockCodec):
        codes = state[key] if codec.bits == 8 else Q.unpack_bits(state[key], 4)
    else:
        codes = Q.unpack_base3(state[key], nb * b)
    out = {key: codes[:n].to(torch.uint8).view(local_shape)}
    scale = state[key + "_scale"]
    if _compact_scale(local_shape, b):
        out[key + "_scale"] = scale.view(local_shape[0], _row_len(local_shape) // b)
    else:
        out[key + "_scale"] = scale.repeat_interleave(b)[:n].view(local_shape)
    if isinstance(codec, TernaryCodec) and codec.feedback:
        out[key + "_err"] = Q.unpack_base3(state[key + "_err"], nb * b)[:n].to(torch.uint8).view(local_shape)
    return out


def _zero_code(codec) -> int:
    if isinstance(codec, TernaryCodec):
        return 1  # the trit of 0
    zero = torch.zeros(1)
    return int(Q.nearest_codes(zero, Q.get_map(codec.map_name, zero.device))[0])


_lossy_warned = False


def _pack(codec, key: str, parts: dict[str, Tensor], state, local_shape: torch.Size, device) -> None:
    """Rebuild a blockwise codec's state for `local_shape` from per-element codes and scales: copied exactly where
    every new block lies in one saved block, re-quantized otherwise."""
    global _lossy_warned
    n = math.prod(local_shape)
    b = codec.block_size
    codes = parts[key].reshape(-1).to(device=device, dtype=torch.int64)
    scale = parts[key + "_scale"].to(device=device, dtype=torch.float32)
    if _compact_scale(local_shape, b) and scale.shape[-1] * b == _row_len(local_shape) and scale.dim() == 2:
        scale = scale.repeat_interleave(b, dim=1)
    scale = scale.reshape(-1)
    if scale.numel() != n or codes.numel() != n:
        raise ValueError(f"saved {key} holds {codes.numel()} codes and {scale.numel()} scales for a moment of "
                         f"{n} elements")
    state.update(codec.init(key, local_shape, device))
    nb = -(-n // b)
    pad = nb * b - n
    blocks = F.pad(scale, (0, pad), value=float(scale[-1]) if n else 0.0).view(nb, b)
    exact = bool((blocks == blocks[:, :1]).all())
    if exact:
        padded = F.pad(codes, (0, pad), value=_zero_code(codec))
        if isinstance(codec, BlockCodec):
            state[key].copy_(padded.to(torch.uint8) if codec.bits == 8 else Q.pack_bits(padded, 4))
        else:
            state[key].copy_(Q.pack_base3(padded))
            if codec.feedback:
                err = parts[key + "_err"].reshape(-1).to(device=device, dtype=torch.int64)
                state[key + "_err"].copy_(Q.pack_base3(F.pad(err, (0, pad), value=1)))  # padding carries 0
        state[key + "_scale"].copy_(blocks[:, 0])
        return
    if not _lossy_warned:
        _lossy_warned = True
        warnings.warn(f"slimopt: quantized state whose blocks cross rows ({key}, row length not a multiple of {b}) "
                      "was saved at another world size; its values are re-quantized with this layout's blocks "
                      "(warned once)", RuntimeWarning, stacklevel=4)
    if isinstance(codec, TernaryCodec):
        values = (codes - 1).float() * scale
    else:
        values = Q.get_map(codec.map_name, device)[codes] * scale
    codec.encode(key, values.view(local_shape), state, generator=P.stream(0x5EED, n))


def _names(key: str, tensors) -> list[str]:
    """The state tensors of one moment: ``key`` and its codec's suffixed companions."""
    return [key + s for s in ("", "_scale", "_err", "_col") if key + s in tensors]


def _export_moment(codec, key: str, state, space: S.Space) -> dict[str, Tensor]:
    """Portable tensors of one moment, dim 0 the moment's local rows."""
    shape = S.local_shape(space)
    if isinstance(codec, (BlockCodec, TernaryCodec)):
        return _unpack(codec, key, state, shape)
    if codec.name == "factored" and len(shape) == 2:
        return {key: state[key], key + "_col": state[key + "_col"]}
    return {key: state[key].view(shape)}  # fp32, bf16 and their stochastic forms, factored non-2-D (fp32)


def _import_moment(codec, key: str, parts: dict[str, Tensor], state, space: S.Space, device) -> None:
    shape = S.local_shape(space)
    if isinstance(codec, (BlockCodec, TernaryCodec)):
        _pack(codec, key, parts, state, shape, device)
        return
    state.update(codec.init(key, shape, device))
    if codec.name == "factored" and len(shape) == 2:
        state[key].copy_(parts[key].reshape(-1))
        state[key + "_col"].copy_(parts[key + "_col"].reshape(-1))
        return
    state[key].copy_(parts[key].reshape(state[key].shape))


# ----------------------------------------------------------------------------------------------------------------
# one parameter


def _moment_plan(opt, p, group, state_like, rows: S.Rows):
    """(space, chosen local rows or None, codecs) of a parameter's moments; codecs None for TACO's own state or
    when there is no subspace."""
    space, sel = _space(opt, p, group, state_like, rows)
    if space is None or taco.owns(group, space.shape):
        return space, sel, None
    return space, sel, S.moment_codecs(opt, group, space, p.dtype)


def export_param(opt, p: Tensor, group: dict[str, Any], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The portable state of one parameter (see the module docstring)."""
    rows = S.rows_of(p)
    out: dict[str, Tensor] = {}
    done = set()
    space, sel, codecs = _moment_plan(opt, p, group, state, rows)

    def put(key: str, t: Tensor, sel: Tensor | None = None) -> None:
        done.add(key)
        layout = layout_of(opt, p, group, key)
        if layout == "replicated":
            out[key] = t
            return
        if layout in ("chunks", "columns"):
            out[key] = _param_rows_tensor(t, p, chunks_for(p, rows, key, space), int(layout == "columns"))
            return
        if sel is not None:  # a rows projector's moment: write its rows into a tensor of the parameter's rows
            full = t.new_zeros((rows.local,) + tuple(t.shape[1:]))
            full[sel] = t
            t = full
        out[key] = _param_rows_tensor(t, p, rows)

    for key in ("step", "moment_step", "proj", "proj_index", COMP_KEY):
        if key in state:
            put(key, state[key])
    for key in taco.KEYS:
        if key in state:
            put(key, state[key])
    if codecs is not None and codecs[0][0] in state:
        for key, codec in codecs:
            for k, t in _export_moment(codec, key, state, space).items():
                put(k, t, sel if k != key + "_col" else None)
            done.update(_names(key, state))
    left = sorted(set(state) - done)
    if left:
        raise ValueError(f"state keys {left} of a {tuple(p.shape)} parameter have no portable form")
    return out


def import_param(opt, p: Tensor, group: dict[str, Any], saved: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of ``export_param`` for this process's layout."""
    rows = S.rows_of(p)
    device = p.to_local().device if S.is_sharded(p) else p.device
    state: dict[str, Tensor] = {}
    for key in COUNTERS:
        if key in saved:
            state[key] = counter(saved[key], key, f"state of a {tuple(p.shape)} parameter")
    for key in ("proj", "proj_index", COMP_KEY) + taco.KEYS:
        if key not in saved:
            continue
        layout = layout_of(opt, p, group, key)
        if layout == "rows":
            state[key] = _local_rows(saved[key], p, rows).detach().to(device).clone()
        elif layout in ("chunks", "columns"):  # a right basis; TACO's history, in chunks of its columns
            dim = int(layout == "columns")
            cols = S.chunks_of(rows, saved[key].shape[dim]) if key.startswith("taco_") else \
                chunks_for(p, rows, key, None)
            state[key] = _local_rows(saved[key], p, cols, dim).detach().to(device).clone()
        else:
            state[key] = _replicated(saved[key]).detach().to(device).clone()
    space, sel, codecs = _moment_plan(opt, p, group, state, rows)
    used = set(state)
    if codecs is not None and codecs[0][0] in saved:
        for key, codec in codecs:
            names = _names(key, saved)
            parts = {}
            for k in names:
                layout = layout_of(opt, p, group, k)
                if layout == "replicated":
                    parts[k] = _replicated(saved[k]).detach().to(device)
                elif layout == "chunks":
                    parts[k] = _local_rows(saved[k], p, chunks_for(p, rows, k, space)).detach().to(device)
                else:
                    t = _local_rows(saved[k], p, rows).detach().to(device)
                    parts[k] = t[sel] if sel is not None else t
            _import_moment(codec, key, parts, state, space, device)
            used.update(names)
    left = sorted(set(saved) - used)
    if left:
        raise ValueError(f"saved state keys {left} of a {tuple(p.shape)} parameter do not belong to its settings "
                         f"(rule {group['rule']!r}, projector {group['projector']!r})")
    _check_block_moments(opt, p, group, state)
    return state


def move_state(opt, old: Tensor, new: Tensor, group: dict[str, Any],
               state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The state of parameter `old` for the parameter `new` that took its place in `opt`'s groups (the same whole
    shape; ``SlimOptimizer._switch_params``): the same tensors between plain tensors of one device and dtype,
    else a checkpoint's round trip, which cuts it for `new`'s layout (a plain tensor's state -> its FSDP2 shard's,
    bit-identical where the shard's first element starts a quantization block, as a checkpoint loads)."""
    if not (S.is_sharded(old) or S.is_sharded(new)) and old.device == new.device and old.dtype == new.dtype:
        return state
    return import_param(opt, new, group, export_param(opt, old, group, state))


def _check_block_moments(opt, p, group, state) -> None:
    """A ``block`` parameter active at the saved step must have its moments: a template built at another step (the
    plain get_optimizer_state_dict flow) would have dropped them silently."""
    if opt._layout(p, group) != "block" or "step" not in state or int(state["step"].item()) == 0:
        return
    step = int(state["step"].item())
    if opt._block_active(p, group, step) and len(state) == 1:
        raise ValueError("the checkpoint holds no moments for a block that is active at its step: load it with "
                         "slimopt.optim.distributed.distcheckpoint.load, which builds the load template from the checkpoint")


# ----------------------------------------------------------------------------------------------------------------
# whole state dicts


def to_portable(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch's packed state_dict (state keyed by parameter position) -> the portable form."""
    params = [p for g in opt.param_groups for p in g["params"]]
    owner = {id(p): g for g in opt.param_groups for p in g["params"]}
    state = {}
    for i, st in state_dict["state"].items():
        if not isinstance(i, int):  # state that names no parameter (torch keeps it as it is)
            state[i] = st
            continue
        p = params[i]
        state[i] = export_param(opt, p, owner[id(p)], st)
    groups = [{**g, "state_layout": LAYOUT} for g in state_dict["param_groups"]]
    return {**state_dict, "state": state, "param_groups": groups}

