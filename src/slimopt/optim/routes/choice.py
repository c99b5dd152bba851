"""Which route a parameter's step takes: decided here, and nowhere else.

A step's work (``paramstep.work_of``) is one of

- ``full``: the rule on the whole gradient (no projector, an active block, a tensor no projector takes);
- ``taco``: TACO's one-sparse step of a 2-D weight (arXiv 2610.02199);
- ``free``: the state-free rule alone (an inactive block, a subspace of rank 0);
- ``frozen``: nothing moves (an inactive block under ``free_rule="none"``);
- ``projected``: a subspace projector's step (GaLore, FRUGAL).

Details: docs/modules.md, ``slimopt.optim.routes.choice``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES, rounding_of
from slimopt.optim.distributed.sharded import RowShardedFactored, Target, moment_codecs
from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.torch import compiled, multi_tensor
from slimopt.optim.routes.triton import triton_step, triton_taco

__all__ = ["ROUTES", "WORKS", "choose", "subspace_rule", "lifted_write"]

ROUTES: dict[str, tuple[str, ...]] = {
    "full": ("multi_tensor_adamw", "compiled", "triton", "c_kernel", "eager_windows", "muon", "eager"),
    "free": ("multi_tensor_free", "triton", "c_kernel", "eager_windows", "eager"),
    "taco": ("taco_c_kernel", "taco_triton", "taco_sharded", "taco_sparse", "eager"),
    "projected": ("projected",),
    "frozen": ("frozen",),
}
WORKS = tuple(ROUTES)


def _codecs(opt, t: Target, group: dict[str, Any], work: str) -> list[tuple[str, Any]]:
    return moment_codecs(opt, group, t.space(), t.p.dtype) if work == "full" else []


def _whole_windows(t: Target) -> str | None:
    """Why the windows do not take the tensor (they walk the weight and its gradient as flat ranges)."""
    if not (t.p.is_contiguous() and t.grad.is_contiguous()):
        return "not contiguous"
    if t.grad.shape != t.p.shape:
        return f"a gradient of shape {tuple(t.grad.shape)} for a weight of shape {tuple(t.p.shape)}"
    return None


def _multi_tensor_adamw(opt, t, group, work) -> str | None:
    return multi_tensor.adamw_declines(group, t.p, t.grad, _codecs(opt, t, group, work))


def _multi_tensor_free(opt, t, group, work) -> str | None:
    return multi_tensor.residual_declines(group, t.p, t.grad)


def _compiled(opt, t, group, work) -> str | None:
    if not group["compile"]:
        return "compile=False"
    if group["rule"] != "adamw":
        return f"rule {group['rule']!r}"
    if rounding_of(group, t.p) != "nearest":
        return f"param_rounding {group['param_rounding']!r}"
    codecs = _codecs(opt, t, group, work)
    if not compiled.supported(codecs):
        return "a moment rounds stochastically"
    if any(isinstance(c, RowShardedFactored) for _, c in codecs):
        return "a row shard's factored moment sums its columns over ranks"
    return None


def _triton(opt, t, group, work) -> str | None:
    return _whole_windows(t) or triton_step.declines(group, t.p, t.grad, _codecs(opt, t, group, work))


def _c_kernel(opt, t, group, work) -> str | None:
    return _whole_windows(t) or native.declines(group, t.p, t.grad, _codecs(opt, t, group, work))


def _eager_windows(opt, t, group, work) -> str | None:
    if work == "full" and group["rule"] not in ELEMENTWISE_RULES and group["rule"] != "taco":
        return f"rule {group['rule']!r} needs the whole matrix"
    return _whole_windows(t)


def _muon(opt, t, group, work) -> str | None:
    if group["rule"] != "muon":
        return f"rule {group['rule']!r}"
    if not group["fused"]:
        return "fused=False"
    return None


def _taco_c_kernel(opt, t, group, work) -> str | None:
    if t.split:
        return "other ranks hold rows of the weight: its columns' search spans them"
    return native.taco_declines(group, t.p, t.grad)


def _taco_triton(opt, t, group, work) -> str | None:
    if t.split:
        return "other ranks hold rows of the weight: its columns' search spans them"
    return triton_taco.declines(group, t.p, t.grad)


def _taco_sharded(opt, t, group, work) -> str | None:
    if not t.split:
        return "no other rank holds rows of the weight"
    if not group["fused"]:
        return "fused=False"
    if group["taco_k"] != 1:
        return f"taco_k {group['taco_k']}"
    if rounding_of(group, t.p) != "nearest":
        return f"param_rounding {group['param_rounding']!r}"
    return _whole_windows(t)


def _taco_sparse(opt, t, group, work) -> str | None:
    if t.split:
        return "other ranks hold rows of the weight: its columns' search spans them"
    if not group["fused"]:
        return "fused=False"
    return _whole_windows(t)


def _always(opt, t, group, work) -> str | None:
    return None


_DECLINES: dict[str, Callable[..., str | None]] = {
    "multi_tensor_adamw": _multi_tensor_adamw, "multi_tensor_free": _multi_tensor_free, "compiled": _compiled,
    "triton": _triton, "c_kernel": _c_kernel, "eager_windows": _eager_windows, "muon": _muon,
    "taco_c_kernel": _taco_c_kernel, "taco_triton": _taco_triton, "taco_sharded": _taco_sharded,
    "taco_sparse": _taco_sparse, "projected": _always, "eager": _always, "frozen": _always,
}


def choose(opt, t: Target, group: dict[str, Any], work: str) -> tuple[str, dict[str, str]]:
    """(the route of this step of `t`, {each faster route of its work: why it declined})."""
    why: dict[str, str] = {}
    for name in ROUTES[work]:
        reason = _DECLINES[name](opt, t, group, work)
        if reason is None:
            return name, why
        why[name] = reason
    raise AssertionError(f"no route for work {work!r}")  # every work's last route takes everything


# ----------------------------------------------------------------------------------------------------------------
# the element-wise parts of a projected step


def subspace_rule(group: dict[str, Any], low: Tensor, codecs: list[tuple[str, Any]]) -> str:
    """The kernel of a projected step's element-wise rule on its subspace gradient `low` (fp32 or fp64,
    contiguous), the direction written over it: ``triton`` (one launch), ``c_kernel`` (in windows) or
    ``eager_windows``."""
    if triton_step.applies(group, low, low, codecs):
        return "triton"
    if native.applies(group, low, low, codecs):
        return "c_kernel"
    return "eager_windows"


def lifted_write(group: dict[str, Any], p: Tensor, grad: Tensor, full: Tensor | torch.dtype, residual: bool) -> str:
    """The kernel of a projected step's write on the weight window p (its gradient window grad): the lifted
    direction with FRUGAL's residual and its free rule (`residual`; `full` the lifted direction's dtype, asked
    before it is made), or alone (`full` the lifted direction itself); decay and the weight's rounding in the same
    pass: ``c_kernel``, ``triton`` or ``eager``."""
    if residual:
        if native.lift_applies(group, p, grad, full):
            return "c_kernel"
        if triton_step.lift_applies(group, p, grad, full):
            return "triton"
        return "eager"
    if native.add_applies(group, p, full):
        return "c_kernel"
    if triton_step.applies(native.add_group(group, 1.0), p, full, []):
        return "triton"
    return "eager"
