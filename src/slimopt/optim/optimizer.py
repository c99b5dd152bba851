"""SlimOptimizer: one torch.optim.Optimizer in which GaLore, FRUGAL, TACO, Muon, BAdam, signSGD and AdamW are
settings.

Per parameter and step (docs/design.md, section 2):

    g     = grad.float()
    if the projector is due: choose the subspace anew (and keep / reset / rotate the moments)
    low   = down(g)                  identity without a projector, empty at density 0
    resid = g - up(low)              what the state-free rule sees (FRUGAL), or dropped (GaLore)
    d     = rule(low, decode(moments)); encode(moments)
    u     = scale * up(d) + free_scale * free_rule(resid)
    p    *= 1 - lr * weight_decay;  p -= lr * u

Details: docs/modules.md, ``slimopt.optim.optimizer``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from slimopt.optim import statedict
from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.codecs import make_codec
from slimopt.optim.distributed import portable
from slimopt.optim.distributed.sharded import Space, moment_codecs
from slimopt.optim.routes import paramstep
from slimopt.optim.settings import DEFAULTS, EPS_PLACEMENTS, ON_REFRESH, validate_group  # noqa: F401

__all__ = ["SlimOptimizer", "DEFAULTS", "validate_group"]


class SlimOptimizer(torch.optim.Optimizer):
    """A composable memory-lean optimizer (the module docstring); every keyword of ``settings.DEFAULTS`` is a
    per-group setting, described in ``slimopt.optim.settings``.

    Parameters that are not 2-D take the rule on the full gradient under a subspace projector; ``block`` works for
    any shape. ``explain(p)`` says which route a parameter's last step took and why each faster one declined.

    Example::

        >>> import torch, slimopt
        >>> w = torch.nn.Parameter(torch.randn(64, 32))
        >>> opt = slimopt.SlimOptimizer([w], lr=1e-2, projector="svd", rank=4, free_rule="sign")
        >>> w.grad = torch.randn(64, 32)
        >>> opt.step()
        >>> opt.explain(w)[0]
        'projected'
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
        self._where_map: dict[Tensor, tuple[int, int, int]] | None = None  # ``_where``; None until first needed
        self._indexed: tuple[int, ...] | None = None  # the ids of the groups' parameters it was made for
        self._codecs: dict[tuple, Any] = {}
        self._codec_lists: dict[tuple, list[tuple[str, Any]]] = {}
        self._blocks: dict[tuple, frozenset[int]] = {}
        self._geometry: dict[Tensor, tuple] = {}  # each parameter's rows and index (sharded.target_of)
        self._routes: dict[Tensor, paramstep.Route] = {}  # each parameter's route and what it keeps (paramstep.py)
        self._phases: dict[tuple, dict[int, int]] = {}  # staggered refreshes' phases (subspace.refresh_phase)
        self._batch = paramstep.Batch()
        self._later: list = []  # all-reduces the last step left running (``settle``)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy or an unpickled optimizer (torch.optim.Optimizer keeps its defaults, state and groups) derives its
        caches anew, as a new one does."""
        super().__setstate__(state)
        self._fresh_caches()

    # ------------------------------------------------------------------------------------------------------------
    # groups and positions

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        indexed = self._indexed is not None
        if indexed:
            self._follow_params()  # a switch before the new group would otherwise go unseen, its state left behind
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
        if indexed:
            self._index_params()

    @property
    def _where(self) -> dict[Tensor, tuple[int, int, int]]:
        """Each parameter's (group, place in the group, position over all groups), made when first needed (a step,
        ``state_dict``): until then the optimizer keeps no reference to its parameters beyond its groups, so one
        whose parameters are switched before its first step (accelerate's FSDP2 ``prepare``) does not keep the
        unsharded model alive."""
        if self._where_map is None:
            self._follow_params()
        return self._where_map

    def _index_params(self) -> None:
        where, k = {}, 0
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                where[p] = (gi, pi, k)
                k += 1
        self._where_map = where
        self._indexed = self._param_ids()
        self._geometry.clear()

    def _param_ids(self) -> tuple[int, ...]:
        # ~8 us for 300 parameters. An id cannot be reused while the optimizer keeps the parameter it was taken
        # from (``_where`` holds every indexed one), so an unchanged tuple means unchanged parameters.
        return tuple([id(p) for group in self.param_groups for p in group["params"]])

    def _follow_params(self) -> None:
        """Follow parameters switched in place in the groups (accelerate's FSDP2 ``prepare`` puts the sharded
        parameters in the groups of an optimizer built on the plain model, as torch.optim allows): the caches are
        derived anew and each state moves to the parameter that took its place (``_switch_params``). Checked at
        each step and ``state_dict``."""
        if self._param_ids() != self._indexed:
            self._switch_params()

    def _switch_params(self) -> None:
        """Derive every cache for the groups' parameters now, and move the state of each parameter that left the
        groups to the one that took its position, as torch's load_state_dict maps saved state by position: as it
        is to a tensor of the same kind, else through the checkpoints' world-size-free form
        (``portable.move_state``), so a plain tensor's state becomes its FSDP2 shard's. A parameter still in the
        groups keeps its own state; state that finds no place of the same shape is dropped, with a warning."""
        self.settle()  # a running sum writes into the state it was started for
        before = {k: p for p, (_, _, k) in (self._where_map or {}).items()}
        self._index_params()
        self._routes.clear()
        self._phases.clear()
        self.__dict__.pop("_slimopt_ranks_agree", None)  # new shards: the ranks check their agreement again
        where = self._where_map
        dropped = []
        for k, p in enumerate(p for group in self.param_groups for p in group["params"]):
            old = before.get(k)
            if old is None or old is p or old in where or self.state.get(p) or not self.state.get(old):
                continue
            values = self.state.pop(old)
            if old.shape != p.shape:
                dropped.append(f"position {k}: {tuple(old.shape)} -> {tuple(p.shape)}")
                continue
            self.state[p] = portable.move_state(self, old, p, self.param_groups[where[p][0]], values)
        for old in [q for q in self.state if isinstance(q, Tensor) and q not in where]:
            if self.state.pop(old):
                dropped.append(f"a {tuple(old.shape)} parameter no longer in the groups")
        if dropped:
            warnings.warn("slimopt: the optimizer's parameters were switched and the state of "
                          f"{len(dropped)} parameter(s) has no place to go; it is dropped and they start afresh "
                          f"({'; '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''})", RuntimeWarning,
                          stacklevel=4)

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
        self.settle()
        self._follow_params()
        try:
            self._batch.taco_records = paramstep.prefetch_taco(self)
            self._batch.bases = paramstep.prefetch_bases(self)
            for group in self.param_groups:
                settings = paramstep.group_key(group)
                for p in group["params"]:
                    if p.grad is not None:
                        paramstep.step(self, p, group, settings)
            self._batch.run()  # what the routes queued for multi-tensor kernels and Triton launches
        finally:
            self._end_batch()
        return loss

    @torch.no_grad()
    def step_param(self, p: Tensor, grad: Tensor | None = None) -> None:
        """Update one parameter from its .grad (for optimizer-in-backward use); a None grad is skipped. grad: the
        gradient to step with instead of p.grad, for a caller that keeps it off the parameter (a worker thread
        must not set or drop a parameter's .grad while the backward pass runs: docs/offload.md)."""
        grad = p.grad if grad is None else grad
        if grad is not None:
            self.settle()
            if p not in self._where:  # only then: a full check at every parameter would cost O(n^2) a step
                self._follow_params()
            try:
                paramstep.step(self, p, self.param_groups[self._where[p][0]], grad=grad)
                self._batch.run()
            finally:
                self._end_batch()

    def _end_batch(self) -> None:
        self._later += self._batch.later  # started: finished by the next step or state read
        self._batch = paramstep.Batch()  # nothing queued survives a failed step

    def settle(self) -> None:
        """Finish what the last step left running: under FSDP2, a factored second moment's column sums, summed over
        the ranks while the next forward and backward run (only the next step reads their means). ``step``,
        ``state_dict`` and ``load_state_dict`` settle first; call it before reading ``opt.state`` yourself."""
        later, self._later = self._later, []
        self._batch.hold_columns(paramstep.Batch.finish_reduces(later))  # what this step's windows decode with

    def explain(self, p: Tensor) -> tuple[str, dict[str, str]] | None:
        """(the route p's last step took, {each faster route of its work: why it declined}); None before it."""
        return paramstep.explain(self, p)

    # ------------------------------------------------------------------------------------------------------------
    # what a parameter's step reads: its moments' codecs, its layout, its block's turn

    def _codec(self, spec: str, role: str, numel: int, dtype: torch.dtype):
        key = (spec, role, numel, dtype)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = make_codec(spec, role, numel, dtype)
        return codec

    def _moment_codecs(self, group: dict[str, Any], shape: torch.Size, dtype: torch.dtype) -> list[tuple[str, Any]]:
        """The rule's (state key, codec) list for a whole `shape` tensor of `dtype` (the planner's question)."""
        return moment_codecs(self, group, Space(torch.Size(shape), None), dtype)

    def _layout(self, p: Tensor, group: dict[str, Any]) -> str:
        """The projector p's step takes: the group's, but ``none`` for a tensor a subspace projector does not take
        (not 2-D)."""
        projector = group["projector"]
        if projector in ("none", "block") or p.dim() == 2:
            return projector
        return "none"

    def _block_active(self, p: Tensor, group: dict[str, Any], step: int) -> bool:
        """Whether p's block is state-full at `step` (FRUGAL, BAdam): a pure function of the group's seed, order and
        the refresh index (``projectors.active_blocks``), kept per refresh."""
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

    # ------------------------------------------------------------------------------------------------------------
    # state dict

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict; for DTensor (FSDP2) parameters, or inside ``portable.portable_state(self)``, the
        world-size-free form that ``torch.distributed.checkpoint`` saves and reshards (``portable.py``)."""
        self.settle()
        self._follow_params()  # torch's state_dict finds state by the groups' parameters
        state_dict = super().state_dict()
        return portable.to_portable(self, state_dict) if portable.wanted(self) else state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch.optim.Optimizer.load_state_dict, but every state tensor keeps its saved dtype
        (``statedict.load`` says what loads and what is refused)."""
        self.settle()  # a sum still running would write over the loaded state
        self._routes.clear()  # new groups and state tensors: every parameter chooses its route anew
        statedict.load(self, state_dict, super().load_state_dict)
