"""A subspace refresh of an FSDP2 parameter decomposed by an owner rank (GaLore's ``svd`` and ``randomized_svd``).

A refresh needs the whole gradient. The eager reference gathers it on the group's first rank, which decomposes
every matrix in turn while the others wait (``sharded_bases.whole_basis``). Here a parameter whose refresh is due
queues its gradient rows (``whole_queue.py``) with the rest of its step; a run gives each matrix an owner rank by
the decomposition's cost (``owners.svd_cost``, ``owners.randomized_svd_cost``), one all-to-all brings the rows to
the owners, each decomposes its matrices (with the same random sketch as one process), and one all-to-all sends
a left basis back by rows and a right basis whole to every rank, with the owner's status (a non-finite gradient
or a failed decomposition keeps the previous subspace on every rank, as in one process). Then each parameter's
step goes on with its new basis: the basis of one process, bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.distributed.exchange import Part, exchange
from slimopt.optim.distributed.sharded import Target
from slimopt.optim.distributed.sharded_bases import decompose_checked
from slimopt.optim.routes.subspace import refresh_cost, refresh_phase
from slimopt.optim.routes.whole_queue import Pending, WholeQueue, key_of

__all__ = ["DECOMPOSED", "due", "queue", "run", "queued_refreshes", "STATUS"]

DECOMPOSED = ("svd", "randomized_svd")
STATUS = {0.0: "ok", 1.0: "nonfinite"}  # any other value: the decomposition failed on its owner


def due(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int, projector: str) -> bool:
    """Whether this step of `t` refreshes a decomposed basis by owner ranks: a row shard whose basis is due (or
    missing), on the fast routes (``fused=True``; the eager reference keeps the first rank's decomposition)."""
    return (t.split and group["fused"] and projector in DECOMPOSED
            and ("proj" not in state or P.refresh_due(step, group["update_gap"], refresh_phase(opt, t.param, group))))


def queue(opt, t: Target, group: dict[str, Any], step: int, side: str, r: int, whole: WholeQueue,
          finish: Callable[[tuple[Tensor | None, str]], None]) -> None:
    """Queue the refresh of `t` (its gradient rows); finish((this rank's part of the new basis or None, status))
    goes on with its step once the basis is there."""
    g = t.grad if t.grad.dtype in (torch.float32, torch.float64) else t.grad.float()
    m, n = t.shape
    gen = P.generator(t.p.device, group["seed"], t.index,
                      P.refresh_index(step, group["update_gap"], refresh_phase(opt, t.param, group)))
    if group["projector"] == "svd":
        def decompose(full: Tensor) -> Tensor:
            return P.svd_basis(full, r, side)
    else:
        def decompose(full: Tensor) -> Tensor:
            return P.randomized_basis(full, r, side, gen, group["oversample"], group["power_iters"])

    def done(share: Tensor, code: float) -> None:
        finish((share.contiguous(), "ok") if code == 0.0 else (None, STATUS.get(code, "failed on its owner rank")))

    part = Part(t.index, (m, n), g.contiguous(), t.rows, (m if side == "left" else n, min(r, m, n)), side == "left")
    pending = Pending(part, refresh_cost(group, t.shape), done, decompose)
    whole.add(key_of("refresh", t.rows, g.dtype), pending, run)


def run(pending: list[Pending]) -> None:
    """Decompose each queued gradient on its owner rank and finish each parameter's step."""
    parts = [q.part for q in pending]

    def compute(mine: list[int], wholes: list[Tensor]) -> list[tuple[Tensor, float]]:
        out = []
        for i, full in zip(mine, wholes):
            basis, status = decompose_checked(lambda: pending[i].work(full), full)
            code = {"ok": 0.0, "nonfinite": 1.0}.get(status, 2.0)
            out.append((basis if basis is not None else full.new_zeros(parts[i].result), code))
        return out

    for q, (share, code) in zip(pending, exchange(parts, [q.cost for q in pending], compute, status=True)):
        q.finish(share, code)


def queued_refreshes(opt, step: int) -> list[tuple[tuple, int, tuple[int, int], int, float, tuple[int, int], bool]]:
    """The refreshes an FSDP2 optimizer's `step` queues, from its settings and state before the step: (key,
    parameter index, whole shape, element size, cost, basis shape, basis by rows), for ``fsdp_comm``."""
    out = []
    for group in opt.param_groups:
        if group["projector"] not in DECOMPOSED or not group["fused"]:
            continue
        for p in group["params"]:
            if opt._layout(p, group) not in DECOMPOSED:
                continue
            m, n = p.shape
            side = P.side_for(p.shape, group["proj_side"])
            r = P.subspace_rank(p.shape, group["projector"], side, group["rank"], group["density"])
            phase = refresh_phase(opt, p, group)
            if not r or ("proj" in opt.state.get(p, {}) and not P.refresh_due(step, group["update_gap"], phase)):
                continue
            size = 8 if p.dtype == torch.float64 else 4
            out.append((("refresh", size), opt._where[p][2], (m, n), size, refresh_cost(group, p.shape),
                        (m if side == "left" else n, min(r, m, n)), side == "left"))
    return out
