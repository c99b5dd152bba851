"""The peak memory of one training iteration, measured and planned: ``slimopt finetune``'s table and
``slimopt bench --check-planner``.

Measured: every tensor storage alive during one forward, backward and optimizer step of a model on a batch
(state already allocated, as in every step after the first), counted by a dispatch mode that sees
each operator's outputs and the moment each storage is freed: exact on a CPU, where the process's resident size
would add the allocator's slack. (torch's MemTracker counts the same, to 0.03% on a small LLaMA, but cannot track a
model with frozen weights: it hooks every parameter's gradient.) On CUDA, ``max_memory_allocated`` over the same
iteration. Planned: ``slimopt.bench.planner.plan`` for the same model, method, settings, batch and length:
the figure ``slimopt memory`` would give before renting anything. Their ratio says how far the planner can be
trusted for this model; gradients, activations and the step's temporaries are all in both.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from slimopt.optim.accounting import state_tensors

__all__ = ["measure_peak", "planned_peak"]


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak, from the given tensors on: each operator's outputs are
    added once per storage, and subtracted when the storage is freed."""

    def __init__(self, existing: Iterable[Any] = ()):
        super().__init__()
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.now = self.peak = 0
        for t in existing:
            self._track(t)

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage in self._live:
            return
        nbytes = storage.nbytes()
        self._live[storage] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        return out


def measure_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor]) -> int:
    """Peak bytes of every tensor during one training iteration of `model` on `batch` (model inputs with labels)
    with `optimizer`. The model's weights move by one step: measure after evaluating."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    optimizer.zero_grad(set_to_none=True)
    model.train()

    def iteration() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        iteration()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    existing = [*model.parameters(), *model.buffers(), *state_tensors(optimizer), *batch.values()]
    with _LiveBytes(existing) as live:
        iteration()
    return int(live.peak)


def planned_peak(model: torch.nn.Module, method: str, settings: Mapping[str, Any], batch: int, seq: int) -> int:
    """The planner's peak for one iteration of `model` (its dtype, its frozen parameters) with slimopt method
    `method` and its `settings` (lr ignored) at `batch` sequences of `seq` tokens."""
    from slimopt.bench.planner import plan

    opts = {k: v for k, v in settings.items() if k != "lr"}
    return int(plan(model, method, batch=batch, seq=seq, **opts).peak)
