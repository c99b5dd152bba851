"""Low-rank baselines the memory-lean optimizers are measured against: LoRA, ReLoRA and W = B A.

GaLore's paper sets gradient projection against these ways of making the weights low-rank; here they are, so
that a comparison can run them next to the optimizers.

Details: docs/modules.md, ``slimopt.baselines``.
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from slimopt import catalog

__all__ = [
    "LLAMA_TARGETS",
    "BERT_TARGETS",
    "RELORA_FULLY_TRAINED",
    "ParamCount",
    "count_parameters",
    "default_target_modules",
    "apply_lora",
    "apply_relora",
    "relora_restart",
    "relora_lr_lambda",
    "relora_schedule",
    "LowRankLinear",
    "apply_low_rank",
    "merge_low_rank",
    "freeze_projectable",
    "prepare",
    "build_optimizer",
    "BaselineHook",
]

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections of a LLaMA block."""

BERT_TARGETS = ("query", "key", "value", "output.dense", "intermediate.dense")
"""Attention and MLP linear maps of a BERT / RoBERTa layer ("output.dense" matches the attention output and the
MLP output; the pooler and the classifier are left out)."""

RELORA_FULLY_TRAINED = (r"embed_tokens", r"norm", r"lm_head")
"""Parameter-name patterns that ReLoRA trains in full next to the adapters."""


class ParamCount(NamedTuple):
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0


def count_parameters(model: nn.Module) -> ParamCount:
    """Trainable and total parameters (a tied weight counts once)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return ParamCount(trainable, total)


def _matches(name: str, targets: Sequence[str] | str) -> bool:
    """peft's convention: a string is a regex that must match the whole module name; a list matches a name
    equal to an entry or ending in "." + entry."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """LLaMA-style or BERT-style attention + MLP names, whichever the model has."""
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for targets in (LLAMA_TARGETS, BERT_TARGETS):
        if any(_matches(n, targets) for n in linear_names):
            return targets
    raise ValueError(
        "target_modules: the model has neither LLaMA-style (q_proj, ..., down_proj) nor BERT-style "
        "(query, key, value, ...) linear layers; pass target_modules (names or a regex)"
    )


def _task_type(model: nn.Module) -> str | None:
    cls = type(model).__name__
    if cls.endswith("ForSequenceClassification"):
        return "SEQ_CLS"  # peft keeps the classification head trainable
    if cls.endswith("ForCausalLM"):
        return "CAUSAL_LM"
    return None


def apply_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
    *,
    fully_trained: Sequence[str] = (),
    task_type: str | None = "auto",
) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters; only the adapters (and the head of a classifier) train.

    Args:
        model: a transformers model (or any module with the targeted ``nn.Linear`` layers).
        rank: adapter rank r.
        alpha: LoRA alpha; the adapter output is scaled by alpha / r.
        dropout: dropout on the adapter input.
        target_modules: module names (a name matches if it equals or ends with ".<entry>") or one regex for the
            whole name; default: ``default_target_modules(model)`` (attention + MLP).
        fully_trained: regex patterns (searched in parameter names) of parameters that train in full besides
            the adapters, e.g. ``RELORA_FULLY_TRAINED``.
        task_type: peft task type; "auto" picks SEQ_CLS / CAUSAL_LM from the model class.

    Returns:
        the ``peft.PeftModel``.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    targets = default_target_modules(model) if target_modules is None else target_modules
    if isinstance(targets, str):
        targets_arg: Any = targets
    else:
        targets_arg = list(targets)
    if not any(_matches(n, targets_arg) for n, m in model.named_modules() if isinstance(m, nn.Linear)):
        raise ValueError(f"target_modules {targets!r} match no nn.Linear of the model")
    if task_type == "auto":
        task_type = _task_type(model)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets_arg, task_type=task_type, bias="none"
    )
    peft_model = get_peft_model(model, config)
    if fully_trained:
        patterns = [re.compile(p) for p in fully_trained]
        for name, p in peft_model.named_parameters():
            if "lora_" not in name and any(pat.search(name) for pat in patterns):
                p.requires_grad_(True)
    return peft_model


def apply_relora(
    model: nn.Module,
    rank: int = 128,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = LLAMA_TARGETS,
    *,
    fully_trained: Sequence[str] = RELORA_FULLY_TRAINED,
) -> nn.Module:
    """LoRA set up for ReLoRA pretraining (arXiv 2307.05695): rank 128 and alpha 32 as in the ReLoRA runs,
    adapters on attention + MLP, embeddings / norms / lm_head trained in full. Call ``relora_restart`` every
    N steps (ReLoRA: 5,000) and schedule the learning rate with ``relora_schedule``."""
    return apply_lora(model, rank, alpha, dropout, target_modules, fully_trained=fully_trained)


def _lora_layers(model: nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def relora_restart(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    prune_ratio: float = 1.0,
    seed: int | None = None,
) -> int:
    """Merge every LoRA adapter into its base weight, re-initialise it, and reset its optimizer state.

    After the call the model computes the same function (up to rounding): W <- W + (alpha / r) B A, then
    A is drawn again (Kaiming-uniform, as peft and the LoRA paper initialise it) and B = 0. Parameters keep
    their identity, so the optimizer goes on updating them.

    Args:
        model: a model wrapped by ``apply_lora`` / ``apply_relora`` (plain, unmerged LoRA adapters).
        optimizer: any ``torch.optim.Optimizer``; the state of every adapter parameter is deleted
            (``prune_ratio=1``, a full reset: moments and step count start again) or, for ``prune_ratio`` in
            (0, 1), the smallest ``prune_ratio`` share of each floating-point state tensor shaped like the
            parameter is zeroed (ReLoRA's magnitude pruning, 0.99 in its runs). State of other parameters is
            untouched.
        seed: draws the new A from ``torch.Generator().manual_seed(seed)`` instead of the global generator;
            under data parallelism pass the same seed on every rank (e.g. base seed + restart index) so the
            replicas stay identical.

    Returns:
        the number of adapted layers restarted.
    """
    if not 0.0 < prune_ratio <= 1.0:
        raise ValueError(f"prune_ratio must be in (0, 1], got {prune_ratio!r}")
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("relora_restart: the model has no LoRA layers; wrap it with apply_lora / apply_relora")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    reset_params: list[torch.Tensor] = []
    restarted = 0
    for layer in layers:
        if layer.merged:
            raise ValueError("relora_restart: adapters are merged (merge_adapter was called); unmerge them first")
        base = layer.get_base_layer()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"relora_restart supports LoRA on nn.Linear only, found {type(base).__name__}")
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if adapter in getattr(layer, "lora_variant", {}):
                raise ValueError("relora_restart supports plain LoRA only, not DoRA or other variants")
            lora_a = layer.lora_A[adapter].weight  # (r, in)
            lora_b = layer.lora_B[adapter].weight  # (out, r)
            # Merge in fp32 and round once into the base weight's dtype.
            delta = (lora_b.float() @ lora_a.float()) * layer.scaling[adapter]  # (out, in)
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            base.weight.add_(delta.to(base.weight.dtype))
            if layer.lora_bias.get(adapter, False):
                base.bias.add_(layer.lora_B[adapter].bias * layer.scaling[adapter])
                layer.lora_B[adapter].bias.zero_()
            _kaiming_uniform_(lora_a, generator)
            lora_b.zero_()
            reset_params += [lora_a, lora_b]
            restarted += 1
    if optimizer is not None:
        _reset_state(optimizer, reset_params, prune_ratio)
    return restarted


def _kaiming_uniform_(weight: torch.Tensor, generator: torch.Generator | None) -> None:
    """nn.init.kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn on the CPU when seeded
    so that every device and rank draws the same numbers."""
    bound = 1.0 / math.sqrt(weight.shape[1])
    if generator is None:
        weight.uniform_(-bound, bound)
    else:
        draw = torch.rand(weight.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        weight.copy_(draw)


def _reset_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], prune_ratio: float) -> None:
    for p in params:
        if p not in optimizer.state:
            continue
        if prune_ratio >= 1.0:
            del optimizer.state[p]
            continue
        for value in optimizer.state[p].values():
            if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                magnitude = value.abs().float().flatten()
                k = int(prune_ratio * magnitude.numel())
                if k > 0:
                    threshold = magnitude.kthvalue(k).values
                    value.masked_fill_(value.abs().float() <= threshold, 0)


def relora_lr_lambda(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    restart_every: int,
    restart_warmup_steps: int,
    min_lr_ratio: float = 0.1,
) -> float:
    """ReLoRA's jagged schedule as a multiplier of the peak learning rate.

    Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``; after each
    restart (every ``restart_every`` steps) the rate drops to zero and climbs linearly, over
    ``restart_warmup_steps``, back to where the cosine will be when the re-warmup ends, so the fresh adapters
    and their fresh optimizer state start gently.
    """
    def cosine(s: int) -> float:
        progress = min(1.0, max(0.0, (s - warmup_steps) / max(1, total_steps - warmup_steps)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    if step < warmup_steps:
        return step / max(1, warmup_steps)
    since_restart = step % restart_every
    if step >= restart_every and since_restart < restart_warmup_steps:
        return since_restart / restart_warmup_steps * cosine(step - since_restart + restart_warmup_steps)
    return cosine(step)


def relora_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int,
    restart_every: int,
    restart_warmup_steps: int = 50,
    min_lr_ratio: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with ``relora_lr_lambda``; call ``relora_restart`` when ``step % restart_every == 0``."""
    if restart_every < 1 or not 0 <= restart_warmup_steps < restart_every:
        raise ValueError(
            f"need restart_every >= 1 and 0 <= restart_warmup_steps < restart_every, got {restart_every}, "
            f"{restart_warmup_steps}"
        )
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    fn = partial(
        relora_lr_lambda,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        restart_every=restart_every,
        restart_warmup_steps=restart_warmup_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class LowRankLinear(nn.Module):
    """y = B (A x) + b: a linear map of rank at most r stored as two factors.

    ``down`` holds A (r, in), ``up`` holds B (out, r) and the bias. Parameters: r (in + out) (+ out).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank must be in [1, min(in, out)] = [1, {min(in_features, out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        return self.up(self.down(x))

    @torch.no_grad()
    def init_svd(self, weight: torch.Tensor) -> None:
        """Best rank-r approximation of ``weight`` (out, in): W ~ (U sqrt(S)) (sqrt(S) V^T), the singular
        values split evenly so both factors have the same scale."""
        u, s, vh = torch.linalg.svd(weight.float(), full_matrices=False)
        root = s[: self.rank].sqrt()
        self.up.weight.copy_(u[:, : self.rank] * root)  # (out, r)
        self.down.weight.copy_(root[:, None] * vh[: self.rank])  # (r, in)

    @torch.no_grad()
    def init_random(self, std: float, generator: torch.Generator | None = None) -> None:
        """Gaussian factors whose product has entries of standard deviation ``std`` (like a Linear initialised
        N(0, std^2)): each factor entry has std sqrt(std / sqrt(r))."""
        factor_std = math.sqrt(std / math.sqrt(self.rank))
        for w in (self.down.weight, self.up.weight):
            w.copy_(torch.randn(w.shape, generator=generator) * factor_std)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


@torch.no_grad()
def apply_low_rank(
    model: nn.Module,
    rank: int,
    target_modules: Sequence[str] | str = LLAMA_TARGETS,
    init: str = "svd",
    std: float = 0.02,
    seed: int | None = None,
) -> nn.Module:
    """Replace each targeted ``nn.Linear`` by a ``LowRankLinear`` of rank ``rank``, in place.

    Args:
        model: e.g. a ``LlamaForCausalLM``; embeddings, norms and lm_head are left as they are.
        rank: the factors' rank; at most min(in, out) of every targeted layer.
        target_modules: names (equal to or ending with ".<entry>") or one regex for the full module name.
        init: "svd" (the truncated SVD of the current weight: exact at full rank) or "random" (Gaussian
            factors for pretraining from scratch, product entries of standard deviation ``std``; LLaMA
            initialises its linear layers with std 0.02).
        seed: seeds the random init (every replica the same).

    Returns:
        the model; ``count_parameters`` gives the new size.
    """
    if init not in ("svd", "random"):
        raise ValueError(f"init must be 'svd' or 'random', got {init!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    if init == "random" and not std > 0:
        raise ValueError(f"std must be positive, got {std!r}")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(n, target_modules)]
    if not targets:
        raise ValueError(f"target_modules {target_modules!r} match no nn.Linear of the model")
    too_small = [n for n, m in targets if rank > min(m.in_features, m.out_features)]
    if too_small:
        raise ValueError(f"rank {rank} exceeds min(in, out) of {too_small[:3]}{'...' if len(too_small) > 3 else ''}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    for name, linear in targets:
        low = LowRankLinear(
            linear.in_features,
            linear.out_features,
            rank,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        if init == "svd":
            low.init_svd(linear.weight)
        else:
            low.init_random(std, generator)
        if linear.bias is not None:
            low.up.bias.copy_(linear.bias)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, low)
    return model


@torch.no_grad()
def merge_low_rank(model: nn.Module) -> nn.Module:
    """Turn every ``LowRankLinear`` back into an ``nn.Linear`` with weight B A, in place, so the model saves
    and loads as its original architecture (``save_pretrained`` / ``from_pretrained``)."""
    lows = [(n, m) for n, m in model.named_modules() if isinstance(m, LowRankLinear)]
    for name, low in lows:
        w = low.up.weight
        dense = nn.Linear(
            low.in_features, low.out_features, bias=low.up.bias is not None, device=w.device, dtype=w.dtype
        )
        dense.weight.copy_((low.up.weight.float() @ low.down.weight.float()).to(w.dtype))
        if low.up.bias is not None:
            dense.bias.copy_(low.up.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, dense)
    return model


def freeze_projectable(model: nn.Module) -> list[str]:
    """Set ``requires_grad=False`` on every parameter ``slimopt.optim.algorithm.partition.classify`` calls projectable (the
    partition every slimopt method uses); return their names. Embeddings, norms, biases and the head stay
    trainable, so an optimizer over the trainable parameters trains exactly what is not a projectable weight."""
    from slimopt.optim.algorithm.partition import classify

    frozen = [name for name, (p, kind) in classify(model).items() if kind == "projectable"]
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    if not frozen:
        raise ValueError("frozen: the model has no projectable weights (nn.Linear weights outside the head) to "
                         "freeze, so the control would train the whole model")
    return frozen


# --------------------------------------------------------------------------------------------------------------
# Adaptor for the pretraining loop (slimopt.train.loop): `slimopt train --method lowrank | lora | relora | frozen`.

# The options ``prepare`` takes, for each of slimopt.catalog's "baseline" names (tests/test_build.py checks that the
# names agree; their descriptions and default lr are the catalogue's).
_OPTIONS = {
    "frozen": set(),
    "lowrank": {"rank", "init"},
    "lora": {"rank", "alpha", "dropout"},
    "relora": {"rank", "alpha", "dropout", "restart_every", "restart_warmup", "prune_ratio"},
}


def _check_method(method: str) -> None:
    names = catalog.of_kind("baseline")
    if method not in names:
        raise ValueError(f"unknown baseline {method!r}; choose one of: {', '.join(names)}")


class BaselineHook:
    """What a baseline needs from the training loop: ``after_step`` (ReLoRA restarts), ``state_dict`` /
    ``load_state_dict`` (exact resume) and ``export`` (a plain model to save)."""

    def __init__(self, method: str, model: nn.Module, *, seed: int = 0, restart_every: int = 0,
                 restart_warmup: int = 0, prune_ratio: float = 1.0) -> None:
        self.method, self.model, self.seed = method, model, seed
        self.restart_every, self.restart_warmup, self.prune_ratio = restart_every, restart_warmup, prune_ratio
        self.restarts = 0
        self.last_restart = 0

    def after_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Called once ``step`` optimizer steps are done and the scheduler has stepped."""
        if not self.restart_every:
            return
        if step % self.restart_every == 0:
            # Seeded by the restart index: every data-parallel rank draws the same new adapters.
            relora_restart(self.model, optimizer, prune_ratio=self.prune_ratio, seed=self.seed + 1000 + self.restarts)
            self.restarts += 1
            self.last_restart = step
        if self.restarts and step - self.last_restart < self.restart_warmup:
            # ReLoRA's jagged re-warmup on top of the loop's schedule: the scheduler (a LambdaLR) sets each
            # group's lr from scratch at every step, so scaling it here affects the next step only.
            ramp = (step - self.last_restart + 1) / (self.restart_warmup + 1)
            for group in optimizer.param_groups:
                group["lr"] *= ramp

    def state_dict(self) -> dict[str, int]:
        return {"restarts": self.restarts, "last_restart": self.last_restart}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.restarts, self.last_restart = int(state["restarts"]), int(state["last_restart"])

    def export(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` in its original architecture (adapters or factors merged into dense weights)."""
        import copy

        if self.method == "frozen":
            return model  # nothing was added to the architecture
        clone = copy.deepcopy(model)
        if self.method == "lowrank":
            return merge_low_rank(clone)
        return clone.merge_and_unload()


def prepare(model: nn.Module, method: str, *, seed: int = 0, **options: Any) -> tuple[nn.Module, BaselineHook]:
    """Transform a freshly initialised causal LM for a baseline; returns the model to train and its hook.

    ``frozen`` takes no options: it freezes the projectable weights (``freeze_projectable``).
    Options (all optional): ``rank`` (default hidden_size / 4, the rank-to-width ratio of GaLore's runs:
    128 at 60M, 512 at 1B); lowrank: ``init`` ("random", default, or "svd"); lora / relora: ``alpha`` (32),
    ``dropout`` (0); relora: ``restart_every`` (200 steps: short CPU runs; ReLoRA used 5,000),
    ``restart_warmup`` (re-warmup steps after a restart, 20; ReLoRA 50-100), ``prune_ratio`` (1.0: full reset).
    """
    _check_method(method)
    unknown = set(options) - _OPTIONS[method]
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for {method}; allowed: {sorted(_OPTIONS[method])}")
    if method == "frozen":
        freeze_projectable(model)
        return model, BaselineHook(method, model, seed=seed)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    rank = options.get("rank") or (max(1, hidden // 4) if hidden else None)
    if rank is None:
        raise ValueError(f"{method}: give rank (the model has no config.hidden_size to derive it from)")
    if method == "lowrank":
        std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
        model = apply_low_rank(model, int(rank), init=options.get("init", "random"), std=std, seed=seed)
        return model, BaselineHook(method, model, seed=seed)
    alpha, dropout = float(options.get("alpha", 32.0)), float(options.get("dropout", 0.0))
    model = apply_lora(model, int(rank), alpha, dropout, LLAMA_TARGETS, fully_trained=RELORA_FULLY_TRAINED)
    if method == "lora":
        return model, BaselineHook(method, model, seed=seed)
    restart_every = int(options.get("restart_every", 200))
    restart_warmup = int(options.get("restart_warmup", 20))
    if restart_every < 1 or not 0 <= restart_warmup < restart_every:
        raise ValueError(f"relora: need restart_every >= 1 and 0 <= restart_warmup < restart_every, got "
                         f"{restart_every}, {restart_warmup}")
    prune_ratio = float(options.get("prune_ratio", 1.0))
    if not 0.0 < prune_ratio <= 1.0:
        raise ValueError(f"relora: prune_ratio must be in (0, 1], got {prune_ratio}")
    hook = BaselineHook(method, model, seed=seed, restart_every=restart_every, restart_warmup=restart_warmup,
                        prune_ratio=prune_ratio)
    return model, hook


def build_optimizer(model: nn.Module, method: str, lr: float | None = None, weight_decay: float = 0.0,
                    **hp: Any) -> torch.optim.Optimizer:
    """torch AdamW over the trainable parameters, the optimizer of the papers' baseline runs; lr None: the
    baseline's default (``slimopt.catalog.default_lr``)."""
    _check_method(method)
    if hp:
        raise ValueError(
            f"{method}: build_optimizer takes no hyperparameters besides lr and weight_decay, got {sorted(hp)}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=catalog.default_lr(method) if lr is None else lr, weight_decay=weight_decay)
