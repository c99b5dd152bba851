"""Muon's step queued: the iterations of many matrices run together (``whole_queue.py``), each matrix computed once.

A weight's step (``queue_step``) updates its momentum on the rows it holds and stores it, as the eager step does,
then queues the matrix to orthogonalize with what writes the weight once the result is there. A run (``run``):

- one process: on a GPU the queued matrices of one shape go through one batched product chain
  (``muon.orthogonalize_many``: fewer kernels), on a CPU one at a time, each written before the next is iterated;
- FSDP2 (rows over ranks): each matrix is orthogonalized once, by an owner rank chosen on the iteration's cost
  (``exchange.py``: one all-to-all brings its rows to the owner, one sends the result's rows back), instead of
  every rank all-gathering and iterating every matrix (``muon_sharded``, which the eager reference step keeps).

``peak_bytes`` is what the queue holds and allocates at its fullest, for the memory planner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slimopt.optim.algorithm import muon
from slimopt.optim.algorithm.rules import apply_update, comp_of, rounding_of
from slimopt.optim.distributed.exchange import Part, exchange
from slimopt.optim.distributed.owners import muon_cost
from slimopt.optim.distributed.sharded import Target, moment_codecs
from slimopt.optim.routes.reference import reference
from slimopt.optim.routes.subspace import count_moment_step
from slimopt.optim.routes.whole_queue import Pending, WholeQueue, key_of, runs

__all__ = ["queue_step", "run", "iteration_key", "peak_bytes", "queued_matrices"]


def iteration_key(group: dict[str, Any], dtype: torch.dtype) -> tuple:
    """What matrices iterated together share: the iteration's dtype and settings."""
    return (dtype, tuple(group["ns_coefficients"]), group["ns_steps"], float(group["ns_eps"]))


def run(queue: list[Pending], setting: tuple) -> None:
    """Orthogonalize the queued matrices (`setting`: their ``iteration_key``) and finish their steps: by shape in
    one process (stacked on a GPU), each by its owner rank under FSDP2."""
    dtype, coefficients, steps, eps = setting
    parts = [q.part for q in queue]
    if parts[0].rows.world > 1:
        results = [o for o, _ in exchange(parts, [q.cost for q in queue], lambda _, us: [
            (o, 0.0) for o in muon.orthogonalize_many(us, coefficients, steps, eps, dtype)])]
    else:
        results = muon.orthogonalize_many([p.x for p in parts], coefficients, steps, eps, dtype)
    for q, o in zip(queue, results):
        q.finish(o)


def queue_step(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int, queue: WholeQueue) -> None:
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

    m, n = t.shape
    setting = iteration_key(group, dtype)
    part = Part(t.index, (m, n), x, t.rows, (m, n))
    queue.add(key_of("muon", t.rows, setting), Pending(part, muon_cost(m, n, group["ns_steps"]), finish),
              lambda pending: run(pending, setting))


def peak_bytes(matrices: list[tuple[tuple, int, tuple[int, int], int]], world: int = 1,
               stacked: bool = True, own: dict[int, int] | None = None) -> int:
    """About the most bytes a rank's queued iterations allocate at once, for a step's matrices as ``runs`` takes them:
    the iterates waiting in a run, and its largest stack of one shape iterating (`stacked`: CUDA), ``size (3 m n +
    2 k^2)`` a matrix (the normalized iterate, the next one, the Gram matrix and its polynomial; k = min(m, n));
    unstacked (a CPU), the largest of that and of a matrix's own step (`own`: parameter index -> its step's
    scratch, ``muon.scratch_bytes``: a momentum stored while the others wait). Within ~10% above torch's MemTracker
    count of a small LLaMA's step (tests/test_muon.py). A rank's share over `world` ranks."""
    peak = 0
    for matrices_of_run in runs(matrices, world):
        waiting = sum(m * n * size for _, _, (m, n), size in matrices_of_run)
        stacks: dict[tuple[int, int], int] = {}
        for _, i, (m, n), size in matrices_of_run:
            one = size * (3 * m * n + 2 * min(m, n) ** 2)
            stacks[(m, n)] = stacks.get((m, n), 0) + one if stacked else max(one, (own or {}).get(i, 0))
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
            out.append((("muon", iteration_key(group, dtype)), opt._where[p][2], (p.shape[0], p.shape[1]), size))
    return out
