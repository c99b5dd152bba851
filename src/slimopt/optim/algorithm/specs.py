"""The named methods' settings: what each one sets on the projectable weights and on the rest.

Torch-free data that ``recipes.py`` turns into parameter groups. The names, descriptions and default learning
rates are ``slimopt.catalog``'s one table, which this layer reads (docs/design.md, section 1). Papers: GaLore
(arXiv 2403.03507: scale 0.25, rank 128 at 60M, update gap 200), FRUGAL (arXiv 2411.07837: density 0.25,
blockwise, signSGD residual, state reset at every refresh, update gap 200), BAdam (arXiv 2404.02827), 8-bit Adam
(arXiv 2110.02861), 4-bit Adam (arXiv 2309.01507), TACO (arXiv 2610.02199), Muon (Jordan et al. 2024; Moonlight,
arXiv 2502.16982). The Muon recipes take Moonlight's adjustment (``adjust_lr_fn="match_rms_adamw"``, so one lr
serves every group; docs/modules.md, ``slimopt.catalog``), momentum 0.95, Nesterov, 5 Newton-Schulz steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Method", "METHODS", "STATE_FREE", "GALORE_DEFAULTS", "FRUGAL_DEFAULTS", "TACO_DEFAULTS",
           "MUON_DEFAULTS"]

STATE_FREE = {"projector": "block", "density": 0.0, "free_rule": "sign"}
# proj_dtype "auto": bf16 weights are projected in bf16 matrix products, as galore-torch projects, where the device
# multiplies bf16 faster than fp32 (a GPU; a CPU with AVX512-BF16 or AMX): projectors.matmul_dtype
GALORE_DEFAULTS = {"projector": "svd", "rank": 128, "update_gap": 200, "scale": 0.25, "on_refresh": "keep",
                   "proj_dtype": "auto"}
FRUGAL_DEFAULTS = {"projector": "block", "density": 0.25, "update_gap": 200, "free_rule": "sign", "on_refresh": "reset"}
MUON_DEFAULTS = {"rule": "muon", "adjust_lr_fn": "match_rms_adamw"}
MUON_SHARED = {"momentum": 0.95}  # shared, so a momentum given to build() replaces it (AdamW groups ignore it)
TACO_DEFAULTS = {"rule": "taco"}  # taco_* settings: slimopt.optim.algorithm.taco.DEFAULTS


@dataclass(frozen=True)
class Method:
    """The settings of one named method for each kind of parameter (its name, description and default lr:
    ``slimopt.catalog``)."""

    projectable: dict[str, Any] = field(default_factory=dict)
    rest: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)  # settings for every group (codecs)
    state_full: str = "all"  # build()'s default: "head" keeps Adam state on the output layer only


# One entry for each of slimopt.catalog's "slimopt" names, in its order (tests/test_build.py checks both).
METHODS: dict[str, Method] = {
    "adamw": Method(),
    "adamw8bit": Method(shared={"state_bits": 8}),
    "adamw4bit": Method(shared={"state_bits": 4}),
    "ternary_adamw": Method(shared={"codec": "ternary"}),
    "galore": Method(projectable=dict(GALORE_DEFAULTS)),
    "galore_rsvd": Method(projectable={**GALORE_DEFAULTS, "projector": "randomized_svd"}),
    "galore8bit": Method(projectable=dict(GALORE_DEFAULTS), shared={"state_bits": 8}),
    "frugal": Method(projectable=dict(FRUGAL_DEFAULTS)),
    "frugal8bit": Method(projectable=dict(FRUGAL_DEFAULTS), shared={"state_bits": 8}),
    "frugal_ternary": Method(projectable=dict(FRUGAL_DEFAULTS), shared={"codec": "ternary"}),
    "frugal_rho0": Method(projectable={**FRUGAL_DEFAULTS, "density": 0.0}),
    "badam": Method(projectable={"projector": "block", "rank": 1, "update_gap": 100, "free_rule": "none",
                                 "on_refresh": "reset"}),
    "taco": Method(projectable=dict(TACO_DEFAULTS)),
    "signsgd": Method(projectable=dict(STATE_FREE), rest=dict(STATE_FREE)),
    "frugal_head": Method(projectable={**FRUGAL_DEFAULTS, "density": 0.0}, rest={"codec": "int8"},
                          shared={"param_rounding": "stochastic"}, state_full="head"),
    "muon": Method(projectable=dict(MUON_DEFAULTS), shared=dict(MUON_SHARED)),
    "muon8bit": Method(projectable=dict(MUON_DEFAULTS), shared={**MUON_SHARED, "state_bits": 8}),
    "frugal_muon": Method(projectable={**FRUGAL_DEFAULTS, **MUON_DEFAULTS}, shared=dict(MUON_SHARED)),
}
