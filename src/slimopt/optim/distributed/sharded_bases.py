"""Subspace bases of a row-sharded gradient, the same on every rank (``sharded.py`` refreshes with them).

- ``svd_basis``: the exact top-r singular vectors (``projectors.svd_basis``);
- ``randomized_basis``: a randomized range finder's (Halko, Martinsson, Tropp, arXiv 0909.4061;
  ``projectors.randomized_basis``) with the same random sketch as one process.

Both gather G on the group's first rank, decompose it there and broadcast the basis (``whole_basis``): the basis of
one process, bit for bit. The eager reference's scheme; the fast routes decompose each matrix on an owner rank
(``routes/refresh_batch.py``).

Each rank keeps a share of a basis: of a left one (m x r) its rows, like the parameter; of a right one (n x r) its
chunk of the n rows, split as torch.chunk splits them (``basis_rows``), all-gathered when a step uses it
(``whole_of_basis``; every basis a step will use without a refresh in one all-gather at its start, ``gather_bases``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.distributed.shardcomm import (Rows, broadcast, chunks_of, gather_row_chunks, gather_rows,
                                                 gather_rows_to_root, held_whole, hold)

__all__ = ["svd_basis", "randomized_basis", "basis_rows", "rows_of_basis", "whole_of_basis", "gather_bases",
           "decompose_checked"]


def basis_rows(side: str | None, shape, rows: Rows) -> Rows:
    """The rows of a basis this rank keeps, for a parameter of `shape` split as `rows`: a left basis's are the
    parameter's; a right basis's (n x r) are a torch.chunk split of n over the same ranks."""
    return rows if side == "left" else chunks_of(rows, shape[1])


def rows_of_basis(q: Tensor, side: str | None, rows: Rows) -> Tensor:
    """A full basis -> what this rank keeps (``basis_rows``): its rows of a left one, its chunk of a right one.
    Always row-major: a basis loaded from a checkpoint is, and matmuls round differently on other memory
    layouts."""
    if side != "left":
        rows = chunks_of(rows, q.shape[0])
    return q[rows.start: rows.stop].contiguous()


def whole_of_basis(q: Tensor, side: str | None, shape, rows: Rows, held: dict | None = None) -> Tensor:
    """What a step projects with, from what this rank keeps: a left basis's rows as they are (the step's product
    is over the parameter's rows), a right basis all-gathered from its chunks (the product is over all n), or as
    `held` has it (``gather_bases``: the step's one all-gather) where q has not changed since."""
    if side == "left" or not rows.distributed:
        return q
    whole = held_whole(held, q)
    return whole if whole is not None else gather_rows(q, basis_rows(side, shape, rows))


def gather_bases(items: list[tuple[Tensor, Rows]]) -> dict[int, tuple[Tensor, int, Tensor]]:
    """Several right bases whole in one all-gather (``shardcomm.gather_row_chunks``) instead of one a basis: items
    are (this rank's chunk q (c, r), its rows of the n, ``basis_rows``); returns {id(q): (q, its version, the whole
    (n, r))} for ``whole_of_basis``."""
    return hold(zip([q for q, _ in items], gather_row_chunks(items)))


def svd_basis(g: Tensor, r: int, side: str, rows: Rows) -> tuple[Tensor | None, str]:
    """``projectors.svd_basis`` of the whole gradient, decomposed on the group's first rank (``whole_basis``)."""
    return whole_basis(g, r, side, rows, lambda full: P.svd_basis(full, r, side))


def randomized_basis(g: Tensor, r: int, side: str, gen: torch.Generator, oversample: int, power_iters: int,
                     rows: Rows) -> tuple[Tensor | None, str]:
    """``projectors.randomized_basis`` of the whole gradient, decomposed on the group's first rank with the same
    random sketch (``whole_basis``): the basis of one process, bit for bit. (A range finder on the sharded rows
    sends about as many bytes, (q + 1)(4 n k + 4 m k) against 4 m n + 4 d r, but sums its products over ranks in
    another order: where the spectrum has no gap at r, that rounding turns the basis, and the step, by as much
    as the learning rate.)"""
    return whole_basis(g, r, side, rows, lambda full: P.randomized_basis(full, r, side, gen, oversample, power_iters))


def whole_basis(g: Tensor, r: int, side: str, rows: Rows, decompose) -> tuple[Tensor | None, str]:
    """The top-r basis of the whole gradient (m x n), `decompose(full)` -> (m or n, min(r, m, n)): in one process
    on g itself; sharded, g's rows are gathered on the first rank of the group, decomposed there, and the basis
    broadcast (m x n gathered, n x r or m x r broadcast per refresh), each rank keeping what it needs
    (``rows_of_basis``).

    Returns (basis as this rank keeps it, or None; status "ok" | "nonfinite" | an error message)."""
    if not rows.distributed:
        return decompose_checked(lambda: decompose(g), g)
    full = gather_rows_to_root(g, rows)
    m, n = rows.total, g.shape[1]
    flag = torch.zeros(1, dtype=torch.int64, device=g.device)
    basis = torch.empty((m if side == "left" else n, min(r, m, n)), dtype=g.dtype, device=g.device)
    message = "ok"
    if full is not None:
        b, message = decompose_checked(lambda: decompose(full), full)
        if b is None:
            flag.fill_(1 if message == "nonfinite" else 2)
        else:
            basis.copy_(b)
    broadcast(flag, rows)
    status = int(flag.item())
    if status:
        return None, "nonfinite" if status == 1 else (message if message != "ok" else "failed on the first rank")
    broadcast(basis, rows)
    return rows_of_basis(basis, side, rows), "ok"


def decompose_checked(decompose, g: Tensor) -> tuple[Tensor | None, str]:
    """A whole gradient g's basis, `decompose()` (``projectors.svd_basis`` / ``randomized_basis``), or None with a
    status: "ok", "nonfinite" (g or the basis), or the decomposition's error message."""
    if not bool(torch.isfinite(g).all()):
        return None, "nonfinite"
    try:
        basis = decompose()
        if not bool(torch.isfinite(basis).all()):
            raise RuntimeError("the decomposition returned non-finite values")
    except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
        return None, str(err)
    return basis, "ok"
