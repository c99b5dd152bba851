"""``make_optimizer``: the optimizer for any name ``--method`` accepts, built the way its kind in ``slimopt.catalog``
says.

The one place a method name becomes an optimizer, for the pretraining loop (``slimopt.train.loop``), the Trainer
path (``slimopt.finetune.hf``: its own parameter groups) and the benchmarks. It sits above the optimizer layer,
the peers and the baselines and below the training layers (docs/design.md, section 1); the catalogue beneath it
imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from slimopt import catalog

if TYPE_CHECKING:
    import torch

__all__ = ["make_optimizer", "build", "WEIGHT_FORMATS", "OFFLOADS", "HOST_MASTERS"]


def make_optimizer(model: torch.nn.Module, method: str, lr: float | None = None, weight_decay: float = 0.0, *,
                   groups: Callable[..., list[dict[str, Any]]] | None = None, placement: dict[str, Any] | None = None,
                   **hp: Any) -> torch.optim.Optimizer:
    """The optimizer for `method` over `model`'s trainable parameters.

    A peer goes through ``slimopt.peers.build_peer``; a baseline (its model already transformed by
    ``slimopt.baselines.prepare``) gets the optimizer of the papers' baseline runs; a slimopt method a
    ``SlimOptimizer`` over ``groups(model, method, **settings)``. lr None: the method's default
    (``slimopt.catalog.default_lr``).

    groups None is the pretraining path (``slimopt train``, compare, the benchmarks): a keyword given as None is
    left out, the groups are ``slimopt.param_groups`` and GaLore-family methods take rank hidden_size / 4, the
    ratio of every GaLore pretraining run (128 at 60M, 512 at 1B, 1024 at 7B). The Trainer path
    (``slimopt.finetune.hf``) passes its own groups (the Trainer's target selection and no-decay groups) and
    keeps every keyword as given and the recipe's rank. placement: ``slimopt.weights.masters.MasterWeights``'
    settings (int8 weights, a host master): the model is converted in place and the MasterWeights returned, which
    steps the same groups during the backward pass.
    """
    kind = catalog.method_kind(method)
    if groups is not None and kind != "slimopt":
        raise ValueError(f"groups apply to slimopt methods; {method!r} is a {kind}")
    if groups is None:
        hp = {k: v for k, v in hp.items() if v is not None}
    if kind == "peer":
        from slimopt.peers import build_peer
        return build_peer(model, method, lr=lr, weight_decay=weight_decay, **hp)
    if kind == "baseline":
        from slimopt import baselines
        lr = catalog.default_lr(method) if lr is None else float(lr)
        return baselines.build_optimizer(model, method, lr=lr, weight_decay=weight_decay, **hp)
    from slimopt.optim.optimizer import SlimOptimizer
    from slimopt.optim.recipes import param_groups
    if groups is None:
        groups = param_groups
        _rank_from_width(model, method, hp)
    if lr is not None:
        hp["lr"] = lr
    if placement is not None:
        from slimopt.weights.masters import MasterWeights
        return MasterWeights(model, method, weight_decay=weight_decay, groups=groups, **placement, **hp)
    return SlimOptimizer(groups(model, method, weight_decay=weight_decay, **hp))


def _rank_from_width(model: torch.nn.Module, method: str, hp: dict[str, Any]) -> None:
    """Set a GaLore-family method's rank to hidden_size / 4 unless the call gives a rank, a density or no projector."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if (method.startswith("galore") and "rank" not in hp and "density" not in hp and hidden
            and hp.get("projector") != "none"):
        hp["rank"] = max(1, hidden // 4)


WEIGHT_FORMATS = ("dtype", "int8")
OFFLOADS = ("none", "host")
HOST_MASTERS = ("fp32", "bf16+int8", "bf16")  # the forms of a host master copy (weights/masters.py)
_MASTER_SETTINGS = ("accumulation_steps", "clip", "clip_mode", "overlap")  # MasterWeights' own keywords


def build(model: torch.nn.Module, method: str = "adamw", *, weights: str = "dtype", offload: str = "none",
          master: str = "fp32", int8_group: int = 0, int8_embeddings: bool = False, **settings: Any):
    """``slimopt.build``: the optimizer for `method` over `model` (``slimopt.optim.recipes.build``, whose
    keywords it takes), and where the weights live.

    - weights: ``"dtype"`` (as the model holds them) or ``"int8"``: the attention and MLP weights become int8
      codes and scales on the device (``slimopt.weights``; ``int8_group`` elements of a row share a scale, 0: a
      row), converted in place; with ``int8_embeddings`` the input embedding and the output layer too (one
      scale a row; an output layer tied to the embedding computes with the embedding's int8 table).
    - offload: ``"none"`` or ``"host"``: a ``master`` copy (``"fp32"``, ``"bf16+int8"`` or ``"bf16"``) of every
      trainable weight and all optimizer state on the host, each weight stepped there as the backward pass
      completes its gradient.
      int8 weights without offload are updated in place on the device with stochastic rounding.

    With either, the model is converted in place and a ``MasterWeights`` returned: it steps during the backward
    pass (``accumulation_steps``, ``clip`` and ``clip_mode`` are its settings), and its ``step()`` and
    ``zero_grad()`` are there for loops written for torch.optim; give ``opt.front`` to an lr schedule.

    Example::

        >>> import torch, slimopt
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        >>> opt = slimopt.build(model, "adamw8bit", weights="int8", offload="host")
        >>> model(torch.randn(4, 16)).square().mean().backward()  # each weight steps as its gradient completes
        >>> opt.step(); opt.zero_grad()
    """
    for name, value, allowed in (("weights", weights, WEIGHT_FORMATS), ("offload", offload, OFFLOADS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    own = {k: settings.pop(k) for k in _MASTER_SETTINGS if k in settings}
    if int8_embeddings and weights != "int8":
        raise ValueError("int8_embeddings=True needs weights='int8'")
    if weights == "dtype" and offload == "none":
        if own:
            raise ValueError(f"{', '.join(own)} apply with weights='int8' or offload='host'")
        from slimopt.optim.recipes import build as build_in_place
        return build_in_place(model, method, **settings)
    from slimopt.weights.masters import MasterWeights
    return MasterWeights(model, method, int8=weights == "int8", int8_group=int8_group,
                         int8_embeddings=int8_embeddings, master=master if offload == "host" else "none", **own,
                         **settings)
