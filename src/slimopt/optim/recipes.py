"""Named recipes with the papers' defaults, and ``build(model, method)``.

A method is a pair of settings: one for the projectable weights (Linear weights in attention and MLP blocks), one
for everything else (embeddings, norms, biases, the output layer). ``build`` partitions a model
(``partition.classify``), applies the method, then per-call hyperparameters, then regex overrides, and checks that
every trainable parameter has exactly one owner.

Papers: GaLore (arXiv 2403.03507: lr 0.01, scale 0.25, rank 128 at 60M, update gap 200), FRUGAL (arXiv 2411.07837:
lr 1e-3, density 0.25, blockwise, signSGD residual, state reset at every refresh, update gap 200), BAdam
(arXiv 2404.02827: one block at a time, inactive blocks frozen), 8-bit Adam (arXiv 2110.02861), 4-bit Adam
(arXiv 2309.01507).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from torch import nn

from slimopt import catalog
from slimopt.optim.algorithm.partition import check_owners, classify, is_linear, module_matches
from slimopt.optim.algorithm.specs import FRUGAL_DEFAULTS, METHODS, STATE_FREE, TACO_DEFAULTS, Method
from slimopt.optim.algorithm.usage import unused_reason
from slimopt.optim.optimizer import DEFAULTS, SlimOptimizer

# Settings build() accepts; those in _SHARED go to every group, the rest to the projectable group.
_SHARED = ("lr", "betas", "eps", "eps_placement", "weight_decay", "momentum", "rule", "seed", "codec", "m_codec",
           "v_codec", "state_bits", "compile", "fused", "param_rounding")


def methods() -> dict[str, str]:
    """Available method names with a one-line description each (``slimopt.catalog``'s slimopt methods)."""
    return {name: e.description for name, e in catalog.of_kind("slimopt").items()}


def default_lr(method: str) -> float:
    """The method's default learning rate (``slimopt.catalog.default_lr``; ``lr_source`` says where it comes from)."""
    _method(method)
    return catalog.default_lr(method)


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def param_groups(model: nn.Module, method: str, *, target_modules: str | Iterable[str] | None = None,
                 state_full: str | None = None, overrides: dict[str, dict[str, Any]] | None = None,
                 **hparams: Any) -> list[dict[str, Any]]:
    """The parameter groups ``build`` gives the optimizer (see ``build``)."""
    spec = _method(method)
    state_full = spec.state_full if state_full is None else state_full
    unknown = sorted(set(hparams) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for method {method!r}; allowed: {', '.join(DEFAULTS)}")
    if state_full not in ("all", "head"):
        raise ValueError(f"state_full must be 'all' (embeddings, norms and head in AdamW) or 'head' (only the "
                         f"output layer state-full, the rest signSGD); got {state_full!r}")
    shared = {**spec.shared, **{k: v for k, v in hparams.items() if k in _SHARED}}
    shared.setdefault("lr", catalog.default_lr(method))
    proj_hp = {k: v for k, v in hparams.items() if k not in _SHARED}
    if "rank" in proj_hp:
        proj_hp.setdefault("density", None)
    if "density" in proj_hp and proj_hp["density"] is not None:
        proj_hp.setdefault("rank", None)

    # what the caller gives for every group beats what the method sets on a kind of parameter (frugal_head's 8-bit
    # head takes codec="fp32"); an override beats both
    given = {k: v for k, v in hparams.items() if k in _SHARED}
    base = {
        "projectable": {**spec.projectable, **proj_hp, **given},
        "head": {**spec.rest, **given},
        "embedding": {**(spec.rest if state_full == "all" else STATE_FREE), **given},
        "other": {**(spec.rest if state_full == "all" else STATE_FREE), **given},
    }
    compiled = [(re.compile(pattern), settings) for pattern, settings in (overrides or {}).items()]
    classes = classify(model, target_modules)
    _check_matches(model, target_modules, [rx for rx, _ in compiled], list(classes))
    groups: dict[tuple, dict[str, Any]] = {}
    for name, (p, kind) in classes.items():
        label, settings = kind, base[kind]
        for rx, extra in compiled:
            if rx.search(name):
                label, settings = f"{kind}:{rx.pattern}", {**settings, **extra}
                break
        key = (label,)
        if key not in groups:
            groups[key] = {"params": [], "names": [], "name": label, **shared, **settings}
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    out = list(groups.values())
    check_owners(model, out)
    _check_read(method, out, {k: v for k, v in hparams.items() if k not in _SHARED}, "projectable")
    _check_read(method, out, {k: v for k, v in hparams.items() if k in _SHARED}, None)
    for pattern, extra in (overrides or {}).items():
        _check_read(method, out, extra, f":{pattern}")
    return out


def _check_matches(model: nn.Module, target_modules: str | Iterable[str] | None, patterns: list[re.Pattern],
                   names: list[str]) -> None:
    """Raise when target_modules selects no Linear module or an override matches no trainable parameter.

    Either would otherwise leave the method silently unapplied (a typo in target_modules makes GaLore plain AdamW).
    """
    if target_modules is not None:
        linear = [m for m, module in model.named_modules() if m and is_linear(module)]
        if not any(module_matches(m, target_modules) for m in linear):
            leaves = sorted({m.rsplit(".", 1)[-1] for m in linear})
            raise ValueError(f"target_modules {target_modules!r} matches no nn.Linear module of the model; "
                             f"its Linear modules end in: {', '.join(leaves) or '(none)'} "
                             f"(names, regular expressions fully matching a module name, or 'all-linear')")
    for rx in patterns:
        if not any(rx.search(n) for n in names):
            raise ValueError(f"overrides pattern {rx.pattern!r} matches no trainable parameter name "
                             f"(re.search against names such as {', '.join(names[:3])})")


def _check_read(method: str, groups: list[dict[str, Any]], given: dict[str, Any], receiver: str | None) -> None:
    """Raise when a setting the caller gave reaches groups none of which reads it (a silent no-op otherwise).

    receiver: which groups got the settings: "projectable" (the label's kind), ":PATTERN" (an override's groups)
    or None (every group). Restating a default is let through: it changes nothing either way.
    """
    def received(g: dict[str, Any]) -> bool:
        if receiver is None:
            return True
        if receiver.startswith(":"):
            return g["name"].endswith(receiver)
        return g["name"].split(":", 1)[0] == receiver

    targets = [{**DEFAULTS, **g} for g in groups if received(g)]
    for key, value in given.items():
        if not targets or (key in DEFAULTS and _same(value, DEFAULTS[key])):
            continue
        reasons = [unused_reason(key, g) for g in targets]
        if all(reasons):
            where = ("" if receiver is None else " (the projectable weights)" if receiver == "projectable"
                     else f" (override {receiver[1:]!r})")
            raise ValueError(f"{key}={value!r} has no effect with method {method!r}{where}: {reasons[0]}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return tuple(a) == tuple(b)
    return type(a) is type(b) and a == b


def build(model: nn.Module, method: str = "adamw", *, target_modules: str | Iterable[str] | None = None,
          state_full: str | None = None, overrides: dict[str, dict[str, Any]] | None = None,
          **hparams: Any) -> SlimOptimizer:
    """Partition `model`'s trainable parameters and return the optimizer for `method`.

    - hparams: any SlimOptimizer setting. lr, betas, eps, eps_placement, weight_decay, momentum, rule, seed,
      compile, fused, param_rounding and the codec settings apply to every group; the others (rank, density,
      update_gap, scale, projector, ...) to the projectable weights. lr defaults to ``default_lr(method)``. A setting that no group
      receiving it reads (``rank`` for plain AdamW, ``momentum`` for Adam) is a ValueError naming it, not a silent
      no-op.
    - target_modules: which Linear modules are projectable (Hugging Face ``optim_target_modules`` convention);
      default all Linear weights outside the output layer.
    - state_full: ``"all"`` keeps embeddings, norms and the head in AdamW; ``"head"`` keeps only the output layer
      state-full and moves embeddings and norms to signSGD (FRUGAL's finding that only the head needs Adam).
      Default: the method's own (``"head"`` for ``frugal_head``, else ``"all"``).
    - overrides: ``{regex: settings}``; a parameter whose name matches (``re.search``, first match wins) gets its
      kind's settings updated with these, in a group of its own.

    Example::

        >>> import torch, slimopt
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        >>> opt = slimopt.build(model, "frugal", density=0.5)
        >>> model(torch.randn(4, 16)).square().mean().backward()
        >>> opt.step(); opt.zero_grad()
    """
    return SlimOptimizer(param_groups(model, method, target_modules=target_modules, state_full=state_full,
                                      overrides=overrides, **hparams))


class GaLoreAdamW(SlimOptimizer):
    """Drop-in for ``galore_torch.GaLoreAdamW``: groups with a ``rank`` are projected.

    Accepts galore-torch's group layout ``{"params", "rank", "update_proj_gap", "scale", "proj_type"}`` (what the
    Hugging Face Trainer builds for ``optim="galore_adamw"``) and galore-torch's defaults (lr 1e-3, eps 1e-6).
    Its Adam arithmetic is galore-torch's: eps is added to sqrt(v) before the bias correction
    (``eps_placement="galore"``; ``"torch"`` gives torch.optim.AdamW's m_hat / (sqrt(v_hat) + eps), which moves
    the parameters 5-45% of their movement away from galore-torch at eps 1e-8 to 1e-6 over 10 steps of a tiny
    LLaMA). tests/test_galore_parity.py checks every proj_type at eps 1e-6 and 1e-8. Its projections run in the
    gradient's dtype, as galore-torch's do, where the device has 16-bit matrix units (``proj_dtype="auto"``: bf16
    products for bf16 weights on a GPU or a CPU with AVX512-BF16 or AMX, fp32 elsewhere).

    One difference on purpose (docs/design.md, section 3): weight decay is applied once, before the update,
    p (1 - lr wd) - lr u, where galore-torch applies it after, (p - lr u)(1 - lr wd). The two differ by lr * wd times
    each step's update: 1e-4 of the parameters' movement at lr 1e-2 and weight decay 0.01. ``correct_bias=False``
    is refused. Example::

        >>> import torch, slimopt
        >>> w, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.zeros(32))
        >>> opt = slimopt.GaLoreAdamW([{"params": [b]}, {"params": [w], "rank": 8, "update_proj_gap": 200,
        ...                            "scale": 0.25, "proj_type": "std"}], lr=1e-2)
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 correct_bias: bool = True, eps_placement: str = "galore", **settings: Any) -> None:
        if not correct_bias:
            raise ValueError("correct_bias=False is not supported: slimopt always applies Adam's bias correction")
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [_from_galore_group(g) for g in params]
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, eps_placement=eps_placement,
                         **settings)


def _from_galore_group(group: dict[str, Any]) -> dict[str, Any]:
    group = dict(group)
    if "rank" in group:
        group["projector"] = group.get("projector", "svd")
        group["update_gap"] = group.pop("update_proj_gap", 200)
        group["scale"] = group.get("scale", 1.0)
        group["proj_side"] = group.pop("proj_type", "std")
        group.setdefault("proj_dtype", "auto")
    return group


class FRUGAL(SlimOptimizer):
    """FRUGAL (arXiv 2411.07837): Adam on a subspace, signSGD on the rest; defaults from the paper.

    Defaults: blockwise selection of whole tensors at density 0.25, a new selection every 200 steps with the
    moments reset, signSGD on the residual at the full lr. Every projector is available (``projector="svd"``,
    ``"random"``, ``"columns"``, ...). Use ``slimopt.build(model, "frugal")`` to keep embeddings, norms and the head
    in AdamW.

    The Adam part is the reference's (github fzmushko/FRUGAL, ``BlockAdamW``): eps 1e-8 added to the
    bias-corrected sqrt(v) (torch's placement), weight decay before the update. Different here: the blocks walk
    in ascending order (the reference draws them at random: ``block_order="random"`` draws each refresh's blocks
    independently), and weight_decay defaults to 0 (the reference class to 0.01). docs/dropins.md says more.
    """

    def __init__(self, params, lr: float = 1e-3, **settings: Any) -> None:
        if settings.get("rank") is not None and "density" not in settings:
            settings["density"] = None
        super().__init__(params, lr=lr, **{**FRUGAL_DEFAULTS, **settings})


class BAdam(SlimOptimizer):
    """BAdam (arXiv 2404.02827) as a baseline: Adam on one tensor of the group at a time, the others frozen.

    As the reference (github Ledzy/BAdam, ``BlockOptimizer`` around torch.optim.AdamW): Adam's state and bias
    correction restart whenever a block becomes active, each block gets ``update_gap`` steps in turn (the
    README's 100), torch's eps placement. Different here: a block is one tensor of the group (the reference's
    default block is a transformer layer; one Linear weight per block is its README's finer partition; a group
    holding the Linear weights in layer order with ``density=1/num_layers`` steps a layer at a time), and the
    order is ascending (the reference's constructor defaults to descending, its README to random).
    """

    def __init__(self, params, lr: float = 1e-3, **settings: Any) -> None:
        base = {"projector": "block", "rank": 1, "update_gap": 100, "free_rule": "none", "on_refresh": "reset"}
        if settings.get("density") is not None and "rank" not in settings:
            settings["rank"] = None
        super().__init__(params, lr=lr, **{**base, **settings})


class TACO(SlimOptimizer):
    """TACO (arXiv 2610.02199): per column of each 2-D weight, a step of lr * taco_alpha * m / n on the one entry
    whose accumulated gradient is largest, in its sign; k low-precision components of state per column
    (``taco_k``, default 1).

    2-D tensors take TACO (``slimopt.optim.algorithm.taco`` documents the direction, the normalization, the history and
    which choices are ours); other tensors take AdamW through the group's codecs. Settings: ``taco_k``,
    ``taco_decay``, ``taco_format``, ``taco_scale_dtype``, ``taco_norm``, ``taco_alpha`` and every SlimOptimizer
    setting. Use ``slimopt.build(model, "taco")`` to keep embeddings, norms and the head in AdamW.

    Example::

        >>> import torch, slimopt
        >>> w, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.zeros(64))
        >>> opt = slimopt.TACO([w, b], lr=3e-4)
        >>> w.grad, b.grad = torch.randn(64, 32), torch.randn(64)
        >>> opt.step()
        >>> sorted(opt.state[w])
        ['step', 'taco_absmax', 'taco_rows', 'taco_values']
    """

    def __init__(self, params, lr: float = catalog.TACO_LR, **settings: Any) -> None:
        super().__init__(params, lr=lr, **{**TACO_DEFAULTS, **settings})
