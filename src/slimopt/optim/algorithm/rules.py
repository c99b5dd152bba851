"""Update rules: how a (projected) gradient becomes a step direction.

State-full rules keep moments; the optimizer hands them decoded fp32 moments, and stores them back through a codec
afterwards, so a rule never knows the storage format. State-free rules act on the residual the projector leaves.

Details: docs/modules.md, ``slimopt.optim.algorithm.rules``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from slimopt.optim.algorithm import muon
from slimopt.optim.algorithm import quant as Q

PARAM_ROUNDINGS = ("nearest", "stochastic", "kahan")
PARAM_STREAM = 1000  # the random stream of a weight's stochastic rounding (a rule's moments use 0, 1, ...)
COMP_KEY = "kahan_comp"

Moments = Mapping[str, Tensor]


def _adamw(g: Tensor, mom: Moments, step: int, group: Mapping[str, Any], shape) -> tuple[Tensor, float]:
    beta1, beta2 = group["betas"]
    m, v = mom["exp_avg"], mom["exp_avg_sq"]
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    if group["eps_placement"] == "galore":  # eps before the bias correction (galore-torch)
        denom = v.sqrt().add_(group["eps"]).div_(bias2_sqrt)
    else:  # torch.optim.AdamW
        denom = (v.sqrt() / bias2_sqrt).add_(group["eps"])
    return m / denom, 1.0 / bias1


def _lion(g: Tensor, mom: Moments, step: int, group: Mapping[str, Any], shape) -> tuple[Tensor, float]:
    beta1, beta2 = group["betas"]
    m = mom["exp_avg"]
    d = torch.lerp(m, g, 1 - beta1).sign_()
    m.lerp_(g, 1 - beta2)
    return d, 1.0


def _sgdm(g: Tensor, mom: Moments, step: int, group: Mapping[str, Any], shape) -> tuple[Tensor, float]:
    buf = mom["momentum_buffer"]
    buf.mul_(group["momentum"]).add_(g)
    return buf.clone(), 1.0


def _nesterov(g: Tensor, mom: Moments, step: int, group: Mapping[str, Any], shape) -> tuple[Tensor, float]:
    # SGD with Nesterov momentum (torch.optim.SGD(nesterov=True) without dampening): the step looks one momentum
    # ahead. Two roundings (the product, then the sum), as the kernels compute it; torch's own may fuse them.
    buf = mom["momentum_buffer"]
    buf.mul_(group["momentum"]).add_(g)
    return buf.mul(group["momentum"]).add_(g), 1.0


def _muon(g: Tensor, mom: Moments, step: int, group: Mapping[str, Any], shape) -> tuple[Tensor, float]:
    return muon.direction(g, mom["momentum_buffer"], group, shape)


@dataclass(frozen=True)
class Rule:
    """A state-full rule: its id in both kernels (routes/abi.py; None where no element-wise kernel has it), its
    moments (state key and role: "m" signed first moment, "v" non-negative second moment), whether each element's
    update reads only that element (the windows and kernels take it), whether its coefficient is Adam's bias
    correction 1 / (1 - beta1^t) (else 1), and its eager arithmetic ``step(g, mom, t, group, shape) -> (d, c)``."""

    kernel_id: int | None
    moments: tuple[tuple[str, str], ...]
    step: Callable[..., tuple[Tensor, float]]
    elementwise: bool = True
    bias_corrected: bool = False


@dataclass(frozen=True)
class FreeRule:
    """A state-free rule for the residual: its kernels' ids alone and in a projected step's write with the residual
    (``lift``; None: no kernel), and its direction (None: the residual is dropped)."""

    kernel_id: int | None
    lift_id: int | None
    direction: Callable[[Tensor], Tensor | None]


# The one registry of rules: settings validation, the state's keys, the eager step and the kernels' ids
# (routes/abi.py) all read it. Kernel ids: state-full rules below abi.FIRST_FREE_ID (16), state-free ones from it.
REGISTRY: dict[str, Rule] = {
    "adamw": Rule(0, (("exp_avg", "m"), ("exp_avg_sq", "v")), _adamw, bias_corrected=True),
    "lion": Rule(1, (("exp_avg", "m"),), _lion),
    "sgdm": Rule(2, (("momentum_buffer", "m"),), _sgdm),
    # the AdamW fallback for tensors that are not 2-D: AdamW's kernel and moments
    "taco": Rule(0, (("exp_avg", "m"), ("exp_avg_sq", "v")), _adamw, elementwise=False, bias_corrected=True),
    "muon": Rule(None, (("momentum_buffer", "m"),), _muon, elementwise=False),  # torch.optim.Muon's key
    "nesterov": Rule(3, (("momentum_buffer", "m"),), _nesterov),
}
FREE_REGISTRY: dict[str, FreeRule] = {
    "sign": FreeRule(16, 18, lambda r: r.sign()),
    "sgd": FreeRule(17, 19, lambda r: r),
    "none": FreeRule(None, None, lambda r: None),
}

RULES = tuple(REGISTRY)
ELEMENTWISE_RULES = tuple(n for n, r in REGISTRY.items() if r.elementwise)  # windowed.py, the kernels
FREE_RULES = tuple(FREE_REGISTRY)
MOMENTS: dict[str, tuple[tuple[str, str], ...]] = {n: r.moments for n, r in REGISTRY.items()}


def direction(rule: str, g: Tensor, mom: Mapping[str, Tensor], step: int, group: Mapping[str, Any],
              shape=None) -> tuple[Tensor, float]:
    """Update the fp32 moments in place and return (d, c): the step is lr * c * d before any projection back.

    g: fp32 gradient (full or projected); mom: fp32 moments of g's shape, keyed as in MOMENTS[rule]; shape: the
    parameter's (Muon's lr adjustment reads it; g's own when None).
    """
    entry = REGISTRY.get(rule)
    if entry is None:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    return entry.step(g, mom, step, group, shape)


def free_direction(free_rule: str, r: Tensor) -> Tensor | None:
    """Direction for the state-free residual r (fp32), or None when it is dropped."""
    return FREE_REGISTRY[free_rule].direction(r)


def decay_factor(group: Mapping[str, Any]) -> float:
    """1 - lr * weight_decay: decoupled weight decay multiplies the weight by this before the update."""
    return 1.0 - float(group["lr"]) * float(group["weight_decay"])


def decay(p: Tensor, group: Mapping[str, Any]) -> None:
    """Decoupled weight decay of p (or its shard) in place; nothing at weight_decay 0."""
    if float(group["weight_decay"]) != 0.0:
        p.mul_(decay_factor(group))


def advance(counter: Tensor) -> int:
    """``counter += 1`` for a step counter (a 0-d CPU tensor, as torch.optim keeps them), returning the new count.
    Through the tensor's numpy view where it has one: a torch op costs some 7 us of dispatch on a CPU and every
    tensor's step advances two counters (``step``, ``moment_step``), which for LLaMA-1B's ~180 tensors is 2.5 ms
    of a GPU step's host time; the view takes under half of that. Anything without a view (a tensor on a device,
    one that needs grad) takes the torch op."""
    try:
        view = counter.numpy()
    except (RuntimeError, TypeError):
        counter += 1
        return int(counter.item())
    view += 1
    return int(view)


class Counter:
    """``advance`` for one counter slot that is stepped every step: the counter's numpy view kept while the slot
    holds the same tensor (``advance`` makes the view anew each call)."""

    __slots__ = ("tensor", "view")

    def __init__(self) -> None:
        self.tensor = self.view = None

    def advance(self, counter: Tensor) -> int:
        if counter is not self.tensor:
            try:
                self.view = counter.numpy()
            except (RuntimeError, TypeError):  # no numpy view (a tensor on a device)
                self.tensor = None
                return advance(counter)
            self.tensor = counter
        self.view += 1
        return int(self.view)


def rounding_of(group: Mapping[str, Any], p: Tensor) -> str:
    """How p is written: the group's ``param_rounding`` for a bf16 weight, ``nearest`` for any other (an fp32
    weight holds the fp32 value exactly; fp16 weights are refused at construction)."""
    return group["param_rounding"] if p.dtype == torch.bfloat16 else "nearest"


def comp_of(state: dict[str, Tensor], p: Tensor, rounding: str) -> Tensor | None:
    """p's Kahan compensation under ``kahan`` (zero at first use, p's shape and dtype), else None."""
    if rounding != "kahan":
        return None
    comp = state.get(COMP_KEY)
    if comp is None:
        comp = state[COMP_KEY] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    return comp


def rounded(y: Tensor, dtype: torch.dtype, rounding: str, generator: Q.Stream | None = None
            ) -> tuple[Tensor, Tensor | None]:
    """The fp32 value y as a `dtype` weight, and under ``kahan`` what that loses (y - weight, in `dtype`)."""
    if rounding == "stochastic":
        return Q.to_bf16(y, stochastic=True, generator=generator), None
    new = y.to(dtype)
    if rounding == "kahan":
        return new, y.sub_(new.float()).to(dtype)  # y - new is exact in fp32: new is y rounded
    return new, None


def write(p: Tensor, y: Tensor, rounding: str, comp: Tensor | None, generator: Q.Stream | None) -> None:
    """p <- y (fp32, p's shape) rounded as `rounding` says; under ``kahan`` comp (p's shape) <- what is lost."""
    new, lost = rounded(y, p.dtype, rounding, generator)
    p.copy_(new)
    if lost is not None:
        comp.copy_(lost)


def value_of(p: Tensor, comp: Tensor | None) -> Tensor:
    """The fp32 value the weight p stands for: p, plus its Kahan compensation when it has one (a new tensor)."""
    y = p.float() if p.dtype != torch.float32 else p.clone()
    return y.add_(comp) if comp is not None else y


def apply_update(p: Tensor, full: Tensor | None, coef: float, resid: Tensor | None,
                 group: Mapping[str, Any], comp: Tensor | None = None,
                 generator: Q.Stream | None = None) -> None:
    """p *= 1 - lr * weight_decay;  p -= lr * (coef * full + free_scale * free_direction(resid)), in place.

    p: the parameter, or its local shard, or a window of either; full: the state-full direction in p's shape
    before `coef` (overwritten), or None; resid: the residual for the state-free rule, or None. A parameter with
    neither this step (an inactive BAdam block) is left as it is, weight decay included. A bf16 weight under
    ``param_rounding`` ``stochastic`` or ``kahan`` is updated in fp32 and written once (``write``): comp is its
    compensation (``comp_of``, the same window), generator the stream of its stochastic rounding.
    """
    free = free_direction(group["free_rule"], resid) if resid is not None else None
    if full is None and free is None:
        return
    lr = float(group["lr"])
    rounding = rounding_of(group, p)
    if rounding != "nearest":
        if rounding == "kahan" and comp is None:
            raise ValueError("param_rounding='kahan' needs the weight's compensation (rules.comp_of)")
        y = value_of(p, comp)
        decay(y, group)
        if full is not None and free is not None:
            y.add_(full.mul_(coef).add_(free, alpha=float(group["free_scale"])), alpha=-lr)
        elif full is not None:
            y.add_(full, alpha=-lr * coef)
        else:
            y.add_(free, alpha=-lr * float(group["free_scale"]))
        write(p, y, rounding, comp, generator)
        return
    decay(p, group)
    if full is not None and free is not None:
        full = full.mul_(coef).add_(free, alpha=float(group["free_scale"]))
        p.add_(full, alpha=-lr)
    elif full is not None:
        p.add_(full, alpha=-lr * coef)
    else:
        p.add_(free, alpha=-lr * float(group["free_scale"]))
