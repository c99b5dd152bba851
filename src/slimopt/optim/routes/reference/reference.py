"""The eager step of one parameter, on the whole of its window: tensor operations, one parameter at a time.

What every rule that needs a whole matrix runs (Muon's iteration, TACO's column search where no kernel takes it),
what a tensor the windows do not take runs (not contiguous, a gradient of another shape), and the arithmetic the
faster routes are held to (tests/test_fused_grid.py): per parameter and step, on a ``sharded.Target`` (the whole
tensor, or this rank's rows of an FSDP2 one),

    g     = grad in fp32
    d, c  = the rule on g against the decoded moments (work "full", "taco"); the moments stored back
    resid = g for the state-free rule (work "free")
    p    *= 1 - lr wd;  p -= lr (c d + free_scale free_rule(resid))          (rules.apply_update)

Details: docs/modules.md, ``slimopt.optim.routes.reference.reference``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.rules import PARAM_STREAM, apply_update, comp_of, direction, rounding_of
from slimopt.optim.distributed import muon_sharded
from slimopt.optim.distributed.sharded import Space, Target, moment_codecs
from slimopt.optim.distributed.sharded_taco import taco_update
from slimopt.optim.routes.subspace import count_moment_step

__all__ = ["step", "stateful", "moments", "weight_stream"]


def weight_stream(group: dict[str, Any], t: Target, step: int):
    """The random stream of the weight's stochastic rounding at `step`, from the window's first element (None
    unless it rounds stochastically)."""
    if rounding_of(group, t.p) != "stochastic":
        return None
    return P.stream(group["seed"], t.index, step, PARAM_STREAM).at(t.offset)


def step(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int, work: str) -> None:
    """One eager step of the window `t` for its `work` ("full", "taco" or "free"; see ``routes.work_of``)."""
    g = t.grad if t.grad.dtype in (torch.float32, torch.float64) else t.grad.float()
    full, coef, resid = None, 0.0, None
    if work == "free":
        resid = g
    else:
        full, coef = stateful(opt, t, group, state, g, step, t.space())
    rounding = rounding_of(group, t.p)
    apply_update(t.p, full, coef, resid, group, comp_of(state, t.p, rounding), weight_stream(group, t, step))


def stateful(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], g: Tensor, step: int,
             space: Space) -> tuple[Tensor, float]:
    """The rule on g (this rank's part of `space`, fp32: the gradient, or its projection) against codec-stored
    moments of g's shape; returns (d, c), the update lr c d."""
    if taco.owns(group, space.shape):  # TACO keeps its own compact per-column state (taco.py)
        norm_shape = t.shape if t.param.dim() == 2 else space.shape
        if space.split:
            return taco_update(state, g, group, norm_shape, space.rows, opt._batch.taco_records)
        return taco.update(state, g, group, norm_shape)
    codecs = moment_codecs(opt, group, space, t.p.dtype)
    age = count_moment_step(state, codecs, g.shape, g.device)

    def rule(mom: dict[str, Tensor]) -> tuple[Tensor, float]:
        if group["rule"] == "muon" and space.split:  # the iteration needs the whole matrix
            return muon_sharded.direction(g, mom["momentum_buffer"], group, t.shape, space.rows)
        return direction(group["rule"], g, mom, age, group, shape=t.shape)

    return moments(opt, t, group, state, g, step, space, codecs, rule)


def moments(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], g: Tensor, step: int, space: Space,
            codecs: list[tuple[str, Any]], rule: Callable[[dict[str, Tensor]], Any]) -> Any:
    """Decode the moments of g's shape, run `rule` on them (it updates them in place), store them back (a
    stochastic codec draws from moment i's stream at the space's offset); returns what `rule` returned."""
    mom = {key: codec.decode(key, state, g.shape) for key, codec in codecs}
    out = rule(mom)
    for i, (key, codec) in enumerate(codecs):
        gen = P.stream(group["seed"], t.index, step, i).at(space.offset) if codec.needs_generator else None
        codec.encode(key, mom[key], state, generator=gen)
    return out
