"""Muon's step queued: the iterations of many matrices run together at the end of ``step()`` (or when the queue is
full), each matrix computed once.

A weight's step (``queue_step``) updates its momentum on the rows it holds and stores it, as the eager step does,
then queues the matrix to orthogonalize with what writes the weight once the result is there. Running the queue
(``MuonQueue.flush``):

- one process: the queued matrices of one shape go through one batched product chain
  (``muon.orthogonalize_many``: fewer kernels on a GPU, longer products on a CPU core), the result equal to each
  matrix's own iteration;
- FSDP2 (rows over ranks): each matrix is orthogonalized once, by an owner rank (``muon_owners.exchange``: one
  all-to-all brings its rows to the owner, one sends the result's rows back), instead of every rank
  all-gathering and iterating every matrix (``muon_sharded``, which the eager reference step keeps).

The queue holds at most ``QUEUE_BYTES`` of iterates a rank (whole matrices' bytes over the ranks, the same count on
every rank, so every rank flushes at the same parameters): a larger matrix waits alone. ``peak_bytes`` is what
the queue holds at its fullest, for the memory planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm import muon
from slimopt.optim.algorithm.rules import apply_update, comp_of, rounding_of
from slimopt.optim.distributed import muon_owners
from slimopt.optim.distributed.sharded import Target, moment_codecs
from slimopt.optim.routes import reference
from slimopt.optim.routes.subspace import count_moment_step

__all__ = ["QUEUE_BYTES", "Pending", "MuonQueue", "queue_step", "flush_due", "iteration_key", "runs", "peak_bytes",
           "queued_matrices"]

QUEUE_BYTES = 64 << 20  # iterates waiting per rank: small beside a model, a few layers' matrices of LLaMA-1B


@dataclass
class Pending:
    """One queued matrix: its parameter's index and whole shape, this rank's rows of the matrix to orthogonalize
    (in the iteration's dtype), their split, and what takes this rank's rows of the result."""

    index: int
    shape: tuple[int, int]
    x: Tensor
    rows: Any
    finish: Callable[[Tensor], None]

    @property
    def whole_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.x.element_size()


def flush_due(queued_bytes: int, new_bytes: int, world: int) -> bool:
    """Whether a queue holding `queued_bytes` of whole matrices runs before one of `new_bytes` joins it: every
    rank counts whole matrices, so every rank decides alike."""
    return queued_bytes > 0 and queued_bytes + new_bytes > QUEUE_BYTES * world


def iteration_key(group: dict[str, Any], dtype: torch.dtype) -> tuple:
    """What matrices iterated together share: the iteration's dtype and settings."""
    return (dtype, tuple(group["ns_coefficients"]), group["ns_steps"], float(group["ns_eps"]))


def runs(matrices: list[tuple[tuple, int, tuple[int, int], int]], world: int) -> list[list[tuple]]:
    """How a step's queued matrices (iteration key, parameter index, whole shape, element size), in the order
    queued, are run: each list one flush of one key's queue (``MuonQueue`` decides alike)."""
    out: list[list[tuple]] = []
    open_runs: dict[tuple, list[tuple]] = {}
    for item in matrices:
        key, _, (m, n), size = item
        run = open_runs.setdefault(key, [])
        if flush_due(sum(a * b * s for _, _, (a, b), s in run), m * n * size, world):
            out.append(run)
            run = open_runs[key] = []
        run.append(item)
    return out + [r for r in open_runs.values() if r]


class MuonQueue:
    """The matrices waiting for their iteration, by process group, number of ranks and ``iteration_key``."""

    def __init__(self) -> None:
        self._queues: dict[tuple, list[Pending]] = {}

    def add(self, key: tuple, pending: Pending) -> None:
        queue = self._queues.setdefault(key, [])
        if flush_due(sum(q.whole_bytes for q in queue), pending.whole_bytes, pending.rows.world):
            self._run(key, queue)
            queue.clear()
        queue.append(pending)

    def flush(self) -> None:
        """Orthogonalize every queued matrix and write its weight."""
        for key, queue in self._queues.items():
            self._run(key, queue)
        self._queues.clear()

    @staticmethod
    def _run(key: tuple, queue: list[Pending]) -> None:
        if not queue:
            return
        _, world, (dtype, coefficients, steps, eps) = key
        if world > 1:
            results = muon_owners.exchange(queue, lambda us: muon.orthogonalize_many(us, coefficients, steps, eps,
                                                                                     dtype), steps)
        else:
            results = muon.orthogonalize_many([q.x for q in queue], coefficients, steps, eps, dtype)
        for q, o in zip(queue, results):
            q.finish(o)


def queue_step(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int, queue: MuonQueue) -> None:
    """Muon's step of the 2-D weight window `t`: the momentum updated and stored now (``reference.moments``), the
    iteration queued, the weight written when its rows of the result come back."""
    g = t.grad if t.grad.dtype in (torch.float32, torch.float64) else t.grad.float()
    codecs = moment_codecs(opt, group, t.space(), t.p.dtype)
    count_moment_step(state, codecs, g.shape, g.device)
    dtype = muon.iteration_dtype(group["ns_dtype"], g.device)
    u = reference.moments(opt, t, group, state, g, step, t.space(), codecs,
                          lambda mom: muon.momentum_update(g, mom["momentum_buffer"], group))
    x = u.to(dtype).contiguous()  # the stored momentum itself (fp32, no look-ahead) is not written before the flush
    rounding = rounding_of(group, t.p)
    comp, stream = comp_of(state, t.p, rounding), reference.weight_stream(group, t, step)
    coef = muon.lr_ratio(group["adjust_lr_fn"], t.shape)
    p = t.p

    def finish(o: Tensor) -> None:
        apply_update(p, o.float(), coef, None, group, comp, stream)

    pending = Pending(t.index, (t.shape[0], t.shape[1]), x, t.rows, finish)
    queue.add((id(t.rows.group), t.rows.world, iteration_key(group, dtype)), pending)


def peak_bytes(matrices: list[tuple[tuple, int, tuple[int, int], int]], world: int = 1) -> int:
    """About the most bytes a rank's queued iterations allocate at once, for a step's matrices as ``runs`` takes them:
    the iterates waiting in a run, and its largest stack of one shape iterating, ``size (3 m n + 2 k^2)`` a matrix
    (the normalized iterate, the next one, the Gram matrix and its polynomial; k = min(m, n)), within ~10% above
    torch's MemTracker count of a small LLaMA's step (tests/test_muon.py). A rank's share over `world` ranks."""
    peak = 0
    for run in runs(matrices, world):
        waiting = sum(m * n * size for _, _, (m, n), size in run)
        stacks: dict[tuple[int, int], int] = {}
        for _, _, (m, n), size in run:
            stacks[(m, n)] = stacks.get((m, n), 0) + size * (3 * m * n + 2 * min(m, n) ** 2)
        peak = max(peak, -(-(waiting + max(stacks.values())) // world))
    return peak


def queued_matrices(opt, step: int) -> list[tuple[tuple, int, tuple[int, int], int]]:
    """The matrices an optimizer's `step` queues here, in order, as ``runs`` takes them, from its settings alone
    (the memory planner and ``slimopt.bench.fsdp_comm`` ask; a meta tensor is planned as a GPU steps it)."""
    out = []
    for group in opt.param_groups:
        if group["rule"] != "muon" or not group["fused"]:
            continue
        for p in group["params"]:
            layout = opt._layout(p, group)
            if layout not in ("none", "block") or (layout == "block" and not opt._block_active(p, group, step)):
                continue
            device = torch.device("cuda") if p.device.type == "meta" else p.device
            dtype = muon.iteration_dtype(group["ns_dtype"], device)
            size = torch.empty((), dtype=dtype, device="meta").element_size()
            out.append((iteration_key(group, dtype), opt._where[p][2], (p.shape[0], p.shape[1]), size))
    return out
