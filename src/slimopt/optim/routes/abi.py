"""The kernels' contract: the ids, moment keys and step scalars the C kernel and the Triton kernels are called with.

Every table is derived from the rule registry (``algorithm/rules.py``) or written once here, and every route reads
it from here: a new rule or write kind is an entry in the registry and a case in each kernel (docs/design.md,
section 2), not eight tables kept alike by hand. ``StepScalars`` is what changes from step to step, computed once
a group step and read by the C route's struct, the Triton launch and the compiled AdamW.

Details: docs/modules.md, ``slimopt.optim.routes.abi``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from slimopt.optim.algorithm.rules import FREE_REGISTRY, PARAM_ROUNDINGS, REGISTRY

__all__ = ["FIRST_FREE_ID", "RULES", "MOMENT_KEYS", "ELEMENTWISE_KERNEL_RULES", "FREE_RULES", "LIFT_RULES", "DTYPES",
           "ROUNDINGS", "SCALES", "SCALE_DTYPES", "C_CODECS", "K_CODECS", "StepScalars", "scalars"]

# RULE_* of both kernels: a state-full rule's id is below FIRST_FREE_ID, a state-free one's from it on, so a
# kernel tells the two apart by one comparison (kernels/elementwise_step.c, triton_kernels.py)
FIRST_FREE_ID = 16
RULES: dict[str, int] = {n: r.kernel_id for n, r in REGISTRY.items() if r.kernel_id is not None}
MOMENT_KEYS: dict[str, list[str]] = {n: [k for k, _ in REGISTRY[n].moments] for n in RULES}
ELEMENTWISE_KERNEL_RULES = tuple(n for n in RULES if REGISTRY[n].elementwise)  # what a kernel plan replays
FREE_RULES: dict[str, int] = {n: r.kernel_id for n, r in FREE_REGISTRY.items() if r.kernel_id is not None}
# a projected step's write with FRUGAL's residual under the free rule (``lift_update``, ``lift_applies``)
LIFT_RULES: dict[str, int] = {n: r.lift_id for n, r in FREE_REGISTRY.items() if r.lift_id is not None}
assert max(RULES.values()) < FIRST_FREE_ID <= min([*FREE_RULES.values(), *LIFT_RULES.values()])

DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}  # D_* of the C kernel; weights, gradients
ROUNDINGS: dict[str, int] = {name: i for i, name in enumerate(PARAM_ROUNDINGS)}  # W_*: how a bf16 weight is written
SCALES: dict[str, int] = {"absmax": 0, "mean": 1, "rms": 2}  # S_*: what a ternary moment's block scale measures
SCALE_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
# a moment's storage: C_* of the C kernel (codec_t.kind), K_* of the Triton kernels
C_CODECS: dict[str, int] = {n: i for i, n in enumerate(("fp32", "bf16", "block8", "block4", "ternary_sr",
                                                           "ternary_ef", "factored"))}
K_CODECS: dict[str, int] = {n: i for i, n in enumerate(("fp32", "bf16", "int8", "int4", "bf16_sr", "ternary",
                                                           "factored"))}


@dataclass(frozen=True)
class StepScalars:
    """What a kernel needs of one group step beyond addresses: the decay 1 - lr wd (``has_decay``: wd != 0), the
    update's alpha = -lr c and the rule's coefficient c, Adam's and Lion's weights w1 = 1 - beta1, w2 = 1 - beta2,
    beta2, Adam's bias corrections (bias1 = 1 - beta1^t, bias2_sqrt = sqrt(1 - beta2^t)), eps and where it enters
    (``eps_before``: galore-torch's placement), the momentum, the free rule's scale and a lifted direction's.
    A field a rule does not read is still filled: the kernels ignore it."""

    lr: float
    weight_decay: float
    decay: float
    has_decay: bool
    coef: float
    alpha: float
    beta1: float
    beta2: float
    w1: float
    w2: float
    bias1: float
    bias2_sqrt: float
    eps: float
    eps_before: bool
    momentum: float
    free_scale: float
    lift_coef: float


def scalars(group: Mapping[str, Any], age: int, kind: str = "rule") -> StepScalars:
    """The group's step scalars at the moments' age `age` for `kind`: "rule" (the state-full rule on its moments),
    "free" (the state-free update: c = free_scale) or "lift" (a projected step's write with the residual: c = 1,
    the direction carries both scales). Made once for each distinct group step (kept by value). A setting the
    group lacks reads 0 (a write's settings alone, as tests hand ``native.add_update``): no rule reads it then."""
    beta1, beta2 = group.get("betas", (0.0, 0.0))
    return _scalars(group.get("rule", "adamw"), float(group["lr"]), float(group["weight_decay"]), float(beta1),
                    float(beta2), float(group.get("eps", 0.0)), group.get("eps_placement") == "galore",
                    float(group.get("momentum", 0.0)), float(group.get("free_scale", 1.0)),
                    float(group.get("lift_coef", 1.0)), int(age), kind)


@functools.lru_cache(maxsize=1024)
def _scalars(rule: str, lr: float, wd: float, beta1: float, beta2: float, eps: float, eps_before: bool,
             momentum: float, free_scale: float, lift_coef: float, age: int, kind: str) -> StepScalars:
    bias1 = 1 - beta1 ** age
    bias2_sqrt = (1 - beta2 ** age) ** 0.5  # as rules.direction computes it
    if kind == "free":
        coef = free_scale
    elif kind == "rule" and REGISTRY[rule].bias_corrected:
        coef = 1.0 / bias1
    else:
        coef = 1.0
    return StepScalars(lr=lr, weight_decay=wd, decay=1.0 - lr * wd, has_decay=wd != 0.0, coef=coef, alpha=-lr * coef,
                       beta1=beta1, beta2=beta2, w1=1 - beta1, w2=1 - beta2, bias1=bias1, bias2_sqrt=bias2_sqrt,
                       eps=eps, eps_before=eps_before, momentum=momentum, free_scale=free_scale, lift_coef=lift_coef)
