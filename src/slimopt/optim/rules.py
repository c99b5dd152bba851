"""Update rules: how a (projected) gradient becomes a step direction.

State-full rules keep moments; the optimizer hands them decoded fp32 moments, and stores them back through a codec
afterwards, so a rule never knows the storage format. State-free rules act on the residual the projector leaves.

- ``adamw``: Adam's direction (Kingma & Ba, arXiv 1412.6980) with the bias corrections of torch.optim.AdamW;
  weight decay is decoupled (Loshchilov & Hutter, arXiv 1711.05101) and applied with the step by ``apply_update``.
  ``eps_placement`` says where eps enters: ``torch`` m_hat / (sqrt(v_hat) + eps), or ``galore``
  m_hat / ((sqrt(v) + eps) / sqrt(1 - beta2^t)), the arithmetic of galore-torch and transformers' old AdamW.
- ``lion``: sign of an interpolated momentum (Chen et al., arXiv 2302.06675).
- ``sgdm``: heavy-ball momentum, as torch.optim.SGD with dampening 0.
- ``muon``: Muon (Jordan et al. 2024; Moonlight, arXiv 2502.16982): the momentum of a 2-D weight orthogonalized
  by Newton-Schulz iterations, as torch.optim.Muon; ``muon.py`` holds it.
- ``taco``: TACO (arXiv 2610.02199). Its 2-D step and compact state live in ``taco.py`` (the optimizer dispatches
  there); what reaches ``direction`` under this name is its fallback for other tensors: AdamW, same moments.
- state-free ``sign`` (signSGD, Bernstein et al., arXiv 1802.04434, as FRUGAL uses it), ``sgd`` and ``none``.

``apply_update`` combines the two parts and moves the parameter; the whole-tensor step (``optimizer.py``) and the
FSDP2 step on a local shard (``sharded.py``) both end with it, so the two apply the same arithmetic in the same order.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from . import muon

RULES = ("adamw", "lion", "sgdm", "taco", "muon")
FREE_RULES = ("sign", "sgd", "none")

# state key and role ("m": signed first moment, "v": non-negative second moment) of each rule's moments
MOMENTS: dict[str, tuple[tuple[str, str], ...]] = {
    "adamw": (("exp_avg", "m"), ("exp_avg_sq", "v")),
    "lion": (("exp_avg", "m"),),
    "sgdm": (("momentum_buffer", "m"),),
    "taco": (("exp_avg", "m"), ("exp_avg_sq", "v")),  # the AdamW fallback for tensors that are not 2-D
    "muon": (("momentum_buffer", "m"),),  # torch.optim.Muon's key
}


def direction(rule: str, g: Tensor, mom: Mapping[str, Tensor], step: int, group: Mapping[str, Any],
              shape=None) -> tuple[Tensor, float]:
    """Update the fp32 moments in place and return (d, c): the step is lr * c * d before any projection back.

    g: fp32 gradient (full or projected); mom: fp32 moments of g's shape, keyed as in MOMENTS[rule]; shape: the
    parameter's (Muon's lr adjustment reads it; g's own when None).
    """
    if rule in ("adamw", "taco"):  # "taco" arrives here only for its AdamW fallback
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
    if rule == "lion":
        beta1, beta2 = group["betas"]
        m = mom["exp_avg"]
        d = torch.lerp(m, g, 1 - beta1).sign_()
        m.lerp_(g, 1 - beta2)
        return d, 1.0
    if rule == "sgdm":
        buf = mom["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g)
        return buf.clone(), 1.0
    if rule == "muon":
        return muon.direction(g, mom["momentum_buffer"], group, shape)
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def free_direction(free_rule: str, r: Tensor) -> Tensor | None:
    """Direction for the state-free residual r (fp32), or None when it is dropped."""
    if free_rule == "sign":
        return r.sign()
    if free_rule == "sgd":
        return r
    return None


def decay_factor(group: Mapping[str, Any]) -> float:
    """1 - lr * weight_decay: decoupled weight decay multiplies the weight by this before the update."""
    return 1.0 - float(group["lr"]) * float(group["weight_decay"])


def decay(p: Tensor, group: Mapping[str, Any]) -> None:
    """Decoupled weight decay of p (or its shard) in place; nothing at weight_decay 0."""
    if float(group["weight_decay"]) != 0.0:
        p.mul_(decay_factor(group))


def apply_update(p: Tensor, full: Tensor | None, coef: float, resid: Tensor | None,
                 group: Mapping[str, Any]) -> None:
    """p *= 1 - lr * weight_decay;  p -= lr * (coef * full + free_scale * free_direction(resid)), in place.

    p: the parameter, or its local shard; full: the state-full direction in p's shape before `coef` (overwritten),
    or None; resid: the residual for the state-free rule, or None. A parameter with neither this step (an inactive
    BAdam block) is left as it is, weight decay included.
    """
    free = free_direction(group["free_rule"], resid) if resid is not None else None
    if full is None and free is None:
        return
    lr = float(group["lr"])
    decay(p, group)
    if full is not None and free is not None:
        full = full.mul_(coef).add_(free, alpha=float(group["free_scale"]))
        p.add_(full, alpha=-lr)
    elif full is not None:
        p.add_(full, alpha=-lr * coef)
    else:
        p.add_(free, alpha=-lr * float(group["free_scale"]))
