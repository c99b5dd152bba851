"""Subspace bases of a row-sharded gradient, the same on every rank (``sharded.py`` refreshes with them).

- ``svd_basis``: the documented fallback for ``projector="svd"``: G is gathered on the group's first rank, its
  exact top-r singular vectors computed there and broadcast.
- ``randomized_basis``: ``projectors.randomized_basis`` (Halko, Martinsson, Tropp, arXiv 0909.4061) step for step
  on sharded rows, with the same random sketch, so the basis equals one process's up to rounding.

A right basis (n x r) is kept whole by every rank; a left one (m x r) by rows, like the parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import projectors as P
from .shardcomm import Rows, all_reduce, broadcast, gather_rows, gather_rows_to_root

__all__ = ["svd_basis", "randomized_basis", "rows_of_basis"]


def rows_of_basis(q: Tensor, side: str | None, rows: Rows) -> Tensor:
    """A full basis -> what this rank keeps: all of it for a right projection, its rows for a left one. Always
    row-major: a basis loaded from a checkpoint is, and matmuls round differently on other memory layouts."""
    return (q[rows.start: rows.stop] if side == "left" else q).contiguous()


def svd_basis(g: Tensor, r: int, side: str, rows: Rows) -> tuple[Tensor | None, str]:
    """The exact top-r basis of the full gradient: gathered on the first rank of the group, decomposed there,
    broadcast (the documented fallback: m x n gathered, n x r or m x r broadcast per refresh).

    Returns (basis as this rank keeps it, or None; status "ok" | "nonfinite" | an error message)."""
    full = gather_rows_to_root(g, rows)
    m, n = rows.total, g.shape[1]
    flag = torch.zeros(1, dtype=torch.int64, device=g.device)
    # as many columns as projectors.svd_basis returns: min(r, m, n)
    basis = torch.empty((m if side == "left" else n, min(r, m, n)), dtype=g.dtype, device=g.device)
    message = "ok"
    if full is not None:
        if not bool(torch.isfinite(full).all()):
            flag.fill_(1)
        else:
            try:
                b = P.svd_basis(full, r, side)
                if not bool(torch.isfinite(b).all()):
                    raise RuntimeError("the decomposition returned non-finite values")
                basis.copy_(b)
            except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
                flag.fill_(2)
                message = str(err)
    broadcast(flag, rows)
    status = int(flag.item())
    if status:
        return None, "nonfinite" if status == 1 else (message if message != "ok" else "failed on the first rank")
    broadcast(basis, rows)
    return rows_of_basis(basis, side, rows), "ok"


def randomized_basis(g: Tensor, r: int, side: str, gen: torch.Generator, oversample: int, power_iters: int,
                     rows: Rows) -> tuple[Tensor | None, str]:
    """``projectors.randomized_basis`` on a row-sharded gradient, step for step with the same random sketch.

    With a = G (left) or G^T (right): products a @ x and a^T @ y are either G x (local rows, all-gathered:
    m x k) or G^T y (a sum over ranks, all-reduced: n x k), k = r + oversample. Every QR and the small SVD run
    on every rank on the same gathered or reduced data.
    """
    finite = torch.tensor([1 if bool(torch.isfinite(g).all()) else 0], dtype=torch.int64, device=g.device)
    all_reduce(finite, rows, op=dist.ReduceOp.MIN)
    if not int(finite.item()):
        return None, "nonfinite"
    m, n = rows.total, g.shape[1]
    d, e = (m, n) if side == "left" else (n, m)
    k = min(r + oversample, d, e)

    def g_times(x: Tensor) -> Tensor:  # G x: (n, k) -> (m, k)
        return gather_rows(g @ x, rows)

    def gt_times(y: Tensor) -> Tensor:  # G^T y: (m, k) -> (n, k)
        return all_reduce(g.transpose(0, 1) @ y[rows.start: rows.stop], rows)

    a_times, at_times = (g_times, gt_times) if side == "left" else (gt_times, g_times)
    try:
        omega = torch.randn(e, k, generator=gen, device=g.device, dtype=g.dtype)
        y = torch.linalg.qr(a_times(omega)).Q  # (d, k)
        for _ in range(power_iters):
            z = torch.linalg.qr(at_times(y)).Q  # (e, k)
            y = torch.linalg.qr(a_times(z)).Q  # (d, k)
        b = at_times(y).transpose(0, 1)  # y^T a: (k, e)
        ub = torch.linalg.svd(b, full_matrices=False).U
        basis = y @ ub[:, :r]
        if not bool(torch.isfinite(basis).all()):
            raise RuntimeError("the decomposition returned non-finite values")
    except RuntimeError as err:  # the same data on every rank: every rank fails alike
        return None, str(err)
    return rows_of_basis(basis.contiguous(), side, rows), "ok"
