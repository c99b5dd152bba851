"""The named methods as data: what each one sets on the projectable weights and on the rest, and its paper's
learning rate.

Torch-free, so that listing the methods (``slimopt methods``, ``slimopt.catalog``) costs no torch import;
``recipes.py`` turns a method into parameter groups. Papers: GaLore (arXiv 2403.03507: lr 0.01, scale 0.25, rank
128 at 60M, update gap 200), FRUGAL (arXiv 2411.07837: lr 1e-3, density 0.25, blockwise, signSGD residual, state
reset at every refresh, update gap 200), BAdam (arXiv 2404.02827), 8-bit Adam (arXiv 2110.02861), 4-bit Adam
(arXiv 2309.01507), TACO (arXiv 2610.02199), Muon (Jordan et al. 2024; Moonlight, arXiv 2502.16982).

Muon's learning rate. torch.optim.Muon's default is 1e-3 with Jordan's adjustment (lr * sqrt(max(1, A / B)));
Jordan's own runs use about 0.02 for the hidden matrices with a separate, smaller AdamW lr for the rest. A recipe
here has one lr for all its groups, so the Muon recipes take Moonlight's adjustment (``adjust_lr_fn=
"match_rms_adamw"``: the update scaled to RMS 0.2, AdamW's typical update RMS, arXiv 2502.16982 section 2.2, which
is how Moonlight reuses AdamW's lr and weight decay) and AdamW's lr of the other recipes, 1e-3 (the GaLore paper's
LLaMA lr, also torch's Muon default); momentum 0.95 (torch's and Jordan's), Nesterov, 5 Newton-Schulz steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Method", "METHODS", "TACO_LR", "STATE_FREE", "GALORE_DEFAULTS", "FRUGAL_DEFAULTS", "TACO_DEFAULTS",
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

TACO_LR = 3e-4  # a fine-tuning learning rate (the AdamW fallback's); TACO's matrices step lr * taco_alpha * m / n


# Where a default learning rate comes from (``slimopt methods``' short "lr from" column). The papers' rates are for
# 60M-7B LLaMA pretraining. A method that is slimopt's own has no paper: its default is AdamW's times the ratio of its
# tuned rate to AdamW's, measured with `slimopt compare --tune-lr --seeds 3` on the built-in corpus
# (docs/reproduction.md, 2026-12-03: AdamW tuned to 4e-3 there, inside its grid; ternary_adamw to 8e-3, frugal_ternary,
# frugal_head and frugal_muon to 4e-3). Muon keeps AdamW's, as Moonlight's update-RMS match intends (arXiv 2502.16982):
# a 4x rate won the short tuning runs, AdamW's tuned rate the full ones.
PAPER_ADAMW = "GaLore paper's AdamW (2403.03507)"
MEASURED_SAME = "AdamW's (measured ratio 1)"
GALORE_PAPER = "GaLore paper (2403.03507)"
FRUGAL_PAPER = "FRUGAL paper (2411.07837)"
MUON_LR = "AdamW's (Moonlight, 2502.16982)"


@dataclass(frozen=True)
class Method:
    """One named method: its description, default lr and where that comes from (``lr_source``), and the settings
    of each kind of parameter."""

    description: str
    lr: float
    projectable: dict[str, Any] = field(default_factory=dict)
    rest: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)  # settings for every group (codecs)
    state_full: str = "all"  # build()'s default: "head" keeps Adam state on the output layer only
    lr_source: str = PAPER_ADAMW


METHODS: dict[str, Method] = {
    "adamw": Method("AdamW on every parameter (torch.optim.AdamW's update)", 1e-3),
    "adamw8bit": Method("AdamW with 8-bit blockwise moments (arXiv 2110.02861)", 1e-3, shared={"state_bits": 8},
                         lr_source="AdamW's (2110.02861)"),
    "adamw4bit": Method("AdamW with 4-bit moments (arXiv 2309.01507)", 1e-3, shared={"state_bits": 4},
                         lr_source="AdamW's (2309.01507)"),
    "ternary_adamw": Method("AdamW with ternary {-1,0,+1} first moment and factored second moment", 2e-3,
                            shared={"codec": "ternary"},
                            lr_source="2x AdamW's (measured ratio 2)"),
    "galore": Method("GaLore: Adam in the top-r SVD subspace of each Linear weight's gradient, rank 128",
                     1e-2, projectable=dict(GALORE_DEFAULTS), lr_source=GALORE_PAPER),
    "galore_rsvd": Method("GaLore with a randomized SVD refresh (same subspace, far cheaper)", 1e-2,
                          projectable={**GALORE_DEFAULTS, "projector": "randomized_svd"}, lr_source=GALORE_PAPER),
    "galore8bit": Method("GaLore with 8-bit moments everywhere", 1e-2, projectable=dict(GALORE_DEFAULTS),
                         shared={"state_bits": 8}, lr_source=GALORE_PAPER),
    "frugal": Method("FRUGAL: Adam on 25% of the Linear weights in turn, signSGD on the rest", 1e-3,
                     projectable=dict(FRUGAL_DEFAULTS), lr_source=FRUGAL_PAPER),
    "frugal8bit": Method("FRUGAL with 8-bit moments", 1e-3, projectable=dict(FRUGAL_DEFAULTS), shared={"state_bits": 8},
                         lr_source=FRUGAL_PAPER),
    "frugal_ternary": Method("FRUGAL with ternary first and factored second moments", 1e-3,
                             projectable=dict(FRUGAL_DEFAULTS), shared={"codec": "ternary"}, lr_source=MEASURED_SAME),
    "frugal_rho0": Method("FRUGAL at density 0: signSGD on Linear weights, Adam on embeddings, norms, head", 1e-3,
                          projectable={**FRUGAL_DEFAULTS, "density": 0.0}, lr_source=FRUGAL_PAPER),
    "badam": Method("BAdam: Adam on one Linear weight at a time (switching every 100 steps), the others frozen",
                    1e-3, projectable={"projector": "block", "rank": 1, "update_gap": 100, "free_rule": "none",
                                       "on_refresh": "reset"}, lr_source="AdamW's (BAdam, 2404.02827)"),
    "taco": Method("TACO: one-sparse ternary step per column of each Linear weight, one fp8 component of state "
                   "per column (taco_k); AdamW on embeddings, norms, biases and head", TACO_LR,
                   projectable=dict(TACO_DEFAULTS),
                   lr_source="fine-tuning (docs/taco.md)"),
    "signsgd": Method("signSGD on every parameter: no optimizer state", 3e-4, projectable=dict(STATE_FREE),
                      rest=dict(STATE_FREE), lr_source="not measured"),
    "frugal_head": Method("FRUGAL at density 0 with Adam state on the output layer only (8-bit); signSGD on every "
                          "other parameter; bf16 weights written with stochastic rounding: the 7B-under-16GB recipe",
                          1e-3, projectable={**FRUGAL_DEFAULTS, "density": 0.0}, rest={"codec": "int8"},
                          shared={"param_rounding": "stochastic"}, state_full="head", lr_source=MEASURED_SAME),
    "muon": Method("Muon: the momentum of each Linear weight orthogonalized by 5 Newton-Schulz steps (torch.optim."
                   "Muon's step, update RMS matched to AdamW's); AdamW on embeddings, norms, biases and head", 1e-3,
                   projectable=dict(MUON_DEFAULTS), shared=dict(MUON_SHARED), lr_source=MUON_LR),
    "muon8bit": Method("Muon with an 8-bit momentum (about 1 byte per parameter), AdamW's moments 8-bit too", 1e-3,
                       projectable=dict(MUON_DEFAULTS), shared={**MUON_SHARED, "state_bits": 8}, lr_source=MUON_LR),
    "frugal_muon": Method("FRUGAL with Muon in the subspace: Muon on 25% of the Linear weights in turn, signSGD on "
                          "the rest", 1e-3, projectable={**FRUGAL_DEFAULTS, **MUON_DEFAULTS},
                          shared=dict(MUON_SHARED), lr_source=MEASURED_SAME),
}
