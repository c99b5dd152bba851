"""The one table of every name ``--method`` accepts: its kind, description, default learning rate and that rate's
source.

Three kinds: slimopt's own methods (their settings in ``slimopt.optim.algorithm.specs``), the baselines
(``slimopt.baselines``: GaLore's Low-Rank, LoRA arXiv 2106.09685, ReLoRA arXiv 2307.05695, and the frozen-weights
control of ``slimopt compare``) and other libraries' optimizers (``slimopt.peers``). The kind says how a name is
built (``slimopt.factory.make_optimizer``). The layers run one way (docs/design.md, section 1): this module
imports the standard library only, nothing of slimopt, and sits below every layer, where ``slimopt.atomic`` does,
so the optimizer layer reads its methods' default rates here and ``slimopt methods`` imports no torch.

Details: docs/modules.md, ``slimopt.catalog``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Entry", "CATALOG", "KINDS", "TACO_LR", "of_kind", "known_methods", "method_kind", "resolve_lr", "default_lr",
           "lr_source", "lr_is_papers"]

KINDS = ("slimopt", "baseline", "peer")

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
PEER_AUTHORS = "peer authors' default"

TACO_LR = 3e-4  # a fine-tuning learning rate (the AdamW fallback's); TACO's matrices step lr * taco_alpha * m / n


@dataclass(frozen=True)
class Entry:
    """One name ``--method`` accepts."""

    kind: str  # "slimopt", "baseline" or "peer"
    description: str
    lr: float  # the default learning rate
    lr_source: str = PAPER_ADAMW  # where ``lr`` comes from


def _own(description: str, lr: float, lr_source: str = PAPER_ADAMW) -> Entry:
    return Entry("slimopt", description, lr, lr_source)


def _baseline(description: str) -> Entry:
    return Entry("baseline", description, 1e-3)  # the GaLore paper's AdamW lr of its LLaMA runs, for every baseline


def _peer(description: str, lr: float) -> Entry:
    return Entry("peer", description, lr, PEER_AUTHORS)


CATALOG: dict[str, Entry] = {
    "adamw": _own("AdamW on every parameter (torch.optim.AdamW's update)", 1e-3),
    "adamw8bit": _own("AdamW with 8-bit blockwise moments (arXiv 2110.02861)", 1e-3, "AdamW's (2110.02861)"),
    "adamw4bit": _own("AdamW with 4-bit moments (arXiv 2309.01507)", 1e-3, "AdamW's (2309.01507)"),
    "ternary_adamw": _own("AdamW with ternary {-1,0,+1} first moment and factored second moment", 2e-3,
                          "2x AdamW's (measured ratio 2)"),
    "galore": _own("GaLore: Adam in the top-r SVD subspace of each Linear weight's gradient, rank 128", 1e-2,
                   GALORE_PAPER),
    "galore_rsvd": _own("GaLore with a randomized SVD refresh (same subspace, far cheaper)", 1e-2, GALORE_PAPER),
    "galore8bit": _own("GaLore with 8-bit moments everywhere", 1e-2, GALORE_PAPER),
    "frugal": _own("FRUGAL: Adam on 25% of the Linear weights in turn, signSGD on the rest", 1e-3, FRUGAL_PAPER),
    "frugal8bit": _own("FRUGAL with 8-bit moments", 1e-3, FRUGAL_PAPER),
    "frugal_ternary": _own("FRUGAL with ternary first and factored second moments", 1e-3, MEASURED_SAME),
    "frugal_rho0": _own("FRUGAL at density 0: signSGD on Linear weights, Adam on embeddings, norms, head", 1e-3,
                        FRUGAL_PAPER),
    "badam": _own("BAdam: Adam on one Linear weight at a time (switching every 100 steps), the others frozen", 1e-3,
                  "AdamW's (BAdam, 2404.02827)"),
    "taco": _own("TACO: one-sparse ternary step per column of each Linear weight, one fp8 component of state per "
                 "column (taco_k); AdamW on embeddings, norms, biases and head", TACO_LR, "fine-tuning (docs/taco.md)"),
    "signsgd": _own("signSGD on every parameter: no optimizer state", 3e-4, "not measured"),
    "frugal_head": _own("FRUGAL at density 0 with Adam state on the output layer only (8-bit); signSGD on every other "
                        "parameter; bf16 weights written with stochastic rounding: the 7B-under-16GB recipe", 1e-3,
                        MEASURED_SAME),
    "muon": _own("Muon: the momentum of each Linear weight orthogonalized by 5 Newton-Schulz steps (torch.optim."
                 "Muon's step, update RMS matched to AdamW's); AdamW on embeddings, norms, biases and head", 1e-3,
                 MUON_LR),
    "muon8bit": _own("Muon with an 8-bit momentum (about 1 byte per parameter), AdamW's moments 8-bit too", 1e-3,
                     MUON_LR),
    "frugal_muon": _own("FRUGAL with Muon in the subspace: Muon on 25% of the Linear weights in turn, signSGD on the "
                        "rest", 1e-3, MEASURED_SAME),
    "lowrank": _baseline("Low-rank weights W = B A in attention and MLP, trained from scratch (GaLore's Low-Rank "
                         "baseline)"),
    "lora": _baseline("LoRA adapters on a frozen random init, embeddings/norms/lm_head trained (arXiv 2106.09685)"),
    "relora": _baseline("LoRA merged and restarted every N steps with optimizer reset and re-warmup "
                        "(arXiv 2307.05695)"),
    "frozen": _baseline("AdamW on embeddings, norms and head only; every projectable Linear weight frozen at its init "
                        "(the control of slimopt compare)"),
    "torch-adamw": _peer("torch.optim.AdamW, foreach kernel (fp32 state, 8 B/param)", 1e-3),
    "torch-adamw-fused": _peer("torch.optim.AdamW, fused kernel (fp32 state, 8 B/param)", 1e-3),
    "bnb-adamw8bit": _peer("bitsandbytes AdamW8bit, block-wise 8-bit state", 1e-3),
    "torchao-adamw8bit": _peer("torchao AdamW8bit, block-wise 8-bit state", 1e-3),
    "torchao-adamw4bit": _peer("torchao AdamW4bit, 4-bit state", 1e-3),
    "galore-torch": _peer("galore-torch GaLoreAdamW (SVD projection, rank r)", 1e-2),
    "galore-torch-8bit": _peer("galore-torch GaLoreAdamW8bit (SVD projection + bitsandbytes 8-bit)", 1e-2),
    "apollo": _peer("apollo-torch APOLLO (random projection, channel scaling)", 1e-2),
    "apollo-mini": _peer("apollo-torch APOLLO-Mini (rank 1, tensor scaling)", 1e-2),
}


def of_kind(kind: str) -> dict[str, Entry]:
    """The entries of one kind, in the table's order."""
    return {name: e for name, e in CATALOG.items() if e.kind == kind}


def known_methods() -> dict[str, tuple[str, str]]:
    """Every name ``--method`` accepts -> (kind, description); kind is 'slimopt', 'baseline' or 'peer'."""
    return {name: (e.kind, e.description) for name, e in CATALOG.items()}


def _entry(method: str) -> Entry:
    if method not in CATALOG:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(CATALOG)} "
                         f"(`slimopt methods` lists them with descriptions)")
    return CATALOG[method]


def method_kind(method: str) -> str:
    """'slimopt', 'baseline' or 'peer'; ValueError for an unknown name."""
    return _entry(method).kind


def lr_source(method: str) -> str:
    """Where ``default_lr(method)`` comes from: a paper, a measured ratio to AdamW's tuned rate, a peer's authors."""
    return _entry(method).lr_source


def lr_is_papers(method: str) -> bool:
    """Whether ``default_lr(method)`` is a paper's (its source cites an arXiv id and is not a measured ratio)."""
    source = lr_source(method)
    return bool(re.search(r"\d{4}\.\d{5}", source)) and "measured" not in source


def resolve_lr(method: str, lr: float | None = None) -> float:
    """`lr` when given, else the method's default (``default_lr``)."""
    return float(lr) if lr is not None else default_lr(method)


def default_lr(method: str) -> float:
    """The method's default learning rate: its paper's for LLaMA pretraining (or the peer's authors'), or for a
    method that is slimopt's own AdamW's times its measured ratio to it (``lr_source`` says which)."""
    return _entry(method).lr
