"""slimopt optimizers inside the Hugging Face ``transformers.Trainer``, with the parameter groups ``slimopt.build``
makes (GaLore, arXiv 2403.03507; FRUGAL, arXiv 2411.07837; TACO, arXiv 2610.02199; 8-bit state, arXiv 2110.02861)::

    # 1. the Trainer builds the optimizer, then its own scheduler
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(model, "galore", rank=8, lr=1e-4))
    # 2. you build it from the TrainingArguments (lr, weight decay, betas, eps, optim_target_modules, optim_args)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(make_optimizer(model, args), None))
    # 3. int8 body weights, masters and state on the host, each weight stepped during backward (the model is
    #    converted in place; accumulation and max_grad_norm from args; the Trainer's scheduler sets the lr)
    opt = make_optimizer(model, args, "adamw8bit", weights="int8", offload="host")
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

Details: docs/modules.md, ``slimopt.finetune.hf``; int8 weights and host masters: docs/offload.md.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterable

import torch
from torch import nn

from slimopt import factory
from slimopt.optim.optimizer import DEFAULTS, SlimOptimizer
from slimopt.optim.recipes import METHODS, param_groups
from slimopt.options import parse_value, split_pairs

__all__ = [
    "TrainerMasterWeights",
    "TrainerSlimOptimizer",
    "optimizer_cls_and_kwargs",
    "make_optimizer",
    "parse_optim_args",
    "trainer_target_modules",
    "OPTIM_ARGS_ALIASES",
]

OPTIM_ARGS_ALIASES = {"update_proj_gap": "update_gap", "proj_type": "proj_side"}
"""galore-torch / Trainer GaLore names -> slimopt names."""

# Settings that come from TrainingArguments fields; in optim_args they would silently fight those fields.
_FROM_ARGS = {"lr": "learning_rate", "weight_decay": "weight_decay", "betas": "adam_beta1 / adam_beta2",
              "eps": "adam_epsilon"}
# build() options besides the optimizer settings.
_BUILD_OPTIONS = ("state_full",)

_UNSET: Any = object()


class TrainerSlimOptimizer(SlimOptimizer):
    """The class ``optimizer_cls_and_kwargs`` hands the Trainer: a ``SlimOptimizer`` that accepts only the
    groups slimopt made.

    The Trainer pops ``"params"`` out of the kwargs when it builds the optimizer. Were the same pair used again (a
    second Trainer, ``model_init`` re-creating the model), the Trainer would pass its own two decay groups and a
    plain SlimOptimizer would silently run AdamW at its default lr; this class refuses instead.
    """

    def __init__(self, params: Iterable[Any], **settings: Any) -> None:
        params = list(params)
        if not params or not all(isinstance(g, dict) and "name" in g for g in params):
            raise ValueError(
                "TrainerSlimOptimizer got parameter groups slimopt did not make: the optimizer_cls_and_kwargs pair "
                "was already consumed by a Trainer (it pops 'params'). Call optimizer_cls_and_kwargs(model, ...) "
                "again for every Trainer."
            )
        super().__init__(params, **settings)


class TrainerMasterWeights(torch.optim.Optimizer):
    """A ``slimopt.weights.MasterWeights`` (int8 weights, host masters) as the Trainer, accelerate and torch's lr
    schedulers take an optimizer: its ``param_groups`` are the MasterWeights' front groups (the Trainer's
    scheduler writes the lr there; the next window's steps read it), ``step()`` and ``zero_grad()`` do nothing
    (each weight stepped during the backward pass), ``state`` is the host optimizer's and ``state_dict()`` holds
    the masters, the state and the counters (``torch.load(weights_only=True)`` reads it)."""

    def __init__(self, masters: Any) -> None:
        self.masters = masters
        front = masters.front
        super().__init__(front.param_groups, front.defaults)  # the same group dicts: nothing copied
        self.param_groups = front.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.masters.state

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ sets an empty one: the host optimizer's is it
        pass

    def step(self, closure=None) -> None:
        self.masters.step(closure)
        self.masters.front._opt_called = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.masters.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.masters.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.masters.load_state_dict(state_dict)

    def grad_norm_callback(self) -> Any:
        """A ``transformers.TrainerCallback`` that logs the masters' gradient norm as the Trainer's ``grad_norm``.

        The Trainer measures the norm on the model's parameters, whose gradients the masters took during the
        backward pass: it would log 0. Insert it first, so that every reporter sees the real norm::

            trainer.callback_handler.callbacks.insert(0, opt.grad_norm_callback())
        """
        from transformers import TrainerCallback

        masters = self.masters

        class MasterGradNorm(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs is None or "grad_norm" not in logs:
                    return
                # the log as the Trainer recorded it (state.log_history) and as the callbacks after this one see it
                for record in (logs, state.log_history[-1] if state.log_history else {}):
                    record["grad_norm"] = masters.last_grad_norm

        return MasterGradNorm()


# --------------------------------------------------------------------------------------------------------------
# optim_target_modules and optim_args


def trainer_target_modules(model: nn.Module, optim_target_modules: str | list[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules the Trainer's GaLore integration selects for ``optim_target_modules``.

    Uses transformers' own matcher (``trainer_utils.check_target_module_exists``), so the selection follows the
    installed version. Raises ValueError when nothing matches or the argument has the wrong type.
    """
    from transformers.trainer_utils import check_target_module_exists

    if isinstance(optim_target_modules, tuple):
        optim_target_modules = list(optim_target_modules)
    if not isinstance(optim_target_modules, (str, list)) or (
        isinstance(optim_target_modules, list) and not all(isinstance(t, str) for t in optim_target_modules)
    ):
        raise ValueError(
            "optim_target_modules must be 'all-linear', a regular expression, or a list of module names / "
            f"regular expressions; got {optim_target_modules!r}"
        )
    all_linear = isinstance(optim_target_modules, str) and optim_target_modules.replace("_", "-") == "all-linear"
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (all_linear or check_target_module_exists(optim_target_modules, name))
    ]
    if not names:
        raise ValueError(f"optim_target_modules {optim_target_modules!r} matches no nn.Linear module of the model")
    return names


def parse_optim_args(optim_args: str | None) -> dict[str, Any]:
    """``"rank=8,update_proj_gap=100,scale=2,projector=svd"`` -> ``{"rank": 8, "update_gap": 100, "scale": 2,
    "projector": "svd"}``.

    Values are parsed by ``slimopt.options.parse_value``: ints, floats, booleans (true/false), tuples
    (``betas=(0.9,0.95)``) or strings (``projector=none`` is the name ``"none"``). Keys are SlimOptimizer
    settings (``slimopt.optim.optimizer.DEFAULTS``), galore-torch's aliases (``update_proj_gap``, ``proj_type``)
    or ``state_full``. lr, weight_decay, betas and eps are refused: they
    come from the TrainingArguments fields. Raises ValueError naming the bad key or item.
    """
    if optim_args is None:
        return {}
    if not isinstance(optim_args, str):
        raise ValueError(f"optim_args must be a 'key=value,key=value' string or None, got {type(optim_args).__name__}")
    out: dict[str, Any] = {}
    allowed = sorted({*DEFAULTS, *OPTIM_ARGS_ALIASES, *_BUILD_OPTIONS} - set(_FROM_ARGS))
    for item in split_pairs(optim_args):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"optim_args: expected key=value, got {item!r} in {optim_args!r}")
        key = OPTIM_ARGS_ALIASES.get(key, key)
        if key in _FROM_ARGS:
            raise ValueError(
                f"optim_args: {key!r} comes from TrainingArguments ({_FROM_ARGS[key]}), not from optim_args"
            )
        if key not in allowed:
            raise ValueError(f"optim_args: unknown key {key!r}; allowed: {', '.join(allowed)}")
        if key in out:
            raise ValueError(f"optim_args: {key!r} is given twice in {optim_args!r}")
        out[key] = parse_value(value)
    return out


# --------------------------------------------------------------------------------------------------------------
# parameter groups


def _kind(group: dict[str, Any]) -> str:
    return group["name"].split(":", 1)[0]


def _groups(
    model: nn.Module,
    method: str,
    optim_target_modules: str | list[str] | None,
    state_full: str,
    **hparams: Any,
) -> list[dict[str, Any]]:
    """slimopt.param_groups with the Trainer's target selection and weight-decay exclusions applied."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    selected: set[str] = set()
    target: str | None = None
    if optim_target_modules is not None:
        modules = trainer_target_modules(model, optim_target_modules)
        # One exact-name regex: slimopt's own matcher would also accept suffixes, the Trainer's also substrings.
        target = "(?:" + "|".join(re.escape(m) for m in modules) + ")"
        selected = {f"{m}.weight" for m in modules}
    groups = param_groups(model, method, target_modules=target, state_full=state_full, **hparams)

    if selected:
        # slimopt keeps output layers (classifier, pooler, lm_head) out of the projectable group whatever the
        # target says; the Trainer projects every selected Linear ("all-linear" includes the head). Follow the
        # Trainer, so the same optim_target_modules means the same thing in both.
        projectable = next((g for g in groups if g["name"] == "projectable"), None)
        for g in groups:
            if g is projectable:
                continue
            moved = [i for i, n in enumerate(g["names"]) if n in selected]
            if not moved:
                continue
            if projectable is None:
                raise ValueError(
                    f"optim_target_modules {optim_target_modules!r} selects only output layers "
                    f"({[g['names'][i] for i in moved][:3]}); select some inner Linear layers too"
                )
            projectable["params"] += [g["params"][i] for i in moved]
            projectable["names"] += [g["names"][i] for i in moved]
            g["params"] = [p for i, p in enumerate(g["params"]) if i not in moved]
            g["names"] = [n for i, n in enumerate(g["names"]) if i not in moved]
        groups = [g for g in groups if g["params"]]

    if any(float(g.get("weight_decay", DEFAULTS["weight_decay"])) != 0.0 for g in groups):
        groups = _split_no_decay(model, groups)
    return groups


def _split_no_decay(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give biases and normalisation weights a group of their own with weight_decay 0, as the Trainer does."""
    from transformers import Trainer

    # get_decay_parameter_names does not use the Trainer instance; calling it keeps the rule of the installed
    # transformers (nn.LayerNorm children, names with bias / layernorm / rmsnorm / norm).
    decay = set(Trainer.get_decay_parameter_names(None, model))
    out = []
    for g in groups:
        keep = [i for i, n in enumerate(g["names"]) if n in decay]
        if len(keep) == len(g["names"]):
            out.append(g)
            continue
        free = [i for i in range(len(g["names"])) if i not in set(keep)]
        if keep:
            out.append({**g, "params": [g["params"][i] for i in keep], "names": [g["names"][i] for i in keep]})
        out.append({**g, "params": [g["params"][i] for i in free], "names": [g["names"][i] for i in free],
                    "name": f"{g['name']}:no_decay", "weight_decay": 0.0})
    return out


# --------------------------------------------------------------------------------------------------------------
# public entry points


def optimizer_cls_and_kwargs(
    model: nn.Module,
    method: str = "adamw",
    *,
    optim_target_modules: str | list[str] | None = None,
    state_full: str = "all",
    **hparams: Any,
) -> tuple[type[SlimOptimizer], dict[str, Any]]:
    """``(TrainerSlimOptimizer, {"params": groups})`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    Args:
        model: the model the Trainer will train (a peft model: its trainable parameters only).
        method: a slimopt method (``slimopt.methods()``).
        optim_target_modules: which Linear weights are projectable, with the Trainer's matching rules (module
            docstring); None: slimopt's default (every Linear outside the output layers).
        state_full: "all" or "head", as in ``slimopt.build``.
        hparams: any SlimOptimizer setting (lr, rank, update_gap, scale, density, state_bits, ...); lr defaults
            to ``slimopt.default_lr(method)``. A non-zero weight_decay skips biases and norms.

    The groups carry every setting, so the kwargs hold only ``"params"``; the Trainer's TrainingArguments
    ``learning_rate`` etc. are not consulted (use ``make_optimizer`` for that). The Trainer consumes the kwargs:
    build a new pair for each Trainer.
    """
    groups = _groups(model, method, optim_target_modules, state_full, **hparams)
    return TrainerSlimOptimizer, {"params": groups}


def make_optimizer(
    model: nn.Module,
    args: Any = None,
    method: str = "adamw",
    *,
    optim_target_modules: str | list[str] | None = _UNSET,
    optim_args: str | None = _UNSET,
    weights: str = "dtype",
    offload: str = "none",
    master: str = "fp32",
    int8_group: int = 0,
    int8_embeddings: bool = False,
    **hparams: Any,
) -> SlimOptimizer | TrainerMasterWeights:
    """A ``SlimOptimizer`` built from ``TrainingArguments``-style settings, for ``Trainer(optimizers=(opt, None))``.

    Args:
        model: the model to train.
        args: a ``transformers.TrainingArguments`` (or any object with its field names) or None. Taken from it:
            ``learning_rate``, ``weight_decay``, ``adam_beta1`` / ``adam_beta2``, ``adam_epsilon``,
            ``optim_target_modules`` and ``optim_args``. With None: the method's defaults.
        method: a slimopt method.
        optim_target_modules: overrides ``args.optim_target_modules`` (None: slimopt's default selection).
        optim_args: overrides ``args.optim_args``; e.g. ``"rank=8,update_gap=100,scale=2"`` for GaLore
            (see ``parse_optim_args``).
        weights, offload, master, int8_group, int8_embeddings: as ``slimopt.build``. With ``weights="int8"`` or
            ``offload="host"`` the model is converted in place (its body's Linear weights int8, not the head) and a
            ``TrainerMasterWeights`` returned: every weight steps during the backward pass, with
            ``args.gradient_accumulation_steps`` and the clipping of ``args.max_grad_norm``; the Trainer's own
            clipping then finds no gradient on the model and does nothing (its logged ``grad_norm``: see
            ``TrainerMasterWeights.grad_norm_callback``).
        hparams: further SlimOptimizer settings; a key also given in optim_args is an error.

    Example (``model`` a BERT-style classifier)::

        args = transformers.TrainingArguments("out", learning_rate=2e-5, weight_decay=0.01,
                                              optim_target_modules=["attention", "intermediate", "output.dense"],
                                              optim_args="rank=8,update_proj_gap=100,scale=4")
        opt = make_optimizer(model, args, "galore")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    if optim_target_modules is _UNSET:
        optim_target_modules = getattr(args, "optim_target_modules", None)
    if optim_args is _UNSET:
        optim_args = getattr(args, "optim_args", None)
    from_string = parse_optim_args(optim_args)
    both = sorted(set(from_string) & set(hparams))
    if both:
        raise ValueError(f"{both} given both in optim_args and as keyword arguments; give each once")
    settings: dict[str, Any] = {}
    if args is not None:
        settings = {
            "lr": float(args.learning_rate),
            "weight_decay": float(args.weight_decay),
            "betas": (float(args.adam_beta1), float(args.adam_beta2)),
            "eps": float(args.adam_epsilon),
        }
    settings.update(from_string)
    settings.update(hparams)
    # without args, lr and weight decay are the method's defaults (slimopt.catalog's lr, no decay)
    groups = partial(_groups, optim_target_modules=optim_target_modules, state_full=settings.pop("state_full", "all"))
    placement = _placement(args, weights, offload, master, int8_group, int8_embeddings)
    opt = factory.make_optimizer(model, method, settings.pop("lr", None), settings.pop("weight_decay", 0.0),
                                 groups=groups, placement=placement, **settings)
    return opt if placement is None else TrainerMasterWeights(opt)


def _placement(args: Any, weights: str, offload: str, master: str, int8_group: int,
               int8_embeddings: bool = False) -> dict[str, Any] | None:
    """MasterWeights' settings from ``slimopt.build``'s names and the TrainingArguments (None: in place)."""
    for name, value, allowed in (("weights", weights, factory.WEIGHT_FORMATS), ("offload", offload, factory.OFFLOADS),
                                 ("master", master, factory.HOST_MASTERS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    if isinstance(int8_group, bool) or not isinstance(int8_group, int) or int8_group < 0:
        raise ValueError(f"int8_group must be an integer >= 0 (0: one scale per row); got {int8_group!r}")
    if int8_group and weights != "int8":
        raise ValueError("int8_group needs weights='int8'")
    if int8_embeddings and weights != "int8":
        raise ValueError("int8_embeddings needs weights='int8'")
    if weights == "dtype" and offload == "none":
        return None
    clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
    return {"int8": weights == "int8", "int8_group": int8_group, "int8_embeddings": bool(int8_embeddings),
            "master": master if offload == "host" else "none",
            "accumulation_steps": int(getattr(args, "gradient_accumulation_steps", 1) or 1),
            "clip": clip if clip > 0 else None}
