"""Where the trainable copy of each weight lives: on the host (master="fp32", "bf16+int8" or "bf16"), the device
keeping int8 (or its dtype's) weights, activations and the gradients in flight; or nowhere (master="none"), an int8
weight stepped in place on the device with stochastic rounding (Q-GaLore's way, arXiv 2407.08296). "bf16+int8" is
3 bytes a weight, bf16 and an int8 residual (FlashOptim's split, arXiv 2602.23349; ``split_master``).

With a master, every trainable parameter gets a copy on the host that a ``SlimOptimizer`` steps with the
partition and settings ``slimopt.build`` would give the model: the optimizer never sees a device tensor. A weight's
gradient leaves the device as soon as the backward pass has completed it (the int8 module's token, or the
parameter's post-accumulate-grad hook), its host step runs at once (in the backward pass's thread, or with
``overlap`` on a worker thread while the backward pass goes on), and the new value is written back (requantized for
an int8 layer, cast for the rest) before the next forward pass reaches that module, which waits only for its own
updates. The output layer's gradient, where the vocabulary-sliced loss makes it, leaves a slice of rows at a time
(``row_grads.py``). The plan of the bytes: ``slimopt memory --weights int8 --offload host``; how it works:
docs/modules.md, slimopt.weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.optim.algorithm.noise import CounterStream, mix_seed
from slimopt.optim.optimizer import SlimOptimizer
from slimopt.optim.recipes import param_groups
from slimopt.optim.routes.cpu import native
from slimopt.weights.convert import embedding_modules, int8_weights, to_int8
from slimopt.weights.int8_layer import Int8Weight
from slimopt.weights.row_grads import RowRoute, route_rows

__all__ = ["CLIP_MODES", "MASTERS", "SPLIT", "MasterWeights", "split_master", "joined_master"]

CLIP_MODES = ("hold", "previous")
# each form of master copy (factory.HOST_MASTERS, and none) -> the dtype the optimizer steps: bf16+int8 is stepped
# as the fp32 value it holds (split_master, joined_master)
MASTERS = {"fp32": torch.float32, "bf16+int8": torch.float32, "bf16": torch.bfloat16, "none": None}
SPLIT = "bf16+int8"
_RESIDUAL_BITS = 8  # a residual step is 2^-8 of the bf16 value's ulp: 16 bits of significand in all
_WINDOW = 1 << 20  # elements split or joined at a time (about 20 bytes each of temporaries)


def _residual_step(high: Tensor) -> Tensor:
    """The value of one residual step for each bf16 value (as fp32): 2^(E - 15) for |high| in [2^E, 2^(E + 1)),
    ulp(high) / 256; a power of two, so a residual times it, and its sum with high, are exact in fp32."""
    _, exponent = torch.frexp(high)  # high = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(high), exponent - 8 - _RESIDUAL_BITS)


def split_master(x: Tensor) -> tuple[Tensor, Tensor]:
    """An fp32 weight as (bf16 high part, int8 residual): high = x rounded to bf16 (nearest, ties to even), residual
    = round((x - high) / step) clamped to [-127, 127], step = ``_residual_step(high)``: x is kept to within one step
    (2^-8 of a bf16 ulp; 2^-15 relative at most, against bf16's 2^-9) from 2^-111 up; below, to bf16's precision.
    Without -128, high + residual * step is never half an ulp from high, so splitting a joined master gives back
    the same parts. Computed ``_WINDOW`` elements at a time: the temporaries stay small whatever the weight."""
    high = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    residual = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    flat, high_flat, residual_flat = x.reshape(-1), high.view(-1), residual.view(-1)
    for start in range(0, flat.numel(), _WINDOW):
        part = flat[start: start + _WINDOW]
        h = part.to(torch.bfloat16)
        wide = h.float()
        step = _residual_step(wide)  # 0 below 2^-134 (fp32's subnormals): those keep their bf16 value
        r = torch.where(torch.isfinite(wide) & (step > 0), (part - wide) / step, 0.0).round_().clamp_(-127, 127)
        high_flat[start: start + _WINDOW] = h
        residual_flat[start: start + _WINDOW] = r.to(torch.int8)
    return high, residual


def joined_master(high: Tensor, residual: Tensor) -> Tensor:
    """The fp32 value of a split master (``split_master``): high + residual * step, exact; a new tensor, filled
    ``_WINDOW`` elements at a time."""
    out = torch.empty(high.shape, dtype=torch.float32, device=high.device)
    flat, high_flat, residual_flat = out.view(-1), high.reshape(-1), residual.reshape(-1)
    for start in range(0, flat.numel(), _WINDOW):
        wide = high_flat[start: start + _WINDOW].float()
        residual_part = residual_flat[start: start + _WINDOW]
        # a zero residual leaves the value as it is (-0.0 stays -0.0)
        flat[start: start + _WINDOW] = torch.where(residual_part != 0, residual_part.float().mul_(
            _residual_step(wide)).add_(wide), wide)
    return out


class MasterWeights:
    """Master weights and their optimizer for `model`, stepped during its backward pass.

    Args:
        model: the model on its device; its chosen Linear layers become ``Int8Linear`` in place (``int8=True``;
            with ``int8_embeddings`` its input embedding an ``Int8Embedding`` and its output layer an ``Int8Linear``).
        method, build_settings: as ``slimopt.build(model, method, **build_settings)``.
        groups: the partition, called as ``groups(model, method, **build_settings)`` (default
            ``slimopt.param_groups``; the Trainer path passes its own, with its no-decay groups).
        int8: hold the body's Linear weights in int8 on the device (else in their dtype).
        int8_group: 0 for one scale a row, else the elements of a row that share one.
        int8_embeddings: the input embedding and the output layer in int8 too (one scale a row; a tied output layer
            computes with the embedding's table, whose one master takes both gradients).
        master: "fp32" (the updates are what an fp32 run would make), "bf16+int8" (3 bytes a weight: bf16 and an
            int8 residual, stepped as fp32) or "bf16": host copies in that form; "none": no copy, the optimizer
            and its state on the device, each int8 weight dequantized to fp32 for its step and rounded back
            stochastically (needs ``int8=True``; the other parameters step in place).
        accumulation_steps: backward passes per update; scale the loss by 1 / accumulation_steps as usual.
        overlap: step in a worker thread while the backward pass runs (the default False: in the backward pass's
            thread, each step finished before the next layer's gradient is computed). The same updates either way;
            the gradient leaves its master in the backward pass's thread and reaches the worker as an argument.
        clip: the global gradient norm limit (as ``torch.nn.utils.clip_grad_norm_`` over every master), or None.
        clip_mode: ``"hold"`` (exact: the window's steps wait for the end of its backward pass, when the norm is
            known; the updates still overlap the next forward pass) or ``"previous"`` (each gradient scaled as
            the previous window's norm asks, stepped at once; the first window holds).

    Attributes: optimizer (the host SlimOptimizer over the masters), masters ({parameter name: master}),
    steps (updates made), events (when ``record=True``: (seconds, what, name) of every gradient arrival, step
    start and end, and forward wait, for checking the overlap).
    """

    def __init__(self, model: nn.Module, method: str = "adamw", *, int8: bool = True, int8_group: int = 0,
                 int8_embeddings: bool = False, master: str = "fp32", accumulation_steps: int = 1,
                 overlap: bool = False, clip: float | None = None, clip_mode: str = "hold", record: bool = False,
                 groups: Callable[..., list[dict[str, Any]]] | None = None, **build_settings: Any) -> None:
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)}; got {clip_mode!r}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
        if master not in MASTERS:
            raise ValueError(f"master must be one of {', '.join(MASTERS)}; got {master!r}")
        if master == "none" and not int8:
            raise ValueError("master='none' steps int8 weights in place; with int8=False use slimopt.build")
        self.in_place = master == "none"
        self.split = master == SPLIT
        self._parts: dict[str, tuple[Tensor, Tensor]] = {}  # bf16+int8: name -> (bf16 high part, int8 residual)
        groups = (groups or param_groups)(model, method, **build_settings)  # the partition of the model as it is
        self.masters: dict[str, nn.Parameter] = {}
        self._device_param: dict[str, Tensor] = {}  # name -> the device tensor a non-int8 master is written to
        if int8_embeddings and not int8:
            raise ValueError("int8_embeddings=True needs int8=True")
        self._place_masters(model, groups, int8, int8_group, int8_embeddings, MASTERS[master])
        self._name_of = {id(p): n for n, p in self._device_param.items()}  # a tied parameter under either module
        self._index = {name: k for k, name in enumerate(self.masters)}
        self.optimizer = SlimOptimizer(groups)  # the worker's: nothing else writes its groups while it steps
        self.front = _Front(self.optimizer)  # what lr schedules and the loop read and write
        self.seed = int(groups[0].get("seed", 0)) if groups else 0
        self.accumulation_steps, self.record = accumulation_steps, record
        self.overlap = overlap and not self.in_place  # on the device the step is queued on its stream already
        self.clip, self.clip_mode = None if clip is None else float(clip), clip_mode
        self.last_grad_norm: float | None = None  # the unclipped global gradient norm of the last window
        self.steps = self.micro_steps = 0
        # the window's gradient norms, each a 0-dim tensor where its gradient is (no device sync before the end)
        self._norms: list[Tensor] = []
        self._previous_coef = 1.0
        self._handed = False
        self.events: list[tuple[float, str, str]] = []
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimopt-host-step") if self.overlap else None
        self._task = -1
        self._layers: dict[str, Int8Weight] = {}
        self._filling: set[str] = set()  # masters whose .grad a row route is writing for the first time this window
        self._hooks = []
        self._attach(model)
        with torch.no_grad():
            for name in self._parts:  # the device weights from the value the split master holds
                self._write(name, joined_master(*self._parts[name]))

    # ------------------------------------------------------------------------------------------------------------

    def _place_masters(self, model: nn.Module, groups: list[dict[str, Any]], int8: bool, int8_group: int,
                       int8_embeddings: bool, dtype: torch.dtype | None) -> None:
        """Swap each group's parameters for their masters (in place: the device parameter itself, and for an int8
        layer a stand-in that holds a weight only while it steps)."""
        int8_names = {name for name, _ in int8_weights(model, int8_embeddings)} if int8 else set()
        names = {id(p): n for n, p in model.named_parameters()}
        # in place, a master on the meta device holds no memory until its stand-in replaces it
        int8_masters = dict(to_int8(model, int8_group, dtype or torch.float32, "meta" if dtype is None else "cpu",
                                    int8_embeddings)) if int8 else {}
        layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Int8Weight)}
        for group in groups:
            masters = []
            for p in group["params"]:
                name = names[id(p)]
                if name in int8_names:
                    master = int8_masters[name]
                    if dtype is None:  # set_data cannot leave the meta device: a new parameter, on the layer's
                        master = nn.Parameter(_stand_in(master, layers[name].weight_codes.device))
                        layers[name].set_master(master)
                elif dtype is None:
                    master = p
                else:
                    master = nn.Parameter(p.detach().to("cpu", dtype, copy=True))
                    self._device_param[name] = p
                if self.split:  # the master holds nothing between its steps; its value lives in two parts
                    self._parts[name] = split_master(master.detach())
                    master.data = _stand_in(master, master.device)
                self.masters[name] = master
                masters.append(master)
            group["params"] = masters

    def _attach(self, model: nn.Module) -> None:
        """Gradient hooks on every master's device side, and a forward pre-hook on every module holding one."""
        hooked: set[str] = set()
        for module_name, module in model.named_modules():
            waits: list[str] = []
            if isinstance(module, Int8Weight) and module.master is not None:
                name = f"{module_name}.weight" if module_name else "weight"
                self._layers[name] = module
                module.grad_sink = lambda grad, name=name: self._arrive(name, grad)
                self._hooks.append(module.on_grad_complete(lambda token, name=name: self._complete(name)))
                waits.append(name)
            for p in module.parameters(recurse=False):
                name = self._name_of.get(id(p))
                if name is not None and name not in hooked:
                    hooked.add(name)
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p, name=name: self._arrive_whole(name, p)))
                if name is not None:
                    waits.append(name)
            if waits:
                self._hooks.append(module.register_forward_pre_hook(lambda m, args, waits=tuple(waits):
                                                                    self._wait(waits)))
        self._route_output_rows(model)

    def _route_output_rows(self, model: nn.Module) -> None:
        """The output layer's gradient to its host master a slice of rows at a time, where a loss computes it so
        (the vocabulary-sliced loss): one slice on the device instead of (V, h). Not for a weight tied to the
        input embedding, whose gradient has a second part."""
        head, embedding = embedding_modules(model)
        weight = getattr(head, "weight", None)
        name = self._name_of.get(id(weight))
        if name is None or weight is getattr(embedding, "weight", None):
            return
        self._hooks.append(route_rows(weight, RowRoute(ready=lambda: self._wait((name,)),
                                                       rows=lambda start, grad: self._arrive(name, grad, start),
                                                       done=lambda: self._rows_done(name))))

    def _log(self, what: str, name: str) -> None:
        if self.record:
            with self._lock:
                self.events.append((time.perf_counter() - self._t0, what, name))

    def _arrive(self, name: str, grad: Tensor, start: int | None = None) -> None:
        """A gradient (or a micro-batch's part of it) leaves the device: added into the master's .grad; with
        `start`, rows [start, start + len(grad)) of it (a row route), written the window's first pass."""
        if grad is None:
            return
        self._wait((name,))  # a step of this master still running reads its .grad
        master = self.masters[name]
        host = grad.detach().to(device=master.device, dtype=master.dtype)
        if start is None:
            if master.grad is None:
                master.grad = host
            else:
                master.grad.add_(host)
            self._log("grad", name)
            return
        if master.grad is None:
            master.grad = torch.empty(master.shape, dtype=master.dtype, device=master.device)
            self._filling.add(name)
        rows = master.grad[start: start + grad.shape[0]]
        rows.copy_(host) if name in self._filling else rows.add_(host)
        self._log("grad rows", name)

    def _rows_done(self, name: str) -> None:
        self._filling.discard(name)
        self._complete(name)

    def _arrive_whole(self, name: str, p: Tensor) -> None:
        """A parameter's gradient for this backward pass, complete at once (its post-accumulate-grad hook)."""
        if self.masters[name] is not p:  # stepped in place: the gradient is where the step reads it
            self._arrive(name, p.grad)
            p.grad = None  # the device copy dies here
        self._complete(name)

    def _complete(self, name: str) -> None:
        """Every gradient of `name` in this backward pass is in: at the window's last pass, step it."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first completion of this backward pass
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if (self.micro_steps + 1) % self.accumulation_steps == 0 and not self._holding():
            self._submit(name, self._measure_and_scale(name))

    def _holding(self) -> bool:
        """Whether this window's steps wait for its global gradient norm."""
        return self.clip is not None and (self.clip_mode == "hold" or self.last_grad_norm is None)

    def _measure_and_scale(self, name: str) -> float | None:
        """Add the gradient's part of this window's norm (last_grad_norm, clipped or not); with clip, the scale
        the last window set ("previous" mode), else None."""
        grad = self.masters[name].grad
        if grad is not None:
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        return None if self.clip is None else self._previous_coef

    def _hand_over(self) -> None:
        """The front's hyperparameters (an lr schedule's latest) into the worker's groups, once no step of the
        last window is running: at a window's first step, and before a checkpoint."""
        self.synchronize()
        for front, back in zip(self.front.param_groups, self.optimizer.param_groups):
            back.update({k: v for k, v in front.items() if k != "params"})
        self._handed = True

    def _submit(self, name: str, coef: float | None = None) -> None:
        if not self._handed:
            self._hand_over()
        master = self.masters[name]
        grad = master.grad
        if grad is None:
            return
        # the gradient leaves the master here, in the thread of the backward pass or the loop: a worker that set
        # or dropped a .grad while the backward pass ran corrupted the heap (docs/offload.md)
        master.grad = None
        if self._pool is None:
            self._step(name, coef, grad)
        else:
            self._pending[name] = self._pool.submit(self._step, name, coef, grad)

    @torch.no_grad()
    def _step(self, name: str, coef: float | None, grad: Tensor) -> None:
        master = self.masters[name]
        self._log("step", name)
        if coef is not None and coef < 1.0:
            grad.mul_(coef)
        if self.in_place and name in self._layers:
            self._step_in_place(name, master, grad)
        elif self.split:  # stepped as fp32, one weight at a time, then split again
            master.data = joined_master(*self._parts[name])
            self.optimizer.step_param(master, grad)
            self._parts[name] = split_master(master.detach())
            master.data = _stand_in(master, master.device)
            # the device weight from the value the parts hold (what a resume writes too), not the step's fp32
            self._write(name, joined_master(*self._parts[name]))
        elif name in self._layers:  # the int8 codes written by the step's own pass where its kernel allows
            layer = self._layers[name]
            codes, scale = layer.host_buffers()
            with native.Int8Sink(master, layer.group, codes, scale) as sink:
                self.optimizer.step_param(master, grad)
            if sink.written:
                layer.publish(codes, scale)
            else:
                layer.load_weight(master)
        else:
            self.optimizer.step_param(master, grad)
            self._write(name, master)
        self._log("done", name)

    def _step_in_place(self, name: str, master: nn.Parameter, grad: Tensor) -> None:
        """An int8 weight without a master: dequantized to fp32 for its step, rounded back stochastically (a hash
        of the seed, the weight and the step picks each element's noise), the fp32 copy dropped."""
        layer = self._layers[name]
        master.data = layer.dequantized_weight(torch.float32)
        self.optimizer.step_param(master, grad)
        layer.load_weight(master.detach(), CounterStream(mix_seed(self.seed, self._index[name], self.steps,
                                                                  _WEIGHT_STREAM)))
        master.data = _stand_in(master, master.device)

    def value(self, name: str) -> Tensor:
        """The master of `name` as a tensor of its values (a bf16+int8 master joined to fp32: a new tensor)."""
        self.synchronize()
        return joined_master(*self._parts[name]) if self.split else self.masters[name].detach()

    def _write(self, name: str, master: Tensor) -> None:
        """The device copy of a master after its step (or a load): requantized, or cast and copied."""
        if name in self._layers:
            self._layers[name].load_weight(master)
        elif name in self._device_param:
            self._device_param[name].copy_(master)

    def _wait(self, names: tuple[str, ...]) -> None:
        """Block until the updates of `names` have landed (the forward pass of their module is next)."""
        for name in names:
            future = self._pending.pop(name, None)
            if future is not None:
                if not future.done():
                    self._log("wait", name)
                future.result()  # re-raises a failed step here, in the training loop's thread

    def _end_of_backward(self) -> None:
        self._task = -1
        self.micro_steps += 1
        if self.micro_steps % self.accumulation_steps:
            return
        held = self._holding()
        if held:  # every gradient is in: clip them all as torch does, then step
            with_grads = [m for m in self.masters.values() if m.grad is not None]
            norm = float(torch.nn.utils.clip_grad_norm_(with_grads, self.clip)) if with_grads else 0.0
        for name, master in self.masters.items():  # held steps, and a master whose gradient came early
            if master.grad is not None and name not in self._pending:
                self._submit(name, 1.0 if held else self._measure_and_scale(name))
        self._close_window(norm if held else sum(float(n) ** 2 for n in self._norms) ** 0.5)
        self.steps += 1
        self._handed = False
        # torch's lr schedulers warn when scheduler.step() comes before any optimizer.step(): one happened
        self.front._opt_called = True  # type: ignore[attr-defined]

    def _close_window(self, norm: float) -> None:
        """Record the window's unclipped norm; the scale the next window's gradients take in "previous" mode."""
        self.last_grad_norm = norm
        self._previous_coef = 1.0 if self.clip is None else min(1.0, self.clip / (norm + 1e-6))
        self._norms = []

    # ------------------------------------------------------------------------------------------------------------

    @property
    def state(self):
        """The host optimizer's state (what ``slimopt.state_nbytes`` and the peers' byte counts read), once every
        update in flight has landed."""
        self.synchronize()
        return self.optimizer.state

    @torch.no_grad()
    def plain_state_dict(self, model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        """`model`'s state dict as the model was before its conversion: each int8 layer's ``weight`` in `dtype`
        from its master (dequantized where it has none) instead of its codes and scales."""
        self.synchronize()
        out = {k: v for k, v in model.state_dict().items()
               if not k.endswith((".weight_codes", ".weight_scale"))}
        for name, layer in self._layers.items():
            source = layer.dequantized_weight(torch.float32) if self.in_place else self.value(name)
            out[name] = source.detach().to(dtype)
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The front's groups: set their lr (or give ``front`` to an lr schedule); the next window's steps take
        it."""
        return self.front.param_groups

    def step(self, closure=None) -> None:
        """Nothing to do: the updates ran during the backward pass. Here so that a training loop written for
        ``optimizer.step()`` runs unchanged; the next forward pass waits for the updates it needs."""
        if closure is not None:
            raise ValueError("MasterWeights steps during the backward pass; it takes no closure")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient is consumed by its step (and dropped on the device as it leaves)."""

    def synchronize(self) -> None:
        """Wait for every update in flight (before reading the masters, the state or the device weights)."""
        self._wait(tuple(self._pending))

    def _handed_state(self) -> dict[str, Any]:
        """The worker optimizer's state dict with the front's hyperparameters (those the next window will use)."""
        self._hand_over()
        return self.optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The masters, the host optimizer's state and the counters: tensors and plain values only, so that
        ``torch.load(weights_only=True)`` reads it. The device weights are not in it: they are the masters'."""
        self.synchronize()
        held = {n: (self._layers[n].weight_codes, self._layers[n].weight_scale) if self.in_place and n in self._layers
                else self._parts[n] if self.split else m.detach()
                for n, m in self.masters.items()}  # in place, an int8 weight is its own master
        return {"masters": held,
                "optimizer": self._handed_state(),
                "counters": {"steps": self.steps, "micro_steps": self.micro_steps,
                             "last_grad_norm": self.last_grad_norm, "previous_coef": self._previous_coef}}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the masters and the optimizer state as saved, and the device weights written from them."""
        self.synchronize()
        masters = state["masters"]
        if set(masters) != set(self.masters):
            missing, extra = sorted(set(self.masters) - set(masters)), sorted(set(masters) - set(self.masters))
            raise ValueError(f"this checkpoint's masters do not match the model: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for name, master in self.masters.items():
            if name in self._layers and self.in_place:
                layer, (codes, scale) = self._layers[name], masters[name]
                layer.weight_codes.copy_(codes)
                layer.weight_scale.copy_(scale)
                continue
            saved = masters[name]
            if self.split != isinstance(saved, (tuple, list)):
                kinds = ("bf16+int8", "fp32 or bf16") if isinstance(saved, (tuple, list)) else ("fp32 or bf16",
                                                                                                  "bf16+int8")
                raise ValueError(f"this checkpoint's master of {name} is {kinds[0]}, this run's {kinds[1]}: resume "
                                 f"with the --master it was saved with")
            if self.split:
                self._parts[name] = (saved[0].detach().clone(), saved[1].detach().clone())
                self._write(name, joined_master(*self._parts[name]))
                continue
            master.copy_(saved)
            self._write(name, master)
        self.optimizer.load_state_dict(state["optimizer"])
        for front, back in zip(self.front.param_groups, self.optimizer.param_groups):
            front.update({k: v for k, v in back.items() if k != "params"})
        counters = state["counters"]
        self.steps, self.micro_steps = int(counters["steps"]), int(counters["micro_steps"])
        self.last_grad_norm, self._previous_coef = counters["last_grad_norm"], float(counters["previous_coef"])

    def close(self) -> None:
        """Finish the updates in flight, remove the hooks and stop the worker."""
        self.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for layer in self._layers.values():
            layer.grad_sink = None
        if self._pool is not None:
            self._pool.shutdown()


_WEIGHT_STREAM = 0x5EED_1D8  # keeps the weights' rounding noise apart from the optimizer state's streams


def _stand_in(master: Tensor, device: torch.device) -> Tensor:
    """A tensor of the master's shape and dtype on `device` that holds no memory (one element, zero strides):
    what an in-place int8 weight's parameter holds between its steps, so the optimizer keeps seeing one shape."""
    return torch.zeros((), dtype=master.dtype, device=device).expand(master.shape)


class _Front(torch.optim.Optimizer):
    """The optimizer a training loop and an lr schedule see: the worker's groups' hyperparameters, copied, over
    the same masters, and no state. A schedule writes its lr here while the worker may still be stepping the last
    window with the lr it was given; the next window's first step hands the new values over."""

    def __init__(self, back: SlimOptimizer) -> None:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in back.param_groups]
        super().__init__(groups, {})

    def step(self, closure=None) -> None:  # the updates run in MasterWeights
        return None
