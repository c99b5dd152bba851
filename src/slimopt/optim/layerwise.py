"""Optimizer-in-backward ("layer-wise") updates: each parameter steps as soon as its gradient is complete.

In an ordinary loop every gradient lives until ``optimizer.step()``: for full fine-tuning that is one more copy of
the model at the peak. Here a ``register_post_accumulate_grad_hook`` on every parameter calls
``optimizer.step_param(p)`` the moment autograd has finished accumulating p's gradient, and frees ``p.grad`` right
after, so at most the gradients of the layers still in flight are alive at once (LOMO, Lv et al.,
arXiv 2306.09782, and TACO, arXiv 2610.02199, run their updates this way). Updating a weight in place after its
``AccumulateGrad`` is safe: autograd runs that node only once every use of the weight has produced its gradient.

Details: docs/modules.md, ``slimopt.optim.layerwise``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["CLIP_MODES", "LayerwiseUpdates", "enable_layerwise"]

CLIP_MODES = ("per_param", "per_param_scaled")


class LayerwiseUpdates:
    """Hooks that step `optimizer` parameter by parameter during the backward pass.

    Args:
        model_or_params: a module (its trainable parameters) or an iterable of parameters; every one must belong
            to `optimizer`.
        optimizer: an optimizer with ``step_param(p)`` (``slimopt.SlimOptimizer`` and its recipes).
        accumulation_steps: backward passes per update (>= 1); scale the loss by 1 / accumulation_steps as usual.
        clip: the per-parameter gradient norm limit, or None for no clipping (see the module docstring).
        clip_mode: ``"per_param"`` (each gradient to ``clip``) or ``"per_param_scaled"`` (to clip / sqrt(N)).

    Attributes:
        steps: boundary steps taken (optimizer updates); micro_steps: backward passes seen;
        stepped: whether the last backward closed a window; last_grad_norm: the unclipped global gradient norm
        of the last window when ``clip`` is set, else None; enabled: set False (or use ``paused()``) to let
        gradients accumulate without updates, e.g. to inspect them or to call ``optimizer.step()`` by hand.
    """

    def __init__(self, model_or_params: nn.Module | Iterable[Tensor], optimizer: torch.optim.Optimizer,
                 accumulation_steps: int = 1, clip: float | None = None, clip_mode: str = "per_param") -> None:
        if not callable(getattr(optimizer, "step_param", None)):
            raise TypeError(f"layer-wise updates need an optimizer that steps one parameter at a time "
                            f"(step_param(p), as slimopt.SlimOptimizer); {type(optimizer).__name__} updates all "
                            "its parameters in one step(). Use slimopt.build(model, method) instead.")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not 0.0 < float(clip) < math.inf):
            raise ValueError(f"clip must be None or a finite number > 0, got {clip!r}")
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)}; got {clip_mode!r}")

        if isinstance(model_or_params, nn.Module):
            named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
        else:
            named = [(f"params[{i}]", p) for i, p in enumerate(model_or_params)]
        seen: set[int] = set()
        self.params: list[Tensor] = []
        for name, p in named:
            if not isinstance(p, Tensor):
                raise TypeError(f"{name} is a {type(p).__name__}, not a parameter")
            if id(p) not in seen:  # tied weights: one hook, one step
                seen.add(id(p))
                self.params.append(p)
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        stray = [name for name, p in named if id(p) not in owned]
        if stray:
            raise ValueError(f"parameters not in the optimizer would never be updated: {stray[:8]}"
                             f"{' ...' if len(stray) > 8 else ''}; give the optimizer every trainable parameter "
                             "or pass only the optimizer's parameters")
        if not self.params:
            raise ValueError("no trainable parameters to hook")

        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.clip = None if clip is None else float(clip)
        self.clip_mode = clip_mode
        self.enabled = True
        self.steps = 0
        self.micro_steps = 0
        self.stepped = False
        self.last_grad_norm: float | None = None
        self._task = -1
        self._sq_norm = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    # ------------------------------------------------------------------------------------------------------------

    @property
    def clip_limit(self) -> float | None:
        """The norm each gradient is clipped to (None without clipping)."""
        if self.clip is None:
            return None
        return self.clip / math.sqrt(len(self.params)) if self.clip_mode == "per_param_scaled" else self.clip

    def _boundary(self) -> bool:
        """Whether the backward in progress closes an accumulation window."""
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def _hook(self, p: Tensor) -> None:
        if not self.enabled:
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first hook of this backward pass (an aborted one never reports back)
            self._task = task
            # runs once, after the whole backward pass (the mechanism DDP uses to finish its reductions)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self._boundary():
            self._step(p)

    def _step(self, p: Tensor) -> None:
        if p.grad is None:
            return
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p], self.clip_limit)
            self._sq_norm += float(norm) ** 2
        self.optimizer.step_param(p)
        p.grad = None  # the point of this mode: the gradient dies with its update

    def _end_of_backward(self) -> None:
        boundary = self._boundary()
        self._task = -1
        if boundary:
            for p in self.params:  # gradients from earlier in the window whose last backward did not reach them
                if p.grad is not None:
                    self._step(p)
            self.steps += 1
            self.last_grad_norm = math.sqrt(self._sq_norm) if self.clip is not None else None
            self._sq_norm = 0.0
            # torch's LR schedulers warn when scheduler.step() comes before any optimizer.step(): one happened
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self.micro_steps += 1
        self.stepped = boundary

    # ------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator["LayerwiseUpdates"]:
        """Within the block, backward passes only accumulate gradients (no updates, not counted)."""
        was = self.enabled
        self.enabled = False
        try:
            yield self
        finally:
            self.enabled = was

    def remove(self) -> None:
        """Remove the hooks: the model trains with ``optimizer.step()`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.enabled = False

    def __repr__(self) -> str:
        return (f"LayerwiseUpdates(params={len(self.params)}, accumulation_steps={self.accumulation_steps}, "
                f"clip={self.clip}, clip_mode={self.clip_mode!r}, steps={self.steps}, "
                f"micro_steps={self.micro_steps}, enabled={self.enabled})")


def enable_layerwise(model_or_params: nn.Module | Iterable[Tensor], optimizer: torch.optim.Optimizer,
                     accumulation_steps: int = 1, clip: float | None = None,
                     clip_mode: str = "per_param") -> LayerwiseUpdates:
    """Step `optimizer` during the backward pass, one parameter at a time; see ``LayerwiseUpdates``.

    Call ``loss.backward()`` in the loop and nothing else: no ``optimizer.step()``, no ``zero_grad()``
    (gradients are freed at each boundary). ``scheduler.step()`` after a backward with ``stepped`` True.

    Example::

        >>> import torch, slimopt
        >>> from slimopt.optim.layerwise import enable_layerwise
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> opt = slimopt.build(model, "adamw", lr=1e-3)
        >>> lw = enable_layerwise(model, opt, accumulation_steps=2, clip=1.0)
        >>> for _ in range(4):
        ...     model(torch.randn(5, 8)).square().mean().backward()   # no opt.step(), no zero_grad()
        >>> lw.steps, lw.micro_steps
        (2, 4)
    """
    return LayerwiseUpdates(model_or_params, optimizer, accumulation_steps, clip, clip_mode)
