"""SlimOptimizer's settings: every keyword a parameter group takes, its default, and what values are allowed.

Three independent axes compose per group (docs/design.md, section 2): the projector (``projectors.py``), the state-full
rule with its state-free companion (``rules.py``, ``muon.py``, ``taco.py``) and the storage of the moments
(``codecs.py``); ``compile``, ``fused`` and ``param_rounding`` say how a step runs and how a bf16 weight is
written. ``validate_group`` refuses a bad value naming the setting and what is allowed.

Every keyword of ``DEFAULTS`` is a per-group setting:

- ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled, applied once in full space before the update),
  ``momentum`` (for ``rule="sgdm"`` and ``"muon"``).
- ``eps_placement``: ``torch`` (m_hat / (sqrt(v_hat) + eps), torch.optim.AdamW) | ``galore``
  (m_hat / ((sqrt(v) + eps) / sqrt(1 - beta2^t)), galore-torch's and transformers' old AdamW's arithmetic).
- ``rule``: the state-full rule, ``adamw`` | ``lion`` | ``sgdm`` | ``taco`` (2-D tensors: the one-sparse
  ternary step with a compact per-column history, set by the ``taco_*`` settings, see
  ``slimopt.optim.algorithm.taco``; other tensors: AdamW with the group's codecs) | ``muon`` (2-D tensors only:
  the momentum orthogonalized by Newton-Schulz iterations, torch.optim.Muon's step; ``nesterov``,
  ``ns_steps``, ``ns_coefficients``, ``ns_eps``, ``ns_dtype``, ``adjust_lr_fn``, see ``slimopt.optim.algorithm.muon``).
- ``projector``: ``none`` | ``svd`` | ``randomized_svd`` | ``random`` | ``columns`` | ``rows`` | ``block``;
  ``rank`` or ``density`` sets the subspace size (for ``block``: how many tensors of the group are active);
  ``update_gap`` steps between refreshes (``stagger_refresh=True``: each matrix at its own phase of the gap,
  phases balanced by the refresh's cost, so no step pays every decomposition); ``scale`` multiplies the state-full update (GaLore's alpha);
  ``proj_side`` ``std`` | ``reverse_std`` | ``left`` | ``right`` (galore-torch's proj_type);
  ``proj_dtype`` ``fp32`` | ``grad`` | ``auto`` (the matrix products of ``svd``, ``randomized_svd`` and
  ``random`` projections in fp32, or in a bf16 / fp16 gradient's own dtype as galore-torch does: several times
  faster, each projected value rounded to 16 bits; ``auto``: the latter where the device has 16-bit matrix
  units; ``projectors.matmul_dtype``);
  ``on_refresh`` ``keep`` (GaLore) | ``reset`` (FRUGAL) | ``project`` (rotate the moments, LDAdam);
  ``block_order`` ``ascending`` | ``descending`` | ``random``; ``oversample`` and ``power_iters`` for
  ``randomized_svd``; ``seed`` for every random choice.
- ``free_rule``: what the residual outside the subspace gets: ``sign`` (FRUGAL), ``sgd`` or ``none``
  (GaLore; inactive BAdam blocks stay frozen); ``free_scale`` multiplies it.
- ``codec`` / ``m_codec`` / ``v_codec`` / ``state_bits``: the storage format of the moments
  (see ``slimopt.optim.algorithm.codecs``).
- ``compile``: run full-space AdamW steps through a torch.compile'd kernel (``compiled.py``) that decodes,
  updates and encodes in one pass; hyperparameters enter as 0-D tensors, so schedules never recompile.
- ``fused`` (default True): each parameter takes the fastest route its step allows (``routes/choice.py``,
  docs/routes.md): torch's multi-tensor fused AdamW for plain moments, the one-pass C kernel on a CPU and one
  Triton launch a size and setting on CUDA for every other element-wise update, TACO's sparse write; False runs
  every parameter through the eager steps, the reference the fast routes are tested against.
- ``param_rounding``: how a bf16 weight is written, ``nearest`` | ``stochastic`` (unbiased, no memory) |
  ``kahan`` (a bf16 compensation per weight, state ``kahan_comp``); see ``rules.py``. fp32 weights are written
  exactly; fp16 weights take ``nearest`` only.

An element-wise update (AdamW, Lion, SGDM in full space or on a block, and every state-free update) runs in
windows of the flattened tensor (``routes/windowed.py``): its temporaries stay under 64 MiB whatever the tensor.
A subspace projector's step runs in windows of rows or columns between refreshes (``windowed.projected``): it
holds the subspace gradient and direction, and a window.

Parameters that are not 2-D take the rule on the full gradient under a subspace projector; ``block`` works for
any shape.
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
