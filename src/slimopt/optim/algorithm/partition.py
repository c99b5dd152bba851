"""Which parameters a recipe projects: an explicit partition of a model's trainable parameters.

Each trainable parameter gets exactly one kind:

- ``projectable``: the weight of an ``nn.Linear`` inside the network's blocks (attention and MLP in LLaMA:
  ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``);
- ``head``: the output layer (``lm_head``, ``classifier``, ``score``, ...), also when it is tied to the embedding;
- ``embedding``: ``nn.Embedding`` weights;
- ``other``: norms, biases and everything else.

``target_modules`` follows the Hugging Face Trainer's ``optim_target_modules`` convention: ``"all-linear"``, a
regular expression matched against module names, or a list of names (a module matches when its name equals an
entry, ends with ``"." + entry``, or fully matches it as a regular expression). Only ``nn.Linear`` weights can be
projectable. Frozen parameters are left out; tied parameters are seen once.
"""

from __future__ import annotations

import re
from typing import Iterable

from torch import Tensor, nn

KINDS = ("projectable", "head", "embedding", "other")
HEAD_NAMES = frozenset({"lm_head", "classifier", "score", "qa_outputs", "cls", "pooler", "output_layer", "head"})
_PRIORITY = {"head": 0, "embedding": 1, "projectable": 2, "other": 3}


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed Linear


def module_matches(name: str, target_modules: str | Iterable[str]) -> bool:
    """True when a module name is selected by an ``optim_target_modules``-style target."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, name) is not None
    for t in target_modules:
        if name == t or name.endswith("." + t) or re.fullmatch(t, name) is not None:
            return True
    return False


def classify(model: nn.Module, target_modules: str | Iterable[str] | None = None) -> dict[str, tuple[Tensor, str]]:
    """Map each trainable parameter's name (as ``model.named_parameters()`` gives it) to (parameter, kind)."""
    kinds: dict[int, str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        parts = mname.split(".") if mname else []
        in_head = any(p in HEAD_NAMES for p in parts)
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                kind = "embedding"
            elif in_head and p.dim() >= 1:
                kind = "head"
            elif is_linear(module) and pname == "weight" and p.dim() == 2:
                selected = module_matches(mname, target_modules) if target_modules is not None else True
                kind = "projectable" if selected else "other"
            else:
                kind = "other"
            old = kinds.get(id(p))
            if old is None or _PRIORITY[kind] < _PRIORITY[old]:
                kinds[id(p)] = kind
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = (p, kinds.get(id(p), "other"))
    return out


def check_owners(model: nn.Module, groups: list[dict]) -> None:
    """Every trainable parameter in exactly one group, and nothing else: raise ValueError otherwise."""
    seen: dict[int, int] = {}
    for group in groups:
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    twice = [trainable.get(i, "?") for i, c in seen.items() if c > 1]
    missing = [n for i, n in trainable.items() if i not in seen]
    stray = [i for i in seen if i not in trainable]
    if twice or missing or stray:
        raise ValueError(f"parameter partition is not exact: in several groups {twice}, in none {missing}, "
                         f"{len(stray)} not trainable")
