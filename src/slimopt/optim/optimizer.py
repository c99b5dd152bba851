"""SlimOptimizer: one torch.optim.Optimizer in which GaLore, FRUGAL, BAdam, signSGD and AdamW are settings.

Per parameter and step (DESIGN.md section 2):

    g     = grad.float()
    if the projector is due: choose the subspace anew (and keep / reset / rotate the moments)
    low   = down(g)                  identity without a projector, empty at density 0
    resid = g - up(low)              what the state-free rule sees (FRUGAL), or dropped (GaLore)
    d     = rule(low, decode(moments)); encode(moments)
    u     = scale * up(d) + free_scale * free_rule(resid)
    p    *= 1 - lr * weight_decay;  p -= lr * u

Three independent axes compose per parameter group: the projector (``projectors.py``), the state-full rule
(``rules.py``) and the storage codec of the moments (``codecs.py``). Papers: GaLore (arXiv 2403.03507), FRUGAL
(arXiv 2411.07837), BAdam (arXiv 2404.02827).

State rules: ``optimizer.state`` holds tensors only, under torch's key names (``step``, ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) plus ``moment_step`` (the age of the moments, which restart at zero after a
reset), ``proj`` (an orthonormal basis) or ``proj_index`` (coordinates), so a
state_dict saved with torch.save loads with ``weights_only=True``. Random choices are pure functions of
(seed, parameter index, refresh index): nothing else to store, and every rank of a data-parallel run agrees.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import compiled
from . import kernel_plan
from . import multi_tensor
from . import muon
from . import portable
from . import projectors as P
from . import sharded
from . import taco
from . import windowed
from .codecs import make_codec, resolve_codecs
from .noise import CounterStream
from .rules import (ELEMENTWISE_RULES, FREE_RULES, MOMENTS, PARAM_ROUNDINGS, PARAM_STREAM, RULES, advance,
                    apply_update, comp_of, direction, rounding_of)

ON_REFRESH = ("keep", "reset", "project")
# Where Adam's eps enters: "torch" adds it to the bias-corrected sqrt(v_hat) (torch.optim.AdamW); "galore" adds it
# to sqrt(v) before the bias correction (galore-torch, transformers' old AdamW, the eps-hat form of Kingma & Ba,
# arXiv 1412.6980, section 2): the same as "torch" with eps / sqrt(1 - beta2^t), up to 32x larger early at 0.999.
EPS_PLACEMENTS = ("torch", "galore")

DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    eps_placement="torch",
    weight_decay=0.0,
    momentum=0.9,  # sgdm and muon (the muon recipes set 0.95, torch.optim.Muon's default)
    rule="adamw",
    projector="none",
    rank=None,
    density=None,
    update_gap=200,
    scale=1.0,
    proj_side="std",
    proj_dtype="fp32",
    on_refresh="keep",
    free_rule="none",
    free_scale=1.0,
    block_order="ascending",
    oversample=8,
    power_iters=2,
    seed=0,
    codec=None,
    m_codec=None,
    v_codec=None,
    state_bits=None,
    **taco.DEFAULTS,  # taco_k, taco_decay, taco_format, taco_scale_dtype, taco_norm, taco_alpha
    **muon.DEFAULTS,  # nesterov, ns_steps, ns_coefficients, ns_eps, ns_dtype, adjust_lr_fn
    compile=False,
    fused=True,
    param_rounding="nearest",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nonneg(name: str, value: Any) -> None:
    v = float(value)
    if not (v >= 0.0) or math.isinf(v):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def validate_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid setting of a parameter group and what is allowed."""
    for name in ("lr", "eps", "weight_decay", "scale", "free_scale"):
        _nonneg(name, group[name])
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not 0.0 <= float(group["momentum"]) <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {group['momentum']!r}")
    for name, allowed in (("rule", RULES), ("free_rule", FREE_RULES), ("projector", P.PROJECTORS),
                          ("on_refresh", ON_REFRESH), ("proj_side", P.PROJ_SIDES),
                          ("proj_dtype", P.PROJ_DTYPES),
                          ("eps_placement", EPS_PLACEMENTS), ("param_rounding", PARAM_ROUNDINGS),
                          ("block_order", P.BLOCK_ORDERS)):
        if group[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {group[name]!r}")
    rank, density = group["rank"], group["density"]
    if rank is not None and (not _is_int(rank) or rank <= 0):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if density is not None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    if rank is not None and density is not None:
        raise ValueError(f"give either rank or density, not both (rank={rank}, density={density})")
    if group["projector"] != "none" and rank is None and density is None:
        raise ValueError(f"projector={group['projector']!r} needs a subspace size: set rank (> 0) or density "
                         "(in [0, 1])")
    for name in ("update_gap",):
        if not _is_int(group[name]) or group[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {group[name]!r}")
    for name in ("oversample", "power_iters", "seed"):
        if not _is_int(group[name]) or group[name] < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {group[name]!r}")
    resolve_codecs(group["codec"], group["m_codec"], group["v_codec"], group["state_bits"])
    taco.validate(group)
    muon.validate(group)
    for name in ("compile", "fused"):
        if not isinstance(group[name], bool):
            raise ValueError(f"{name} must be True or False, got {group[name]!r}")


class SlimOptimizer(torch.optim.Optimizer):
    """A composable memory-lean optimizer; see the module docstring for the step.

    Every keyword of ``DEFAULTS`` is a per-group setting:

    - ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled, applied once in full space before the update),
      ``momentum`` (for ``rule="sgdm"`` and ``"muon"``).
    - ``eps_placement``: ``torch`` (m_hat / (sqrt(v_hat) + eps), torch.optim.AdamW) | ``galore``
      (m_hat / ((sqrt(v) + eps) / sqrt(1 - beta2^t)), galore-torch's and transformers' old AdamW's arithmetic).
    - ``rule``: the state-full rule, ``adamw`` | ``lion`` | ``sgdm`` | ``taco`` (2-D tensors: the one-sparse
      ternary step with a compact per-column history, set by the ``taco_*`` settings, see
      ``slimopt.optim.taco``; other tensors: AdamW with the group's codecs) | ``muon`` (2-D tensors only:
      the momentum orthogonalized by Newton-Schulz iterations, torch.optim.Muon's step; ``nesterov``,
      ``ns_steps``, ``ns_coefficients``, ``ns_eps``, ``ns_dtype``, ``adjust_lr_fn``, see ``slimopt.optim.muon``).
    - ``projector``: ``none`` | ``svd`` | ``randomized_svd`` | ``random`` | ``columns`` | ``rows`` | ``block``;
      ``rank`` or ``density`` sets the subspace size (for ``block``: how many tensors of the group are active);
      ``update_gap`` steps between refreshes; ``scale`` multiplies the state-full update (GaLore's alpha);
      ``proj_side`` ``std`` | ``reverse_std`` | ``left`` | ``right`` (galore-torch's proj_type);
      ``proj_dtype`` ``fp32`` | ``grad`` | ``auto`` (the matrix products of ``svd``, ``randomized_svd`` and
      ``random`` projections in fp32, or in a bf16 / fp16 gradient's own dtype as galore-torch does: several times
      faster, each projected value rounded to 16 bits; ``auto``: the latter where the device has 16-bit matrix
      units; ``projectors.matmul_dtype``);
      ``on_refresh`` ``keep`` (GaLore) | ``reset`` (FRUGAL) | ``project`` (rotate the moments, LDAdam);
      ``block_order`` ``ascending`` | ``descending`` | ``random``; ``oversample`` and ``power_iters`` for
      ``randomized_svd``; ``seed`` for every random choice.
    - ``free_rule``: what the residual outside the subspace gets: ``sign`` (FRUGAL), ``sgd`` or ``none``
      (GaLore; inactive BAdam blocks stay frozen); ``free_scale`` multiplies it.
    - ``codec`` / ``m_codec`` / ``v_codec`` / ``state_bits``: the storage format of the moments
      (see ``slimopt.optim.codecs``).
    - ``compile``: run full-space AdamW steps through a torch.compile'd kernel (``compiled.py``) that decodes,
      updates and encodes in one pass; hyperparameters enter as 0-D tensors, so schedules never recompile.
    - ``fused`` (default True): step the parameters whose update is a standard kernel all at once
      (``multi_tensor.py``: torch's fused AdamW for plain moments, foreach kernels for an inactive block's
      residual) and run every other element-wise update of a CPU weight (codec-stored moments, Lion, SGDM) through
      the one-pass C kernel (``native.py``), of a CUDA weight through one Triton launch for all the tensors of
      one size and setting (``triton_step.py``); False runs every parameter through the eager per-tensor step,
      the reference.
    - ``param_rounding``: how a bf16 weight is written, ``nearest`` | ``stochastic`` (unbiased, no memory) |
      ``kahan`` (a bf16 compensation per weight, state ``kahan_comp``); see ``rules.py``. fp32 weights are written
      exactly; fp16 weights take ``nearest`` only.

    An element-wise update (AdamW, Lion, SGDM in full space or on a block, and every state-free update) runs in
    windows of the flattened tensor (``windowed.py``): its temporaries stay under 64 MiB whatever the tensor. A
    subspace projector's step runs in windows of rows or columns between refreshes (``windowed.projected``): it
    holds the subspace gradient and direction, and a window.

    Parameters that are not 2-D take the rule on the full gradient under a subspace projector; ``block`` works for
    any shape.

    Example::

        >>> import torch, slimopt
        >>> w = torch.nn.Parameter(torch.randn(64, 32))
        >>> opt = slimopt.SlimOptimizer([w], lr=1e-2, projector="svd", rank=4, free_rule="sign")
        >>> w.grad = torch.randn(64, 32)
        >>> opt.step()
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], **settings: Any) -> None:
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}; allowed: {', '.join(DEFAULTS)}")
        self._fresh_caches()
        super().__init__(params, {**DEFAULTS, **settings})

    def _fresh_caches(self) -> None:
        """What the optimizer derives from its groups and state and keeps between steps (none of it is saved)."""
        self._warned: set[str] = set()
        self._where: dict[Tensor, tuple[int, int, int]] = {}
        self._codecs: dict[tuple, Any] = {}
        self._codec_lists: dict[tuple, list[tuple[str, Any]]] = {}
        self._blocks: dict[tuple, frozenset[int]] = {}
        self._plans: dict[Tensor, kernel_plan.Plan] = {}  # weights whose kernel step is prepared (kernel_plan.py)
        self._batch = multi_tensor.Batch()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled optimizer (torch.optim.Optimizer keeps its defaults, state and groups) derives its
        caches anew, as a new one does."""
        super().__setstate__(state)
        self._fresh_caches()
        self._index_params()

    # ------------------------------------------------------------------------------------------------------------
    # groups and positions

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            validate_group(group)
            if group["param_rounding"] != "nearest" and any(p.dtype == torch.float16 for p in group["params"]):
                raise ValueError(f"param_rounding={group['param_rounding']!r} rounds bf16 weights; this group holds "
                                 "fp16 ones: use 'nearest', or bf16 weights")
        except ValueError:
            self.param_groups.pop()
            raise
        self._index_params()

    def _index_params(self) -> None:
        where, k = {}, 0
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                where[p] = (gi, pi, k)
                k += 1
        self._where = where

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------------------------
    # stepping

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group)
            self._batch.run()  # the parameters _update queued for a multi-tensor kernel
        finally:
            self._batch = multi_tensor.Batch()  # nothing queued survives a failed step
        return loss

    @torch.no_grad()
    def step_param(self, p: Tensor) -> None:
        """Update one parameter from its .grad (for optimizer-in-backward use); a None grad is skipped."""
        if p.grad is not None:
            try:
                self._update(p, self.param_groups[self._where[p][0]])
                self._batch.run()
            finally:
                self._batch = multi_tensor.Batch()

    def _codec(self, spec: str, role: str, numel: int, dtype: torch.dtype):
        key = (spec, role, numel, dtype)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = make_codec(spec, role, numel, dtype)
        return codec

    def _moment_codecs(self, group: dict[str, Any], shape: torch.Size, dtype: torch.dtype) -> list[tuple[str, Any]]:
        """The rule's (state key, codec) list for a `shape` tensor of `dtype`: asked a few times a tensor a step,
        so kept by what decides it (the list is shared: read it, do not change it)."""
        key = (group["rule"], group["codec"], group["m_codec"], group["v_codec"], group["state_bits"], tuple(shape),
               dtype)
        codecs = self._codec_lists.get(key)
        if codecs is None:
            m_spec, v_spec = resolve_codecs(group["codec"], group["m_codec"], group["v_codec"], group["state_bits"])
            numel = math.prod(shape)
            codecs = self._codec_lists[key] = [(k, self._codec(m_spec if role == "m" else v_spec, role, numel, dtype))
                                               for k, role in MOMENTS[group["rule"]]]
        return codecs

    def _init_moments(self, state: dict[str, Tensor], codecs, shape: torch.Size, device) -> None:
        """Zero moments; ``moment_step`` counts the rule's updates since then, for Adam's bias correction (a
        reset or newly active block starts from zero moments, and must not be corrected as if it were old)."""
        for key, codec in codecs:
            state.update(codec.init(key, shape, device))
        state["moment_step"] = torch.zeros((), dtype=torch.float32)

    def _count_moment_step(self, state: dict[str, Tensor], codecs, shape: torch.Size, device) -> int:
        """Before a state-full update: zero moments where there are none yet, and count this update in their age
        (returned)."""
        if codecs[0][0] not in state:
            self._init_moments(state, codecs, shape, device)
        return advance(state["moment_step"])

    def _layout(self, p: Tensor, group: dict[str, Any]) -> str:
        projector = group["projector"]
        if projector in ("none", "block") or p.dim() == 2:
            return projector
        return "none"

    def _block_turn(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], step: int,
                    fresh_moments: Callable[[], None]) -> bool:
        """Whether p's block is active at `step` (FRUGAL, BAdam), with its state brought in line: an inactive block
        holds nothing but its ``step`` (that is the memory FRUGAL saves); an active one restarts its moments at a
        refresh under ``on_refresh="reset"``, by ``fresh_moments()`` (shaped by the caller: the whole tensor, or
        this rank's shard) or TACO's reset."""
        if not self._block_active(p, group, step):
            for key in [k for k in state if k != "step"]:
                del state[key]
            return False
        if P.refresh_due(step, group["update_gap"]) and step > 1 and group["on_refresh"] == "reset":
            if taco.owns(group, p.shape):
                taco.reset(state)
            else:
                fresh_moments()
        return True

    def _block_active(self, p: Tensor, group: dict[str, Any], step: int) -> bool:
        gi, pi, _ = self._where[p]
        n = len(group["params"])
        idx = P.refresh_index(step, group["update_gap"])
        density = group["density"] if group["rank"] is None else min(1.0, group["rank"] / n)
        key = (gi, n, idx, density, group["block_order"], group["seed"])
        active = self._blocks.get(key)
        if active is None:
            if len(self._blocks) > 64:
                self._blocks.clear()
            active = self._blocks[key] = frozenset(
                P.active_blocks(n, density, idx, group["block_order"], group["seed"]))
        return pi in active

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("slimopt does not support sparse gradients (use a dense embedding)")
        if sharded.is_sharded(p):  # an FSDP2 (DTensor) parameter: stepped on its local shard, see sharded.py
            sharded.update(self, p, group)
            return
        if grad.is_complex() or p.is_complex():
            raise RuntimeError("slimopt does not support complex parameters or gradients")
        state = self.state[p]
        plan = self._plans.get(p)
        if plan is not None and not plan.matches(p, grad, group, state):
            del self._plans[p]  # planned for something else: the general path, which plans again
        elif plan is not None and plan.replays:
            step = advance(state["step"])
            stream = self._streams(p, group, step) if plan.needs_stream else None
            plan.run(p, grad, state, group, advance(state["moment_step"]) if plan.ages else 0, self._batch, stream)
            return
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        step = advance(state["step"])  # a CPU tensor, as in torch.optim: no device sync
        layout = self._layout(p, group)
        if layout == "block":
            def fresh() -> None:
                self._init_moments(state, self._moment_codecs(group, grad.shape, p.dtype), grad.shape, p.device)

            active = self._block_turn(p, group, state, step, fresh)
            if not active and multi_tensor.residual_applies(group, p, grad):
                self._batch.residual(group, p, grad)
                return
        if layout == "none" or (layout == "block" and active):
            if self._queue_adamw(p, group, state, grad) or self._windowed(p, group, state, grad, step, layout, True):
                return
        elif self._windowed(p, group, state, grad, step, layout, False) or (
                layout != "block" and self._projected(p, group, state, grad, step, layout)):
            return
        if layout == "none" and group["fused"] and taco.owns(group, p.shape) and grad.shape == p.shape:
            # one entry a column to write, not a dense pass; the gradient read in row windows
            if taco.one_pass_step(p, grad, state, group, self._batch):
                if p not in self._plans:  # on CUDA the steps after replay the kernels' route (kernel_plan)
                    self._plans[p] = kernel_plan.build_taco(p, grad, state, group)
                return
            rows, signs, c = taco.sparse_update(state, grad, group, p.shape)
            rounding = rounding_of(group, p)
            taco.apply_sparse(p, rows, signs, c, group, comp_of(state, p, rounding),
                              self._param_stream(p, group, step, rounding))
            return
        g = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()  # compute in fp32 (or fp64)

        full = None  # the state-full update in full space, before lr
        coef = 0.0
        resid = None  # the residual for the state-free rule
        if layout == "none":
            if self._fused(p, group, state, g):
                return
            full, coef = self._stateful(p, group, state, g, step)
        elif layout == "block":
            if active:
                full, coef = self._stateful(p, group, state, g, step)
            else:
                resid = g
        else:  # a subspace of rank 0 whose tensors the windows do not take (not contiguous): all state-free
            resid = g

        rounding = rounding_of(group, p)
        apply_update(p, full, coef, resid, group, comp_of(state, p, rounding),
                     self._param_stream(p, group, step, rounding))

    def _streams(self, p: Tensor, group: dict[str, Any], step: int) -> Callable[[int, int], CounterStream]:
        """stream(i, start): the random stream of p's moment i (or of its stochastic rounding, ``PARAM_STREAM``) at
        `step`, read from element `start` on."""
        index = self._where[p][2]

        def stream(i: int, start: int) -> CounterStream:
            return P.stream(group["seed"], index, step, i).at(start)

        return stream

    def _param_stream(self, p: Tensor, group: dict[str, Any], step: int, rounding: str) -> CounterStream | None:
        """The random stream of p's stochastic rounding at `step` (None unless it rounds stochastically)."""
        if rounding != "stochastic":
            return None
        return P.stream(group["seed"], self._where[p][2], step, PARAM_STREAM)

    def _queue_adamw(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], grad: Tensor) -> bool:
        """Queue p's full-space update for torch's fused AdamW (multi_tensor.py) where that is its arithmetic."""
        if taco.owns(group, p.shape):
            return False
        codecs = self._moment_codecs(group, grad.shape, p.dtype)
        if not multi_tensor.adamw_applies(group, p, grad, codecs):
            return False
        self._count_moment_step(state, codecs, grad.shape, p.device)
        self._batch.adamw(group, p, grad, state)
        return True

    def _windowed(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], grad: Tensor, step: int,
                  layout: str, stateful: bool) -> bool:
        """The element-wise update in windows (windowed.py) where it applies: an element-wise rule in full space or
        on an active block (stateful), or the state-free update of an inactive block or of a subspace of rank 0."""
        if not (p.is_contiguous() and grad.is_contiguous() and grad.shape == p.shape):
            return False
        if stateful:
            if group["rule"] not in ELEMENTWISE_RULES and not (group["rule"] == "taco" and not taco.owns(group,
                                                                                                           p.shape)):
                return False
            if layout == "none" and group["compile"] and group["rule"] == "adamw":
                return False  # the compiled step (_fused), where it applies
            codecs = self._moment_codecs(group, p.shape, p.dtype)
            age = self._count_moment_step(state, codecs, p.shape, p.device)
        else:
            if layout != "block":  # a subspace projector: state-free only at rank 0
                side = P.side_for(p.shape, group["proj_side"]) if layout in P.ORTHO_PROJECTORS else None
                if P.subspace_rank(p.shape, layout, side, group["rank"], group["density"]) != 0:
                    return False
            if group["free_rule"] == "none":
                return True  # nothing moves (an inactive BAdam block)
            codecs, age = [], 0
        stream = self._streams(p, group, step)

        windowed.step(p, grad, state, group, codecs, age, stream, self._batch)
        if stateful and layout == "none" and p not in self._plans:
            # the next steps replay the kernel's arguments where nothing changes (or, unplanned, ask no more)
            self._plans[p] = kernel_plan.build(p, grad, state, group, codecs)
        return True

    def _fused(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], g: Tensor) -> bool:
        """The torch.compile'd full-space AdamW step (compiled.py), where the group asks for it and it applies."""
        if not group["compile"] or group["rule"] != "adamw" or rounding_of(group, p) != "nearest":
            return False
        codecs = self._moment_codecs(group, g.shape, p.dtype)
        if not compiled.supported(codecs):
            return False
        self._count_moment_step(state, codecs, g.shape, p.device)
        compiled.adamw_step(p, g, state, codecs, group, int(state["moment_step"].item()))
        return True

    def _stateful(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], g: Tensor,
                  step: int) -> tuple[Tensor, float]:
        """Run the rule on g (the full or projected gradient, fp32) against codec-stored moments."""
        if taco.owns(group, g.shape):  # TACO keeps its own compact per-column state (taco.py)
            return taco.update(state, g, group, p.shape if p.dim() == 2 else g.shape)
        codecs = self._moment_codecs(group, g.shape, p.dtype)
        self._count_moment_step(state, codecs, g.shape, p.device)
        age = int(state["moment_step"].item())
        mom = {key: codec.decode(key, state, g.shape) for key, codec in codecs}
        d, c = direction(group["rule"], g, mom, age, group, shape=p.shape)
        _, _, index = self._where[p]
        for i, (key, codec) in enumerate(codecs):
            gen = P.stream(group["seed"], index, step, i) if codec.needs_generator else None
            codec.encode(key, mom[key], state, generator=gen)
        return d, c

    def _projected(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], grad: Tensor, step: int,
                   projector: str) -> bool:
        """The step of a subspace projector on the 2-D weight p (False: a subspace of rank 0, left to the caller).

        Between refreshes it runs in windows of slices of the weight (``windowed.projected``), so that it
        allocates the subspace's size and a window, not the tensor's. A refresh is the exception: the decomposition
        (or the random draw's QR) needs the whole gradient in fp32, and allocates its own workspace on top; the
        step that follows it is windowed again."""
        side = P.side_for(grad.shape, group["proj_side"]) if projector in P.ORTHO_PROJECTORS else None
        r = P.subspace_rank(grad.shape, projector, side, group["rank"], group["density"])
        if r == 0:  # density 0: everything is state-free
            return False
        key = "proj" if projector in P.ORTHO_PROJECTORS else "proj_index"
        if key not in state or P.refresh_due(step, group["update_gap"]):
            g = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()
            self._refresh(p, group, state, g, step, projector, side, r, key)
            del g
        basis = state[key]
        # A subspace that spans the whole side leaves an exactly zero residual: computing it would leave
        # rounding noise, which sign() would blow up to a full step.
        rank = basis.shape[1] if projector in P.ORTHO_PROJECTORS else basis.numel()
        whole = rank == (grad.shape[0] if side == "left" or projector == "rows" else grad.shape[1])
        residual = group["free_rule"] != "none" and not whole
        stream = self._streams(p, group, step)

        shape = state_shape(projector, side, grad.shape, rank)
        codecs, age, whole_rule = [], 0, None
        if group["rule"] in ELEMENTWISE_RULES:
            codecs = self._moment_codecs(group, shape, p.dtype)
            self._count_moment_step(state, codecs, shape, p.device)
            age = int(state["moment_step"].item())
        else:  # Muon's iteration and TACO's column search need the whole subspace matrix (small)
            def whole_rule(low: Tensor) -> tuple[Tensor, float]:
                return self._stateful(p, group, state, low, step)
        windowed.projected(p, grad, basis, projector, side, residual, state, group, codecs, age, stream,
                           float(group["scale"]), whole_rule)
        if whole_rule is None and p not in self._plans:  # the steps to the next refresh replay the kernels' arguments
            self._plans[p] = kernel_plan.build_projected(p, grad, state, group, projector, side, key, residual, codecs)
        return True

    def _refresh(self, p: Tensor, group: dict[str, Any], state: dict[str, Tensor], g: Tensor, step: int,
                 projector: str, side: str | None, r: int, key: str) -> None:
        """Choose the subspace anew; on failure keep the previous one (or fall back to a random basis)."""
        _, _, index = self._where[p]
        gen = P.generator(p.device, group["seed"], index, P.refresh_index(step, group["update_gap"]))
        old = state.get(key)
        new = None
        if projector in ("svd", "randomized_svd"):
            if not bool(torch.isfinite(g).all()):
                self._warn_once("nonfinite", "slimopt: a non-finite gradient reached a subspace refresh; keeping "
                                "the previous subspace (warned once)")
            else:
                try:
                    if projector == "svd":
                        new = P.svd_basis(g, r, side)
                    else:
                        new = P.randomized_basis(g, r, side, gen, group["oversample"], group["power_iters"])
                    if not bool(torch.isfinite(new).all()):
                        raise RuntimeError("the decomposition returned non-finite values")
                except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
                    new = None
                    self._warn_once("svd", f"slimopt: the subspace decomposition failed ({err}); keeping the "
                                    "previous subspace (warned once)")
            if new is None and old is None:
                new = P.random_basis(g.shape[0] if side == "left" else g.shape[1], r, gen, g.device, g.dtype)
        elif projector == "random":
            new = P.random_basis(g.shape[0] if side == "left" else g.shape[1], r, gen, g.device, g.dtype)
        else:
            new = P.random_coordinates(g.shape[1] if projector == "columns" else g.shape[0], r, gen, g.device)
        if new is None:
            return
        if projector in P.ORTHO_PROJECTORS and p.dtype in (torch.bfloat16, torch.float16):
            new = new.to(p.dtype)  # stored like the weights, as galore-torch does; used in fp32
        if old is not None:
            shape = state_shape(projector, side, g.shape, r)
            codecs = self._moment_codecs(group, shape, p.dtype)
            if taco.owns(group, shape):
                if group["on_refresh"] != "keep":
                    taco.reset(state)  # sparse (row, value) pairs cannot be rotated into a new subspace
            elif codecs[0][0] in state and group["on_refresh"] == "reset":
                self._init_moments(state, codecs, shape, p.device)
            elif codecs[0][0] in state and group["on_refresh"] == "project":
                for i, (key_m, codec) in enumerate(codecs):
                    # rotate the codec's best estimate; a carried error-feedback residual is in the old basis
                    m = codec.estimate(key_m, state, shape)
                    m = P.rotate(projector, side, old, new, m, squared=self._role(group, key_m) == "v")
                    codec.clear_feedback(key_m, state)
                    gen = P.stream(group["seed"], index, step, i, 1) if codec.needs_generator else None
                    codec.encode(key_m, m.contiguous(), state, generator=gen)
        state[key] = new

    @staticmethod
    def _role(group: dict[str, Any], key: str) -> str:
        return dict(MOMENTS[group["rule"]])[key]

    # ------------------------------------------------------------------------------------------------------------
    # state dict

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; for DTensor (FSDP2) parameters, or inside ``portable.portable_state(self)``, the
        world-size-free form that ``torch.distributed.checkpoint`` saves and reshards (``portable.py``)."""
        state_dict = super().state_dict()
        return portable.to_portable(self, state_dict) if portable.wanted(self) else state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer.load_state_dict (its checks, its hooks in their order, state that names no
        parameter kept as it is), but every state tensor keeps its saved dtype.

        torch casts floating state to the parameter's dtype (and even uint8 codes of a floating parameter), which
        would turn 8-bit codes into floats and fp32 scales into bf16. State tensors only move to the parameter's
        device; the counters ``step`` and ``moment_step`` become 0-D fp32 tensors on the CPU, from a tensor or from
        a Python number (which torch.optim loads too: older and hand-edited checkpoints). A group saved before a
        setting existed gets its default (the arithmetic it was saved with; e.g. ``eps_placement="torch"``).

        torch.optim's AdamW (or Adam without weight decay) loads too, as torch.optim's optimizers of one algorithm
        load each other's: its moments continue, and a torch setting SlimOptimizer does not compute (``amsgrad``,
        ``maximize``, Adam's L2 ``weight_decay``) is refused naming it (``_loaded_group``). Every loaded group is
        checked as a new group is, before anything is loaded.
        """
        loaded: dict[str, Any] = {}

        def take_state(optimizer, sd: dict[str, Any]) -> dict[str, Any]:
            # The last pre-hook: it sees what the user's pre-hooks left, and hands torch the groups only, so that
            # torch's cast never touches the state.
            loaded.update(sd)
            groups = sd["param_groups"]
            if len(groups) == len(self.param_groups):  # otherwise torch refuses the state dict itself
                groups = [_loaded_group(ours, g, i) for i, (ours, g) in enumerate(zip(self.param_groups, groups))]
            return {**sd, "param_groups": groups, "state": {}}

        def put_state(optimizer) -> None:
            # The first post-hook: the user's post-hooks see the loaded state, as they do with torch's optimizers.
            self._load_state(loaded)

        pre = self.register_load_state_dict_pre_hook(take_state)
        post = self.register_load_state_dict_post_hook(put_state, prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        """Put the saved per-parameter state into ``self.state`` (the groups are loaded already): torch's form, or
        the portable one of a DCP / resharding checkpoint (``portable.py``)."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        in_portable_form = portable.is_portable(state_dict)
        for i, values in state_dict["state"].items():
            p = params.get(i)
            if p is None:
                self.state[i] = values  # torch keeps state that names no parameter as it is
                continue
            values = portable.saved_state(values, f"state of parameter {i}")
            if "moment_step" not in values and "step" in values and not _MOMENT_KEYS.isdisjoint(values):
                # torch.optim's moments never restart, so their age is the parameter's step
                values["moment_step"] = values["step"].clone()
            if in_portable_form:
                self.state[p] = portable.import_param(self, p, self.param_groups[self._where[p][0]], values)
            else:
                self.state[p] = {k: v if k in portable.COUNTERS else v.detach().to(p.device, copy=True)
                                 for k, v in values.items()}


_MOMENT_KEYS = frozenset(key for keys in MOMENTS.values() for key, _ in keys)


def _loaded_group(ours: dict[str, Any], saved: dict[str, Any], index: int) -> dict[str, Any]:
    """The saved parameter group `saved` as it loads into the group `ours`: slimopt's settings over the defaults,
    refused with a ValueError naming the key where SlimOptimizer would not compute what the saver did."""
    where = f"parameter group {index} of the state dict"
    for key in ("amsgrad", "maximize"):  # torch.optim's AdamW settings with no slimopt arithmetic
        if saved.get(key):
            raise ValueError(f"{where}: {key}={saved[key]!r} (torch.optim) is an arithmetic SlimOptimizer does not "
                             f"implement; it loads only state saved with {key}=False")
    if saved.get("decoupled_weight_decay") is False and float(saved.get("weight_decay", 0.0)) != 0.0:
        raise ValueError(f"{where}: decoupled_weight_decay=False with weight_decay={saved['weight_decay']!r} is "
                         "torch.optim.Adam's L2 decay (added to the gradient); SlimOptimizer decays the weights "
                         "themselves, as torch.optim.AdamW does: it loads AdamW's state, or Adam's with weight_decay=0")
    group = {k: v for k, v in {**DEFAULTS, **saved}.items() if k != "state_layout"}
    for key, value in saved.items():
        # torch.optim saves None for a setting it picks itself (fused, foreach); where None is no value of
        # slimopt's setting, this optimizer's own value stays
        if value is None and key in DEFAULTS and not _valid({**ours, key: None}):
            group[key] = ours[key]
    try:
        validate_group({**group, "params": ours["params"]})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return group


def _valid(group: dict[str, Any]) -> bool:
    try:
        validate_group(group)
    except ValueError:
        return False
    return True


def state_shape(projector: str, side: str | None, shape: torch.Size, r: int) -> torch.Size:
    """The shape of the subspace moments for a (m, n) parameter."""
    m, n = shape
    if projector in P.ORTHO_PROJECTORS:
        return torch.Size((r, n) if side == "left" else (m, r))
    return torch.Size((m, r) if projector == "columns" else (r, n))
