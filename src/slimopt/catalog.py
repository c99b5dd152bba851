"""Every name ``--method`` accepts, with its kind, description and default learning rate, without importing torch.

Three kinds: slimopt's own methods (``slimopt.optim.algorithm.specs``), the baselines (``slimopt.baselines``: GaLore's
Low-Rank, LoRA arXiv 2106.09685, ReLoRA arXiv 2307.05695, and the frozen-weights control of ``slimopt compare``)
and other libraries' optimizers (``slimopt.peers``). Listing them (``slimopt methods``) or checking a name costs
no torch import: the tables are data, and a peer's availability is read from the installed packages, not by
importing them.
"""

from __future__ import annotations

__all__ = ["BASELINES", "known_methods", "method_kind", "default_lr", "lr_source", "lr_is_papers"]

BASELINES: dict[str, str] = {
    "lowrank": "Low-rank weights W = B A in attention and MLP, trained from scratch (GaLore's Low-Rank baseline)",
    "lora": "LoRA adapters on a frozen random init, embeddings/norms/lm_head trained (arXiv 2106.09685)",
    "relora": "LoRA merged and restarted every N steps with optimizer reset and re-warmup (arXiv 2307.05695)",
    "frozen": "AdamW on embeddings, norms and head only; every projectable Linear weight frozen at its init "
              "(the control of slimopt compare)",
}
BASELINE_LR = 1e-3  # the AdamW learning rate of the GaLore paper's LLaMA runs, for every baseline


def known_methods() -> dict[str, tuple[str, str]]:
    """Every name ``--method`` accepts -> (kind, description); kind is 'slimopt', 'baseline' or 'peer'."""
    from slimopt.optim.algorithm.specs import METHODS
    from slimopt.peers import PEERS

    out = {n: ("slimopt", m.description) for n, m in METHODS.items()}
    out.update({n: ("baseline", d) for n, d in BASELINES.items()})
    out.update({n: ("peer", p.description) for n, p in PEERS.items()})
    return out


def method_kind(method: str) -> str:
    """'slimopt', 'baseline' or 'peer'; ValueError for an unknown name."""
    known = known_methods()
    if method not in known:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(known)} "
                         f"(`slimopt methods` lists them with descriptions)")
    return known[method][0]


def lr_source(method: str) -> str:
    """Where ``default_lr(method)`` comes from: a paper, a measured ratio to AdamW's tuned rate, a peer's authors."""
    from slimopt.optim.algorithm.specs import METHODS, PAPER_ADAMW

    kind = method_kind(method)
    if kind == "slimopt":
        return METHODS[method].lr_source
    if kind == "peer":
        return "peer authors' default"
    return PAPER_ADAMW


def lr_is_papers(method: str) -> bool:
    """Whether ``default_lr(method)`` is a paper's (its source cites an arXiv id and is not a measured ratio)."""
    import re
    source = lr_source(method)
    return bool(re.search(r"\d{4}\.\d{5}", source)) and "measured" not in source


def default_lr(method: str) -> float:
    """The method's default learning rate: its paper's for LLaMA pretraining (or the peer's authors'), or for a
    method that is slimopt's own AdamW's times its measured ratio to it (``lr_source`` says which)."""
    from slimopt.optim.algorithm.specs import METHODS
    from slimopt.peers import PEERS

    kind = method_kind(method)
    if kind == "slimopt":
        return METHODS[method].lr
    if kind == "peer":
        return PEERS[method].default_lr
    return BASELINE_LR
