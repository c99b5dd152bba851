"""The memory planner: what a training step of a model needs, per method, before anything is allocated.

For a model config (a LLaMA size name or a local Hugging Face config.json, read offline), a method (every slimopt
method and the peers) and a dtype, the model is built on the meta device and its parameters enumerated: weights,
gradients, the exact optimizer state (sized with the optimizer's own helpers, equal to ``slimopt.state_nbytes``),
projections, activations for B x T tokens, the peak of a step and the largest batch that fits a budget. With
``weight_format="int8"`` and ``offload="host"`` it plans int8 device weights with the master copy and the state on
the host (device, host and PCIe bytes). How each part is counted, the peak's formula and the offload plan:
docs/modules.md, section slimopt.bench.planner.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from slimopt.bench.activations import ActivationEstimate, activation_bytes, check_vocab_slice
from slimopt.factory import OFFLOADS, WEIGHT_FORMATS
from slimopt.optim.algorithm import int8_weight
from slimopt.weights.convert import embedding_modules, int8_weights

__all__ = [
    "DTYPES",
    "GALORE_7B",
    "PLANNING_SIZES",
    "size_names",
    "ParamState",
    "MemoryPlan",
    "load_config",
    "meta_model",
    "planner_methods",
    "state_plan",
    "Prepared",
    "prepare",
    "plan",
    "plan_many",
    "max_batch",
    "MASTERS",
    "GRADS_IN_FLIGHT",
    "int8_nbytes",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COUNTER = 4  # ``step`` and ``moment_step``: fp32 0-D tensors (optimizer.py)

# Weight formats on the device and where the master copy and the optimizer state live (module docstring,
# "Weights below bf16 and host offload").
MASTERS = {"fp32": 4, "bf16+int8": 3, "bf16": 2}  # bytes per parameter of the host's master copy
INT8_SCALE_BYTES = 4  # one fp32 scale per row (or per group of a row) of an int8 weight
GRADS_IN_FLIGHT = 2  # gradient buffers on the device with host offload: one being written, one leaving
REQUANT_PER_ELEMENT = 9  # device-only int8 step: fp32 dequantized weight, fp32 rounding noise, the new int8 weight

# The setting of GaLore's Figure 1 / section 5.5 (arXiv 2403.03507): LLaMA-7B, bf16, a token batch of 256,
# no activation checkpointing; 8-bit GaLore at rank 1024 with per-layer weight updates.
GALORE_7B = dict(dtype="bf16", batch=1, seq=256)

# Sizes to plan, beyond the ones `slimopt train` builds (``models.LLAMA_SIZES``): name -> (label, shape), from each
# model's published config.json (untied head; vocabulary 32000 unless the shape gives its own). Fewer key/value heads
# than attention heads is grouped-query attention: k_proj and v_proj are (kv_heads * head_dim) x hidden, 1024 x 4096
# at LLaMA-3-8B, 1024 x 8192 at 34B and 70B.
PLANNING_SIZES: dict[str, tuple[str, dict[str, int]]] = {
    "8b": ("llama-3-8b", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8)),
    "13b": ("llama-2-13b", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=40)),
    "34b": ("codellama-34b", dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48,
                                  num_attention_heads=64, num_key_value_heads=8)),
    "70b": ("llama-2-70b", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8)),
}


@dataclass(frozen=True)
class ParamState:
    """Optimizer-state bytes of one parameter: moments (codec tensors, counters, maps) and projections."""

    name: str
    group: str
    shape: tuple[int, ...]
    layout: str
    moments: int
    projections: int
    scratch: int = 0  # estimated temporaries while this parameter is updated
    batched: int = 0  # what a step that updates it with others allocates at once (Muon's queue), if more

    @property
    def total(self) -> int:
        return self.moments + self.projections


@dataclass
class MemoryPlan:
    """One method's memory for one model, batch and dtype, in bytes (see the module docstring)."""

    model: str
    method: str
    dtype: str
    params: int
    trainable: int
    weights: int
    grads: int
    state: int  # moments, counters and maps
    projections: int
    activations: int
    loss_grad: int
    scratch: int
    peak: int
    batch: int
    seq: int
    layerwise: bool
    checkpointing: bool
    step: int | None
    activation_formula: str
    activations_exact: bool
    peak_parts: dict[str, int] = field(default_factory=dict)  # what is alive at the peak; sums to `peak`
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    weight_format: str = "dtype"  # "dtype" | "int8": the weights on the device
    offload: str = "none"  # "none" | "host": master copy and optimizer state in pinned host memory
    master: str | None = None  # the host's master copy with offload="host": fp32 | bf16+int8 | bf16
    host: int = 0  # host bytes: sums `host_parts`
    host_parts: dict[str, int] = field(default_factory=dict)
    pcie: int = 0  # bytes over PCIe per optimizer step, both ways: sums `pcie_parts`
    pcie_parts: dict[str, int] = field(default_factory=dict)

    @property
    def device(self) -> int:
        """The device's peak (``peak``; ``peak_parts`` are its parts)."""
        return self.peak

    @property
    def optimizer_state(self) -> int:
        """Everything in ``optimizer.state``: what ``slimopt.state_nbytes`` measures."""
        return self.state + self.projections

    @property
    def state_bytes_per_param(self) -> float:
        return self.optimizer_state / max(1, self.trainable)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["optimizer_state"] = self.optimizer_state
        out["state_bytes_per_param"] = self.state_bytes_per_param
        return out


# ----------------------------------------------------------------------------------------------------------------
# models


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def size_names() -> list[str]:
    """Every LLaMA size name ``load_config`` knows, smallest first."""
    from slimopt.models.llama import LLAMA_SIZES

    return [*LLAMA_SIZES, *PLANNING_SIZES]


def load_config(model: str, vocab_size: int | None = None):
    """(label, transformers config) of a LLaMA size name, ``smollm2-135m`` or a local folder with a config.json
    (read offline)."""
    import transformers

    from slimopt.models.llama import DEFAULT_VOCAB_SIZE, LLAMA_SIZES, llama_config

    sizes = ", ".join(size_names())
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a LLaMA size ({sizes}) or a folder with a config.json; got {model!r}")
    if model.lower() in LLAMA_SIZES:
        # rotary positions have no parameters: the sequence length only matters for activations
        return f"llama-{model.lower()}", llama_config(model, vocab_size=vocab_size, seq_len=4096)
    from slimopt.models.smollm2 import SMOLLM2, smollm2_config

    if model.lower() == SMOLLM2:  # its architecture is known: planned without the model file
        config = smollm2_config()
        if vocab_size is not None:
            config.vocab_size = int(vocab_size)
        return SMOLLM2, config
    if model.lower() in PLANNING_SIZES:
        label, shape = PLANNING_SIZES[model.lower()]
        shape = {"vocab_size": DEFAULT_VOCAB_SIZE, **shape}
        if vocab_size is not None:
            shape["vocab_size"] = int(vocab_size)
        return label, transformers.LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False,
                                               use_cache=False, **shape)
    path = Path(model).expanduser()
    cfg_file = path / "config.json" if path.is_dir() else path
    if cfg_file.name == "config.json" and cfg_file.is_file():
        try:
            config = transformers.AutoConfig.from_pretrained(str(cfg_file.parent), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot read the model config {str(cfg_file)!r}: {err}") from err
        if vocab_size is not None:
            config.vocab_size = int(vocab_size)
        return getattr(config, "_name_or_path", None) or path.name or str(path), config
    raise ValueError(f"unknown model {model!r}: not a LLaMA size ({sizes}) and not a folder holding a config.json")


def meta_model(config, dtype: str = "bf16") -> nn.Module:
    """The model of `config` on the meta device: real shapes and dtypes, no memory."""
    import transformers

    torch_dtype = _dtype(dtype)
    errors = []
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=torch_dtype)
            return model.to(torch_dtype)
        except (ValueError, KeyError) as err:  # the config has no class of this auto kind
            errors.append(f"{auto.__name__}: {err}")
    raise ValueError(f"cannot build model_type={getattr(config, 'model_type', None)!r} from its config: "
                     + "; ".join(errors))


def int8_nbytes(shape: tuple[int, ...], group: int = 0) -> tuple[int, int]:
    """(data, scales) bytes of a weight of `shape` in symmetric int8 (``optim/algorithm/int8_weight.py``): one int8
    per element and one fp32 scale per row (group=0) or per group of `group` consecutive elements of a row (the
    last group of a row may be short)."""
    shape = tuple(shape)
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    return rows * cols, rows * int8_weight.group_count(cols, group) * INT8_SCALE_BYTES


def _has_lm_head(model: nn.Module) -> bool:
    return embedding_modules(model)[0] is not None


def _body_trains(model: nn.Module) -> bool:
    """Whether a weight of the model's body (``base_model_prefix``: the embeddings and decoder layers of a
    transformers model) trains; when none does, its forward pass saves nothing for a backward pass (a classifier
    whose head alone trains: ``slimopt finetune``'s control)."""
    prefix = getattr(model, "base_model_prefix", "")
    body = getattr(model, prefix, None) if prefix else None
    return not isinstance(body, nn.Module) or any(p.requires_grad for p in body.parameters())


# ----------------------------------------------------------------------------------------------------------------
# optimizer state


def planner_methods() -> list[str]:
    """Every method the planner sizes: slimopt's, then the peers with a state formula."""
    import slimopt
    from slimopt.bench.peer_state import PEER_FORMULAS

    return list(slimopt.methods()) + list(PEER_FORMULAS)


def _slim_moments(opt, p: torch.Tensor, group: dict, shape: torch.Size) -> int:
    """Bytes of the state-full rule's state for a moment of `shape` (full or projected), as ``reference.stateful``
    creates it: TACO's compact per-column state, or the codec tensors plus ``moment_step``."""
    from slimopt.optim.algorithm import taco

    if taco.owns(group, shape):
        return taco.state_nbytes(shape, group["taco_k"], group["taco_format"], group["taco_scale_dtype"], step=False)
    return sum(codec.nbytes(shape) for _, codec in opt._moment_codecs(group, shape, p.dtype)) + _COUNTER


def _scratch_bytes(step_kind: str, p: torch.Tensor, group: dict, align: int | None = None) -> int:
    """What one parameter's update allocates (``windowed.SCRATCH_PER_ELEMENT``): per element of a window for the
    windowed kinds (align: the codecs' alignment), per element of the tensor for the others."""
    from slimopt.optim.algorithm.rules import rounding_of
    from slimopt.optim.routes import windowed

    per = windowed.scratch_per_element(step_kind, p.dtype, rounding_of(group, p))
    n = p.numel() if align is None else windowed.window_elems(p.numel(), align, per)
    return per * n


def _muon_scratch(p: torch.Tensor, group: dict, codecs) -> int:
    """Muon's step of a whole 2-D weight (``muon.scratch_bytes``): the iteration's dtype is the device's (a meta
    model is planned as the GPU runs it: bf16 under ns_dtype="auto")."""
    from slimopt.optim.algorithm import muon

    device = torch.device("cuda") if p.device.type == "meta" else p.device
    return muon.scratch_bytes(p.shape, p.dtype, muon.iteration_dtype(group["ns_dtype"], device),
                              codecs[0][1].scratch_kind)


def _queued_muon(opt, base: list[tuple]) -> dict[int, int]:
    """Muon's queued step (``routes.torch.muon_batch``) iterates several matrices at once in an ordinary step (one
    at a time in a layer-wise one): {id of each queued weight: its queue's peak scratch}, the waiting iterates and the
    largest same-shape stack (``muon_batch.peak_bytes``)."""
    from slimopt.optim.routes.torch import muon_batch

    matrices = muon_batch.queued_matrices(opt, 1)
    params = {opt._where[p][2]: p for p in opt._where}
    out: dict[int, int] = {}
    for key in {m[0] for m in matrices}:
        mine = [m for m in matrices if m[0] == key]
        # same-shape matrices iterate as one stack on a GPU (a meta model is planned as one), one by one on a CPU
        stacked = params[mine[0][1]].device.type in ("cuda", "meta")
        own = {opt._where[p][2]: scratch for p, *_, scratch in base}
        peak = muon_batch.peak_bytes(mine, stacked=stacked, own=own)
        out.update({id(params[i]): peak for _, i, _, _ in mine})
    return out


def _align(codecs, shape) -> int:
    return math.lcm(1, *(codec.align(shape) for _, codec in codecs))


def _slim_param(opt, p: torch.Tensor, group: dict) -> tuple[str, int, int, int]:
    """(layout, moment bytes when the parameter holds moments, projection bytes, update scratch), as the step
    creates them."""
    from slimopt.optim.algorithm import projectors as P
    from slimopt.optim.algorithm import taco
    from slimopt.optim.algorithm.projectors import subspace_shape as state_shape
    from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES, rounding_of
    from slimopt.optim.routes import taco_routes, windowed
    from slimopt.optim.routes.cpu import native
    from slimopt.optim.routes.torch import multi_tensor

    layout = opt._layout(p, group)
    if layout in ("none", "block"):
        never = layout == "block" and (group["rank"] == 0 or (group["rank"] is None and group["density"] == 0))
        codecs = opt._moment_codecs(group, p.shape, p.dtype)
        free_in_kernel = native.kernel_applies(group, p.dtype, p.device.type, [])  # the state-free update
        if never:
            scratch = 0 if free_in_kernel else _scratch_bytes("state_free", p, group, 1)
        elif taco.owns(group, p.shape):
            scratch = (taco_routes.scratch_bytes(p.shape, group, p.dtype, p.device.type) if group["fused"]
                       else _scratch_bytes("taco", p, group))
        elif group["rule"] in ELEMENTWISE_RULES or group["rule"] == "taco":  # windowed.py
            scratch = _scratch_bytes(windowed.kind(codecs, group["rule"]), p, group, _align(codecs, p.shape))
            one_pass = native.scratch_per_element(codecs)
            if one_pass is not None and native.kernel_applies(group, p.dtype, p.device.type, codecs):
                scratch = one_pass * scratch // max(1, windowed.scratch_per_element(
                    windowed.kind(codecs, group["rule"]), p.dtype, rounding_of(group, p)))  # the same windows
        elif group["rule"] == "muon":
            scratch = _muon_scratch(p, group, codecs)
        else:
            scratch = _scratch_bytes("plain", p, group)
        if not never and not taco.owns(group, p.shape) and multi_tensor.adamw_kernel_applies(
                group, p.dtype, p.device.type, codecs):
            scratch = 0  # torch's fused AdamW updates in place
        if layout == "block" and multi_tensor.residual_kernel_applies(group, p.dtype, p.device.type):
            # an inactive block's sign() temporary; the active step's own scratch when it has one
            scratch = max(0 if never else scratch, multi_tensor.residual_scratch_bytes(group, p))
        elif layout == "block" and not never and not free_in_kernel:
            scratch = max(scratch, _scratch_bytes("state_free", p, group, 1))  # its turns without moments
        return layout, _slim_moments(opt, p, group, p.shape), 0, scratch
    side = P.side_for(p.shape, group["proj_side"]) if layout in P.ORTHO_PROJECTORS else None
    r = P.subspace_rank(p.shape, layout, side, group["rank"], group["density"])
    if r == 0:  # density 0: everything state-free, nothing stored but the step counter
        return layout, 0, 0, _scratch_bytes("state_free", p, group, 1)
    shape = state_shape(layout, side, p.shape, r)
    copy = 0  # a basis stored narrower than the step's work dtype is used through a copy in it
    if layout in P.ORTHO_PROJECTORS:
        dim = p.shape[0] if side == "left" else p.shape[1]
        # the basis is computed in fp32 (fp64 for fp64 weights) and stored in the weights' dtype when narrower
        dtype = p.dtype if p.dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32
        proj = dim * r * torch.empty((), dtype=dtype, device="meta").element_size()
        device = torch.device("cuda") if p.device.type == "meta" else p.device  # as muon's scratch: planned for a GPU
        narrow = dtype in (torch.bfloat16, torch.float16) and P.matmul_dtype(group["proj_dtype"], p.dtype,
                                                                              device) != dtype
        copy = dim * r * 4 if narrow else 0
    else:
        proj = r * 8  # int64 coordinates
    return layout, _slim_moments(opt, p, group, shape), proj, _projected_scratch(opt, p, group, layout, side, r,
                                                                                 shape, copy)


def _projected_scratch(opt, p: torch.Tensor, group: dict, layout: str, side: str | None, r: int,
                       shape: torch.Size, copy: int) -> int:
    """A projected step between refreshes (``windowed.projected_scratch``): the subspace gradient, the direction
    and the basis's work copy held, plus the larger of the rule's window and the lifting's window; a rule that
    needs the whole subspace matrix (Muon, TACO) on all of it. A refresh step's decomposition is not in it."""
    from slimopt.optim.algorithm import muon, taco
    from slimopt.optim.algorithm import projectors as P
    from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES, rounding_of
    from slimopt.optim.routes import windowed

    whole = r == (p.shape[0] if side == "left" or layout == "rows" else p.shape[1])
    free = "none" if whole else group["free_rule"]
    low = math.prod(shape)
    codecs = opt._moment_codecs(group, shape, p.dtype)
    if group["rule"] in ELEMENTWISE_RULES:
        rule: tuple[str, int] | int = (windowed.kind(codecs, group["rule"]), _align(codecs, shape))
    elif taco.owns(group, shape):  # the dense TACO step on the subspace gradient
        rule = windowed.scratch_per_element("taco", p.dtype) * low
    else:  # muon: the iteration on the (fp32) subspace gradient, and the direction it returns
        device = torch.device("cuda") if p.device.type == "meta" else p.device
        rule = muon.scratch_bytes(shape, torch.float32, muon.iteration_dtype(group["ns_dtype"], device),
                                  codecs[0][1].scratch_kind) + 4 * low
    return windowed.projected_scratch(tuple(p.shape), p.dtype, low, P.window_axis(layout, side), copy, free,
                                      rounding_of(group, p), rule)


def _block_steps(opt, group: dict) -> list[int]:
    """Steps that start each refresh period of one period of a block group's schedule."""
    n = len(group["params"])
    gap = group["update_gap"]
    active0 = sum(opt._block_active(p, group, 1) for p in group["params"])
    if active0 == 0:
        return [1]
    period = n // math.gcd(n, active0)
    return [idx * gap + 1 for idx in range(period)]


def _compensation(p: torch.Tensor, group: dict) -> int:
    """Bytes of the weight's Kahan compensation (``param_rounding="kahan"``, bf16 weights): p's size in bf16. Counted
    for every weight, as after a step that wrote each (a frozen BAdam block gets its own at its first turn)."""
    from slimopt.optim.algorithm.rules import rounding_of

    return p.numel() * p.element_size() if rounding_of(group, p) == "kahan" else 0


def _slim_state(model: nn.Module, method: str, step: int | None, hparams: dict[str, Any]) -> list[ParamState]:
    from slimopt.factory import make_optimizer

    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an integer >= 0 (the state after that many steps) or None (the "
                         f"schedule's maximum); got {step!r}")
    opt = make_optimizer(model, method, **hparams)  # what `slimopt train` and `slimopt bench` build
    names = {id(p): n for n, p in model.named_parameters()}
    base = [(p, group, *_slim_param(opt, p, group)) for group in opt.param_groups for p in group["params"]]
    batched = _queued_muon(opt, base)

    def states(active) -> list[ParamState]:
        """active(p, group) -> bool: whether a block-layout parameter holds its moments."""
        return [ParamState(names[id(p)], group.get("name", ""), tuple(p.shape), layout,
                           _COUNTER + _compensation(p, group) + (mom if layout != "block" or active(p, group) else 0),
                           proj, scratch, batched.get(id(p), 0))
                for p, group, layout, mom, proj, scratch in base]

    if step == 0:
        return [ParamState(names[id(p)], g.get("name", ""), tuple(p.shape), lay, 0, 0, x, batched.get(id(p), 0))
                for p, g, lay, _, _, x in base]
    if step is not None:
        return states(lambda p, g: opt._block_active(p, g, step))
    blocks = [g for g in opt.param_groups if any(item[2] == "block" for item in base if item[1] is g)]
    if not blocks:
        return states(lambda p, g: True)
    if any(g["block_order"] == "random" for g in blocks):
        # no period to walk: the k largest blocks of each group, which one draw can pick together
        chosen: set[int] = set()
        for g in blocks:
            k = sum(opt._block_active(p, g, 1) for p in g["params"])
            ranked = sorted((item for item in base if item[1] is g), key=lambda item: -item[3])
            chosen.update(id(item[0]) for item in ranked[:k])
        return states(lambda p, g: id(p) in chosen)
    candidates = sorted({s for g in blocks for s in _block_steps(opt, g)})
    return max((states(lambda p, g, s=s: opt._block_active(p, g, s)) for s in candidates),
               key=lambda st: sum(x.total for x in st))


def state_plan(model: nn.Module, method: str, step: int | None = None, **hparams: Any) -> list[ParamState]:
    """Per-parameter optimizer state of `method` over `model` (real or meta parameters).

    step: None for the block schedule's maximum, or the state right after that optimizer step (see the module
    docstring). hparams: method settings, as ``slimopt train --opt`` passes them (rank, density, codec, ...); for
    the galore-torch peers ``rank`` and ``proj_type``.
    """
    import slimopt
    from slimopt.bench.peer_state import PEER_FORMULAS, peer_state

    if method in slimopt.methods():
        return _slim_state(model, method, step, hparams)
    if method in PEER_FORMULAS:
        if step == 0:
            return []
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return [ParamState(s.name, "projected" if s.projections else "", shapes.get(s.name, ()), "peer",
                           s.moments, s.projections, s.scratch) for s in peer_state(model, method, **hparams)]
    raise ValueError(f"unknown method {method!r}; the planner knows: {', '.join(planner_methods())}")


# ----------------------------------------------------------------------------------------------------------------
# the whole step


@dataclass
class Prepared:
    """A model and one method's per-parameter state, sized once; ``plan`` and ``max_batch`` then cost only
    arithmetic, for any batch."""

    net: nn.Module
    config: Any
    label: str
    method: str
    dtype: str
    states: list[ParamState]
    step: int | None
    weight_format: str = "dtype"
    offload: str = "none"
    master: str | None = None
    int8_group: int = 0
    int8_embeddings: bool = False
    grads_in_flight: int = GRADS_IN_FLIGHT
    vocab_slice: int = 0

    def plan(self, batch: int = 0, seq: int = 0, layerwise: bool = False, checkpointing: bool = False
             ) -> MemoryPlan:
        return _assemble(self, batch, seq, layerwise, checkpointing)

    def max_batch(self, budget: int, seq: int, layerwise: bool = False, checkpointing: bool = False,
                  limit: int = 1 << 20) -> int:
        """The largest batch of `seq`-token sequences whose planned peak fits in `budget` bytes (0 if none,
        `limit` if even that fits): the peak grows with the batch, so doubling then bisection finds it."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise ValueError(f"seq must be an integer >= 1, got {seq!r}")

        def fits(b: int) -> bool:
            return _assemble(self, b, seq, layerwise, checkpointing).peak <= budget

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi <= limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi > limit:
            return limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def _module_dtype(model: nn.Module) -> str:
    """The dtype name of a built model's first floating-point parameter (bf16 when it has none we know)."""
    names = {v: k for k, v in DTYPES.items()}
    for p in model.parameters():
        if p.is_floating_point():
            return names.get(p.dtype, "bf16")
    return "bf16"


def _placement(weight_format: str, offload: str, master: str | None, int8_group: int, int8_embeddings: bool,
               grads_in_flight: int) -> str | None:
    """Checks the weight-format and offload settings; returns the master copy (None without offload)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)} (dtype: every weight in the "
                         f"model's dtype); got {weight_format!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if master is not None and master not in MASTERS:
        raise ValueError(f"master must be one of {', '.join(MASTERS)}; got {master!r}")
    if master is not None and offload != "host":
        raise ValueError(f"master={master!r} needs offload='host' (without offload there is no master copy)")
    int8_nbytes((1, 1), int8_group)  # checks int8_group
    if int8_embeddings and weight_format != "int8":
        raise ValueError("int8_embeddings needs weight_format='int8'")
    if isinstance(grads_in_flight, bool) or not isinstance(grads_in_flight, int) or grads_in_flight < 1:
        raise ValueError(f"grads_in_flight must be an integer >= 1; got {grads_in_flight!r}")
    return (master or "fp32") if offload == "host" else None


def _state_net(net: nn.Module, config, dtype: str, master: str | None) -> nn.Module:
    """The model the optimizer state is sized on: `net`, or with a host master copy a meta twin in the dtype the
    optimizer steps (bf16 for a bf16 master, fp32 for fp32 and bf16+int8, which is stepped as the fp32 value it
    holds: ``weights.masters.joined_master``)."""
    want = None if master is None else ("bf16" if master == "bf16" else "fp32")
    if want is None or want == dtype:
        return net
    import copy

    twin = copy.deepcopy(net)  # a meta model costs nothing to copy; a real one is copied, then dropped to meta
    return twin.to(device="meta", dtype=_dtype(want))


def prepare(model: str | nn.Module, method: str, *, dtype: str | None = None, step: int | None = None,
            vocab_size: int | None = None, label: str | None = None, config=None, weight_format: str = "dtype",
            offload: str = "none", master: str | None = None, int8_group: int = 0, int8_embeddings: bool = False,
            grads_in_flight: int = GRADS_IN_FLIGHT, vocab_slice: int = 0, **hparams: Any) -> Prepared:
    """Build `model` on the meta device (unless given a module) and size `method`'s optimizer state on it.

    model: a LLaMA size name, a folder with a config.json, or a model already built (meta or real; its
    ``config`` attribute, or `config`, serves the activation estimate). dtype: the activations' dtype and, for a
    model built here, the weights', bf16 | fp16 | fp32; default: a given module's own dtype (a fp32 model planned
    with bf16 activations would be planned short), else bf16. step: see ``state_plan``. vocab_size: overrides the
    config's. weight_format, offload, master, int8_group, int8_embeddings, grads_in_flight: the weights' format on
    the device and the host offload (docs/modules.md, "Weights below bf16 and host offload"). vocab_slice: the
    loss a vocabulary slice of this many rows at a time (0: the whole logits). hparams: method settings (rank,
    density, codec, ...).
    """
    master = _placement(weight_format, offload, master, int8_group, int8_embeddings, grads_in_flight)
    if dtype is None:
        dtype = _module_dtype(model) if isinstance(model, nn.Module) else "bf16"
    _dtype(dtype)
    if isinstance(model, nn.Module):
        net, config = model, config if config is not None else getattr(model, "config", None)
        label = label or type(model).__name__
    else:
        label, config = load_config(model, vocab_size)
        net = meta_model(config, dtype)
    states = state_plan(_state_net(net, config, dtype, master), method, step=step, **hparams)
    check_vocab_slice(vocab_slice)
    return Prepared(net, config, label, method, dtype, states, step, weight_format, offload, master, int8_group,
                    int8_embeddings, grads_in_flight, vocab_slice)


def plan(model: str | nn.Module, method: str, *, dtype: str | None = None, batch: int = 0, seq: int = 0,
         layerwise: bool = False, checkpointing: bool = False, step: int | None = None,
         vocab_size: int | None = None, label: str | None = None, config=None, **hparams: Any) -> MemoryPlan:
    """The memory of one training step of `method` on `model` (keywords as ``prepare``, weight_format and offload
    included).

    batch, seq: the token block per step (0 leaves activations out). layerwise: gradients freed as each parameter
    steps inside the backward pass. checkpointing: one activation checkpoint per decoder layer.
    """
    prep = prepare(model, method, dtype=dtype, step=step, vocab_size=vocab_size, label=label, config=config,
                   **hparams)
    return prep.plan(batch, seq, layerwise, checkpointing)


def max_batch(model: str | nn.Module, method: str, budget: int, seq: int, *, dtype: str | None = None,
              layerwise: bool = False, checkpointing: bool = False, step: int | None = None,
              vocab_size: int | None = None, config=None, limit: int = 1 << 20, **hparams: Any) -> int:
    """The largest batch of `seq`-token sequences whose planned peak fits in `budget` bytes; 0 if none does.
    Keywords as for ``plan``; see ``Prepared.max_batch``."""
    prep = prepare(model, method, dtype=dtype, step=step, vocab_size=vocab_size, config=config, **hparams)
    return prep.max_batch(budget, seq, layerwise, checkpointing, limit)


def plan_many(model: str, methods: Iterable[str], **kw: Any) -> list[MemoryPlan]:
    """``plan`` for several methods on one model config (read once)."""
    dtype = kw.pop("dtype", "bf16")
    label, config = load_config(model, kw.pop("vocab_size", None))
    # a fresh meta model per method: an optimizer must not see another's parameters (cheap: no memory)
    return [plan(meta_model(config, dtype), m, dtype=dtype, config=config, label=label, **kw) for m in methods]


def _assemble(prep: Prepared, batch: int, seq: int, layerwise: bool, checkpointing: bool) -> MemoryPlan:
    net = prep.net
    params = list({id(p): p for p in net.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    int8 = {id(p) for _, p in int8_weights(net, prep.int8_embeddings)} if prep.weight_format == "int8" else set()

    def on_device(p: torch.Tensor) -> int:
        """A weight's bytes in its device format: int8 data and scales, or the model's dtype."""
        return sum(int8_nbytes(tuple(p.shape), prep.int8_group)) if id(p) in int8 else p.numel() * p.element_size()

    weights = sum(on_device(p) for p in params)
    weights += sum(b.numel() * b.element_size() for b in net.buffers())
    grad_sizes = [p.numel() * p.element_size() for p in trainable]  # in the compute dtype, int8 weights too
    largest_grad = max(grad_sizes, default=0)
    grads = largest_grad if layerwise else sum(grad_sizes)
    moments = sum(s.moments for s in prep.states)
    projections = sum(s.projections for s in prep.states)
    if batch and seq:
        if prep.config is None:
            raise ValueError("activations need the model's config: pass config= or leave batch/seq at 0")
        elem = 4 if prep.dtype == "fp32" else 2
        act = activation_bytes(prep.config, batch, seq, elem, checkpointing, _has_lm_head(net), _body_trains(net),
                               prep.vocab_slice)
    else:
        act = ActivationEstimate(saved=0, loss_grad=0, head=0, recompute=0, exact=True,
                                 formula="no activations (batch or seq not given)")
    # an int8 weight is dequantized to the compute dtype for its matmul: the largest such copy, while layers run
    dequant = max((p.numel() * p.element_size() for p in params if id(p) in int8), default=0)
    host = prep.offload == "host"
    by_name = {name: p for name, p in net.named_parameters()}
    # the device-only int8 step also dequantizes the weight it updates and rounds it back (REQUANT_PER_ELEMENT)
    requant = {s.name: REQUANT_PER_ELEMENT * by_name[s.name].numel()
               for s in prep.states if s.name in by_name and id(by_name[s.name]) in int8}
    states = [s if not requant.get(s.name) else
              ParamState(s.name, s.group, s.shape, s.layout, s.moments, s.projections,
                         s.scratch + requant[s.name], s.batched)
              for s in prep.states]
    scratch = _scratch(prep.method, states)
    sizes = {name: p.numel() * p.element_size() for name, p in net.named_parameters()}
    # layer-wise: a parameter's gradient and its update's scratch exist together, one parameter at a time
    worst = max(((sizes.get(s.name, 0), s.scratch) for s in states), key=sum, default=(largest_grad, 0))
    a_after_loss = act.saved - act.head  # the loss and head's backward has run: their activations are gone
    host_parts: dict[str, int] = {}
    pcie_parts: dict[str, int] = {}
    if host:
        layers_grads, end = _grads_in_flight(prep, net, trainable, int8)
        grads = max(layers_grads, end or 0)
        held = {"weights": weights, "optimizer state": 0, "projections": 0}
        phases = [
            {"gradients": 0, "activations": act.saved, "temporaries": act.loss_grad},  # start of the backward pass
            {"gradients": layers_grads, "activations": a_after_loss + act.recompute, "temporaries": dequant},
        ]
        if end is not None:  # the input embedding's gradient: the last, once the layers' activations are gone
            phases.append({"gradients": end, "activations": 0, "temporaries": 0})
        trained_numel = sum(p.numel() for p in trainable)
        back = sum(on_device(p) for p in trainable)
        # the device's weights are written from a pinned copy in their format, unless the master is that copy
        # (bf16 master, bf16 weights: torchao's CPUOffloadOptimizer)
        same = not int8 and prep.master == prep.dtype
        # a bf16+int8 master is stepped as fp32, one weight at a time: that weight joined (weights/masters.py)
        joined = 4 * max((p.numel() for p in trainable), default=0) if prep.master == "bf16+int8" else 0
        host_parts = {"master": MASTERS[prep.master] * trained_numel, "optimizer state": moments,
                      "projections": projections, "pinned gradients": sum(grad_sizes),
                      "pinned weights": 0 if same else back, "step temporaries": scratch + joined}
        pcie_parts = {"gradients out": sum(grad_sizes), "weights back": back}
    else:
        held = {"weights": weights, "optimizer state": moments, "projections": projections}
        phases = [  # what is alive besides `held` at each candidate peak
            {"gradients": 0, "activations": act.saved, "temporaries": act.loss_grad},  # start of the backward pass
            {"gradients": 0, "activations": a_after_loss + act.recompute, "temporaries": dequant},  # a layer's
        ]
        if layerwise:
            phases.append({"gradients": worst[0], "activations": a_after_loss, "temporaries": worst[1]})
        else:
            phases.append({"gradients": grads, "activations": 0, "temporaries": scratch})  # the optimizer step
    phase = max(phases, key=lambda ph: sum(ph.values()))
    peak_parts = {**held, **phase}
    groups: dict[str, dict[str, int]] = {}
    for s in prep.states:
        g = groups.setdefault(s.group or "all", {"params": 0, "numel": 0, "state": 0, "projections": 0})
        g["params"] += 1
        g["numel"] += math.prod(s.shape) if s.shape else 0
        g["state"] += s.moments
        g["projections"] += s.projections
    return MemoryPlan(model=prep.label, method=prep.method, dtype=prep.dtype, params=sum(p.numel() for p in params),
                      trainable=sum(p.numel() for p in trainable), weights=weights, grads=grads, state=moments,
                      projections=projections, activations=act.saved, loss_grad=act.loss_grad, scratch=scratch,
                      peak=sum(peak_parts.values()), batch=batch, seq=seq, layerwise=layerwise and not host,
                      checkpointing=checkpointing, step=prep.step, activation_formula=act.formula,
                      activations_exact=act.exact, peak_parts=peak_parts, groups=groups,
                      weight_format=prep.weight_format, offload=prep.offload, master=prep.master,
                      host=sum(host_parts.values()), host_parts=host_parts, pcie=sum(pcie_parts.values()),
                      pcie_parts=pcie_parts)


def _grads_in_flight(prep: Prepared, net: nn.Module, trainable: list[torch.Tensor],
                     int8: set[int]) -> tuple[int, int | None]:
    """With host offload, the device's gradient bytes on their way out: (the most while the layers run backward,
    the most while the input embedding's leaves, or None without one). The backward pass makes them output side
    first, ``grads_in_flight`` at a time; the output layer's is one vocabulary slice where the loss takes it so
    (weights/row_grads.py); the input embedding's comes last, after every layer's."""
    k = prep.grads_in_flight
    head, embedding = (getattr(m, "weight", None) for m in embedding_modules(net))
    sliced = prep.vocab_slice and head is not None and head is not embedding and id(head) not in int8

    def in_flight(p: torch.Tensor) -> int:
        rows = p.shape[0] if p.dim() else 1
        return (min(prep.vocab_slice, rows) if sliced and p is head else rows) * (p.numel() // max(1, rows)) * \
            p.element_size()

    last = embedding if embedding is not None and embedding is not head and embedding.requires_grad else None
    order = [in_flight(p) for p in trainable if p is not last][::-1]
    layers = max((sum(order[i:i + k]) for i in range(max(1, len(order) - k + 1))), default=0)
    if last is None:
        return layers, None
    return layers, in_flight(last) + (sum(order[len(order) - (k - 1):]) if k > 1 else 0)


def _scratch(method: str, states: list[ParamState]) -> int:
    """The optimizer step's temporaries: the largest one parameter's update allocates, or all parameters' at once
    for torch's foreach AdamW (estimates; see ``windowed.SCRATCH_PER_ELEMENT`` and ``peer_state.SCRATCH_PER_ELEMENT``)."""
    from slimopt.bench.peer_state import ALL_AT_ONCE

    if method in ALL_AT_ONCE:
        return sum(s.scratch for s in states)
    return max((max(s.scratch, s.batched) for s in states), default=0)
