"""SlimOptimizer's settings: every keyword a parameter group takes, its default, and what values are allowed.

Three independent axes compose per group (docs/design.md, section 2): the projector (``projectors.py``), the state-full
rule with its state-free companion (``rules.py``, ``muon.py``, ``taco.py``) and the storage of the moments
(``codecs.py``); ``compile``, ``fused`` and ``param_rounding`` say how a step runs and how a bf16 weight is
written. ``validate_group`` refuses a bad value naming the setting and what is allowed.

Details: docs/modules.md, ``slimopt.optim.settings``.
"""

from __future__ import annotations

import math
from typing import Any

from slimopt.optim.algorithm import muon, taco
from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.codecs import resolve_codecs
from slimopt.optim.algorithm.rules import FREE_RULES, PARAM_ROUNDINGS, RULES

__all__ = ["DEFAULTS", "ON_REFRESH", "EPS_PLACEMENTS", "validate_group"]

ON_REFRESH = ("keep", "reset", "project")
# Where Adam's eps enters: "torch" adds it to the bias-corrected sqrt(v_hat) (torch.optim.AdamW); "galore" adds it
# to sqrt(v) before the bias correction (galore-torch, transformers' old AdamW, the eps-hat form of Kingma & Ba,
# arXiv 1412.6980, section 2): the same as "torch" with eps / sqrt(1 - beta2^t), up to 32x larger early at 0.999.
EPS_PLACEMENTS = ("torch", "galore")

DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    eps_placement="torch",
    weight_decay=0.0,
    momentum=0.9,  # sgdm and muon (the muon recipes set 0.95, torch.optim.Muon's default)
    rule="adamw",
    projector="none",
    rank=None,
    density=None,
    update_gap=200,
    stagger_refresh=False,
    scale=1.0,
    proj_side="std",
    proj_dtype="fp32",
    on_refresh="keep",
    free_rule="none",
    free_scale=1.0,
    block_order="ascending",
    oversample=8,
    power_iters=2,
    seed=0,
    codec=None,
    m_codec=None,
    v_codec=None,
    state_bits=None,
    **taco.DEFAULTS,  # taco_k, taco_decay, taco_format, taco_scale_dtype, taco_norm, taco_alpha
    **muon.DEFAULTS,  # nesterov, ns_steps, ns_coefficients, ns_eps, ns_dtype, adjust_lr_fn
    compile=False,
    fused=True,
    param_rounding="nearest",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nonneg(name: str, value: Any) -> None:
    v = float(value)
    if not (v >= 0.0) or math.isinf(v):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid setting of a parameter group and what is allowed."""
    for name in ("lr", "eps", "weight_decay", "scale", "free_scale"):
        _nonneg(name, group[name])
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not 0.0 <= float(group["momentum"]) <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {group['momentum']!r}")
    for name, allowed in (("rule", RULES), ("free_rule", FREE_RULES), ("projector", P.PROJECTORS),
                          ("on_refresh", ON_REFRESH), ("proj_side", P.PROJ_SIDES),
                          ("proj_dtype", P.PROJ_DTYPES),
                          ("eps_placement", EPS_PLACEMENTS), ("param_rounding", PARAM_ROUNDINGS),
                          ("block_order", P.BLOCK_ORDERS)):
        if group[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {group[name]!r}")
    rank, density = group["rank"], group["density"]
    if rank is not None and (not _is_int(rank) or rank <= 0):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if density is not None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    if rank is not None and density is not None:
        raise ValueError(f"give either rank or density, not both (rank={rank}, density={density})")
    if group["projector"] != "none" and rank is None and density is None:
        raise ValueError(f"projector={group['projector']!r} needs a subspace size: set rank (> 0) or density "
                         "(in [0, 1])")
    for name in ("update_gap",):
        if not _is_int(group[name]) or group[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {group[name]!r}")
    for name in ("oversample", "power_iters", "seed"):
        if not _is_int(group[name]) or group[name] < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {group[name]!r}")
    resolve_codecs(group["codec"], group["m_codec"], group["v_codec"], group["state_bits"])
    taco.validate(group)
    muon.validate(group)
    for name in ("compile", "fused", "stagger_refresh"):
        if not isinstance(group[name], bool):
            raise ValueError(f"{name} must be True or False, got {group[name]!r}")
