"""Which weights a model holds in int8 on the device, and the conversion of a model to that form.

The choice is the planner's (``slimopt memory --weights int8``) and the trainer's alike: every ``nn.Linear`` of
the model's body (attention and MLP projections), not the output layer nor an encoder's pooler (a classifier's
head reads it); norms, biases and embeddings stay in the model's dtype unless ``embeddings`` (the input embedding
and the output layer too, one scale a row). ``to_int8`` swaps each chosen layer for an ``Int8Linear`` (an
``Int8Embedding`` for the input embedding, an ``Int8TiedLinear`` for an output layer tied to it) whose master copy
is the trainable parameter an optimizer steps.
"""

from __future__ import annotations

import torch
from torch import nn

from slimopt.weights.int8_embedding import Int8Embedding
from slimopt.weights.int8_linear import Int8Linear, Int8TiedLinear

__all__ = ["embedding_modules", "int8_weights", "to_int8"]


def embedding_modules(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(the output layer, the input embedding) of a transformers model, each None where it has none."""
    out = []
    for getter in ("get_output_embeddings", "get_input_embeddings"):
        get = getattr(model, getter, None)
        out.append(get() if callable(get) else None)
    return out[0], out[1]


def int8_weights(model: nn.Module, embeddings: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The weights held in int8, as (name, parameter) in the model's order: every ``nn.Linear`` weight of the
    model's body (``base_model_prefix``), not the output layer nor a pooler (a classifier's head); with
    `embeddings`, the input embedding and the output layer too."""
    prefix = getattr(model, "base_model_prefix", "")
    body = getattr(model, prefix, None) if prefix else None
    body = body if isinstance(body, nn.Module) else model
    out_emb, in_emb = embedding_modules(model)
    chosen: dict[int, tuple[str, nn.Parameter]] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for path, mod in body.named_modules():
        if "pooler" in path.split("."):
            continue
        if isinstance(mod, nn.Linear) and mod is not out_emb and id(mod.weight) in names:
            chosen.setdefault(id(mod.weight), (names[id(mod.weight)], mod.weight))
    if embeddings:
        for mod in (in_emb, out_emb):
            w = getattr(mod, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and id(w) in names:
                chosen.setdefault(id(w), (names[id(w)], w))
    order = {n: k for k, n in enumerate(names.values())}
    return sorted(chosen.values(), key=lambda item: order[item[0]])


def to_int8(model: nn.Module, group: int = 0, master_dtype: torch.dtype = torch.float32,
            master_device: torch.device | str = "cpu", embeddings: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Replace every layer ``int8_weights(model, embeddings)`` chooses by an ``Int8Linear`` or ``Int8Embedding``
    (in place; `group` for the body's layers, one scale a row for the embedding and the output layer) and return
    the masters as (weight name, parameter) in the model's order: what an optimizer steps in place of those
    weights. An output layer tied to the input embedding becomes an ``Int8TiedLinear`` on the embedding's table
    (one master, both gradients into it); any other weight shared by two modules is refused."""
    chosen = {id(p): name for name, p in int8_weights(model, embeddings)}
    out_emb, in_emb = embedding_modules(model)
    head_tied = embeddings and out_emb is not None and in_emb is not None and \
        getattr(out_emb, "weight", None) is getattr(in_emb, "weight", False)
    uses: dict[int, int] = {}
    for mod in model.modules():
        if head_tied and mod is out_emb:
            continue
        if isinstance(mod, (nn.Linear, nn.Embedding)) and id(mod.weight) in chosen:
            uses[id(mod.weight)] = uses.get(id(mod.weight), 0) + 1
    tied = [chosen[i] for i, n in uses.items() if n > 1]
    if tied:
        raise ValueError(f"int8 weights: {', '.join(tied)} is shared by several modules (tied); untie it first")
    masters: dict[str, nn.Parameter] = {}
    table = head_place = None  # the input embedding's int8 form, and where a tied output layer sits
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, (nn.Linear, nn.Embedding)) or id(child.weight) not in chosen:
                continue
            if head_tied and child is out_emb:  # after the table it shares is in int8
                head_place = (parent, child_name)
                continue
            name = chosen[id(child.weight)]
            if isinstance(child, nn.Embedding):
                layer = Int8Embedding.from_embedding(child, 0, master_dtype, master_device)
            else:
                layer = Int8Linear.from_linear(child, 0 if child is out_emb else group, master_dtype, master_device)
            setattr(parent, child_name, layer)
            table = layer if child is in_emb else table
            masters[name] = layer.master
    if head_place is not None:
        setattr(*head_place, Int8TiedLinear(table, out_emb.bias))
    return [(name, masters[name]) for name in chosen.values()]  # int8_weights' order
