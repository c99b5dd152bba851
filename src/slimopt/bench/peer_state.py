"""Optimizer-state bytes of the peer libraries, from parameter shapes, as each library allocates them.

The planner's rows for the peers come from here, so that they can be planned for models too large to build;
tests check them against the real optimizers after a step.

Details: docs/modules.md, ``slimopt.bench.peer_state``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["PEER_FORMULAS", "ALL_AT_ONCE", "SCRATCH_PER_ELEMENT", "peer_state", "PeerParamState"]

_BNB_MIN_8BIT = 4096
_BNB_BLOCK = 256
_BNB_QMAPS = 2 * 256 * 4  # signed and unsigned dynamic maps, fp32, shared by all parameters
_TORCH_STEP = 4  # a 0-D fp32 tensor


@dataclass(frozen=True)
class PeerParamState:
    """State bytes of one parameter: moments (with counters and maps) and projection bases; scratch: an estimate
    of what its update allocates while it runs."""

    name: str
    moments: int
    projections: int
    scratch: int = 0


# Update temporaries in bytes per element of the parameter (estimates; fused kernels allocate nothing). torch's
# foreach AdamW allocates them for all parameters at once (``ALL_AT_ONCE``), the others one parameter at a time.
# galore-torch: two temporaries in the gradient's dtype for plain Adam, the projected gradient and update plus the
# fp32 SVD at a refresh for projected weights; its 8-bit variant also clones the weight during the step.
SCRATCH_PER_ELEMENT = {"torch-adamw": "state", "torch-adamw-fused": 0, "bnb-adamw8bit": 0, "torchao-adamw8bit": 8,
                       "torchao-adamw4bit": 8}
ALL_AT_ONCE = ("torch-adamw",)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _torch_adamw(shape, dtype) -> int:
    return _TORCH_STEP + 2 * math.prod(shape) * _elem(dtype)


def _bnb_moments(shape, dtype) -> int:
    """Two bitsandbytes states for a tensor of `shape` (without the shared maps)."""
    n = math.prod(shape)
    if n < _BNB_MIN_8BIT:
        return 2 * 4 * n
    return 2 * n + 2 * 4 * (-(-n // _BNB_BLOCK))


def _torchao_moment(shape, dtype, bits: int) -> int:
    n = math.prod(shape)
    block = 256 if bits == 8 else 128
    if n >= 4096 and n % block == 0:
        qmap = 256 if bits == 8 else 16
        return n * bits // 8 + 4 * (n // block) + 4 * qmap
    return n * _elem(dtype)


def _galore_shapes(shape, rank: int, proj_type: str, full_factor: bool = False
                   ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(moment shape, stored basis shape) of galore-torch's projector for an (m, n) weight; full_factor: the basis
    is a view of the whole SVD factor (fp32 weights), whose storage is what stays allocated."""
    m, n = shape
    r = min(rank, m, n)
    k = min(m, n) if full_factor else r
    if proj_type == "std":
        right = m >= n
    elif proj_type == "reverse_std":
        right = m < n
    elif proj_type in ("left", "right"):
        right = proj_type == "right"
    else:
        raise ValueError(f"proj_type must be std, reverse_std, left or right; got {proj_type!r}")
    return ((m, r), (k, n)) if right else ((r, n), (m, k))


def _galore(model: nn.Module, eight_bit: bool, rank: int | None = None, proj_type: str = "std"
            ) -> list[PeerParamState]:
    from slimopt import peers

    projected, regular = peers.projectable_linear_weights(model)
    r = int(rank) if rank is not None else peers._default_rank(model, projected)
    if r < 1:
        raise ValueError(f"rank must be >= 1, got {rank!r}")
    names = {id(p): n for n, p in model.named_parameters()}
    moments = _bnb_moments if eight_bit else (lambda s, d: 2 * math.prod(s) * _elem(d))
    plain_scratch = 0 if eight_bit else 2 * 2  # bnb's fused kernel / two temporaries of the gradient's dtype
    out = [PeerParamState(names[id(p)], moments(p.shape, p.dtype), 0, plain_scratch * p.numel()) for p in regular]
    for p in projected:
        low, basis = _galore_shapes(tuple(p.shape), r, proj_type, full_factor=p.dtype == torch.float32)
        scratch = (11 + (_elem(p.dtype) if eight_bit else 0)) * p.numel()
        out.append(PeerParamState(names[id(p)], moments(low, p.dtype), math.prod(basis) * _elem(p.dtype), scratch))
    if eight_bit and any(math.prod(s) >= _BNB_MIN_8BIT for s in _low_shapes(projected, regular, r, proj_type)):
        out.append(PeerParamState("<bitsandbytes quantization maps>", _BNB_QMAPS, 0))
    return out


def _low_shapes(projected, regular, r, proj_type):
    yield from (tuple(p.shape) for p in regular)
    yield from (_galore_shapes(tuple(p.shape), r, proj_type)[0] for p in projected)


def _per_param(peer: str, fn: Callable[[tuple, torch.dtype], int], shared: Callable[[list], int] | None = None):
    def plan(model: nn.Module, **kw) -> list[PeerParamState]:
        if kw:
            raise ValueError(f"peer {peer!r} takes no settings; got {', '.join(sorted(kw))}")
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        per = SCRATCH_PER_ELEMENT[peer]
        out = []
        for n, p in params:
            state = fn(tuple(p.shape), p.dtype)
            scratch = (state - _TORCH_STEP) // 2 if per == "state" else per * p.numel()
            out.append(PeerParamState(n, state, 0, scratch))
        extra = shared(params) if shared else 0
        if extra:
            out.append(PeerParamState("<shared quantization maps>", extra, 0))
        return out
    return plan


def _bnb_shared(params) -> int:
    return _BNB_QMAPS if any(p.numel() >= _BNB_MIN_8BIT for _, p in params) else 0


PEER_FORMULAS: dict[str, Callable[..., list[PeerParamState]]] = {
    "torch-adamw": _per_param("torch-adamw", _torch_adamw),
    "torch-adamw-fused": _per_param("torch-adamw-fused", _torch_adamw),
    "bnb-adamw8bit": _per_param("bnb-adamw8bit", _bnb_moments, _bnb_shared),
    "torchao-adamw8bit": _per_param("torchao-adamw8bit", lambda s, d: _TORCH_STEP + _torchao_moment(s, d, 8) * 2),
    "torchao-adamw4bit": _per_param("torchao-adamw4bit", lambda s, d: _TORCH_STEP + _torchao_moment(s, d, 4) * 2),
    "galore-torch": lambda model, **kw: _galore(model, False, **kw),
    "galore-torch-8bit": lambda model, **kw: _galore(model, True, **kw),
}


def peer_state(model: nn.Module, name: str, **settings) -> list[PeerParamState]:
    """Per-parameter state of peer optimizer `name` over `model` (which may live on the meta device).

    settings: ``rank`` and ``proj_type`` for the galore-torch peers (defaults as `slimopt.peers.build_peer`).
    """
    if name not in PEER_FORMULAS:
        raise ValueError(f"no state formula for peer {name!r}; the planner knows: {', '.join(PEER_FORMULAS)}")
    return PEER_FORMULAS[name](model, **settings)
