"""Which settings a parameter group's step reads.

A setting given for a method whose groups never read it (``rank`` for plain AdamW, ``momentum`` for Adam,
``taco_k`` outside TACO) would otherwise be accepted and silently do nothing; ``build`` asks ``unused_reason``
for every setting the caller gave and raises when no group that received it reads it.
"""

from __future__ import annotations

from typing import Any, Mapping

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.rules import REGISTRY

# the rules whose one moment is a momentum buffer read `momentum` and not `betas` (sgdm, nesterov, muon)
_MOMENTUM_RULES = tuple(n for n, r in REGISTRY.items() if [k for k, _ in r.moments] == ["momentum_buffer"])

__all__ = ["unused_reason"]

_SUBSPACE = ("rank", "density", "update_gap", "on_refresh", "free_rule")
_MUON = ("nesterov", "ns_steps", "ns_coefficients", "ns_eps", "ns_dtype", "adjust_lr_fn")  # muon.DEFAULTS


def unused_reason(key: str, group: Mapping[str, Any]) -> str | None:
    """None when `group`'s step reads setting `key`, else why it does not (a phrase naming what would)."""
    rule, projector = group["rule"], group["projector"]
    if key in _SUBSPACE and projector == "none":
        return "it sizes or schedules a subspace and the projector is 'none'"
    if key == "scale" and projector not in P.ORTHO_PROJECTORS + ("columns", "rows"):
        return f"it scales a projected update and the projector is {projector!r}"
    if key == "proj_side" and projector not in P.ORTHO_PROJECTORS:
        return f"it chooses the side of svd, randomized_svd and random projections; the projector is {projector!r}"
    if key == "proj_dtype" and projector not in P.ORTHO_PROJECTORS:
        return f"it sets the dtype of svd, randomized_svd and random projections' products; the projector is {projector!r}"
    if key in ("oversample", "power_iters") and projector != "randomized_svd":
        return f"it tunes the randomized_svd projector; the projector is {projector!r}"
    if key == "stagger_refresh" and projector in ("none", "block"):
        return f"it staggers the refreshes of a subspace projector's matrices; the projector is {projector!r}"
    if key == "block_order" and projector != "block":
        return f"it orders the block projector's blocks; the projector is {projector!r}"
    if key == "free_scale" and (projector == "none" or group["free_rule"] == "none"):
        return "it scales the state-free residual, and there is none (projector 'none' or free_rule 'none')"
    if key == "momentum" and rule not in _MOMENTUM_RULES:
        return f"only rules {', '.join(map(repr, _MOMENTUM_RULES))} read it; the rule is {rule!r}"
    if key in _MUON and rule != "muon":
        return f"only rule 'muon' reads it; the rule is {rule!r}"
    if key in ("eps", "eps_placement") and rule not in ("adamw", "taco"):
        return f"only the Adam rules read it; the rule is {rule!r}"
    if key == "betas" and rule in _MOMENTUM_RULES:
        return f"rule {rule!r} uses momentum, not betas"
    if key.startswith("taco_") and rule != "taco":
        return f"only rule 'taco' reads it; the rule is {rule!r}"
    if key == "compile" and (rule != "adamw" or projector != "none"):
        return "the compiled step covers full-space AdamW only (rule 'adamw', projector 'none')"
    return None
