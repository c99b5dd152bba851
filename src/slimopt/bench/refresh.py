"""What one subspace refresh costs: time and quality of the top-r basis of one gradient-sized matrix.

GaLore (arXiv 2403.03507) recomputes the top-r singular vectors of every projected gradient every T steps with a
full SVD; a randomized range finder (Halko, Martinsson, Tropp, arXiv 0909.4061) finds nearly the same subspace
with a few thin matmuls. The test matrix has a known, harsh spectrum (singular values 1/i): G = U [diag(s) 0] V^T, with U and V
products of a few seeded Householder reflections (orthogonal, dense, and cheap to apply: no QR of a 5461-row
matrix), so the best rank-r energy sum(s[:r]^2) is known exactly and each basis Q is scored by the share of it
that it captures, ||Q^T G||_F^2 / sum(s[:r]^2) (1.0 is optimal).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["test_matrix", "refresh_methods", "time_refresh"]


def test_matrix(m: int, n: int, seed: int = 0, device="cpu", reflections: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(G (m, n) fp32 with singular values 1/i, those singular values (min(m, n),))."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k = min(m, n)
    s = 1.0 / torch.arange(1, k + 1, dtype=torch.float32)
    g = torch.zeros(m, n)
    g[torch.arange(k), torch.arange(k)] = s
    for _ in range(reflections):  # G <- (I - 2 u u^T) G (I - 2 v v^T): orthogonal on both sides
        u = torch.randn(m, 1, generator=gen)
        u /= u.norm()
        g -= 2 * u @ (u.T @ g)
        v = torch.randn(n, 1, generator=gen)
        v /= v.norm()
        g -= 2 * (g @ v) @ v.T
    return g.to(device), s


def _left_basis(q: torch.Tensor, m: int) -> torch.Tensor:
    """A basis of the left (m-dim) space with orthonormal columns, from a method's output."""
    return q if q.shape[0] == m else q.T


def refresh_methods(rank: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor] | str]:
    """name -> function G (m, n) -> left basis (m, rank), or the reason it cannot run here."""
    from slimopt.optim.algorithm import projectors as P

    gen = {}

    def rsvd(g):
        if g.device not in gen:
            gen[g.device] = P.generator(g.device, 0, 0, 0)
        return P.randomized_basis(g, rank, "left", gen[g.device], oversample=8, power_iters=2)

    out: dict[str, Callable | str] = {
        "slimopt svd (torch.linalg.svd)": lambda g: P.svd_basis(g, rank, "left"),
        "slimopt randomized_svd (2 power iterations)": rsvd,
        "torch.svd_lowrank (niter=2)": lambda g: torch.svd_lowrank(g, q=rank + 8, niter=2)[0][:, :rank],
    }
    try:
        from galore_torch.galore_projector import GaLoreProjector

        proj = GaLoreProjector(rank)
        out["galore-torch projector (full SVD)"] = lambda g: proj.get_orthogonal_matrix(g, rank, type="left")
    except Exception as err:  # not installed, or its import fails
        out["galore-torch projector (full SVD)"] = f"not installed ({type(err).__name__})"
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_refresh(shape: tuple[int, int] = (2048, 5461), rank: int = 512, device: str = "cpu", reps: int = 3,
                 seed: int = 0) -> list[dict]:
    """Median time (ms) of each refresh method on a `shape` test matrix and the share of the optimal rank-r
    energy its basis captures; on a GPU after one untimed call (kernel selection, workspaces). A method that
    cannot run gets a status saying why."""
    m, n = shape
    if not (isinstance(rank, int) and 0 < rank <= min(m, n)):
        raise ValueError(f"rank must be an integer in [1, {min(m, n)}] for shape {shape}, got {rank!r}")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an integer >= 1, got {reps!r}")
    dev = torch.device(device)
    g, s = test_matrix(m, n, seed, dev)
    best = float((s[:rank] ** 2).sum())
    rows = []
    for name, fn in refresh_methods(rank).items():
        row = {"name": name, "shape": [m, n], "rank": rank, "device": str(dev)}
        if isinstance(fn, str):
            rows.append({**row, "status": fn})
            continue
        try:
            if dev.type == "cuda":
                fn(g)  # warm-up: kernel selection, workspaces
            times = []
            for _ in range(reps):
                _sync(dev)
                t0 = time.perf_counter()
                q = fn(g)
                _sync(dev)
                times.append((time.perf_counter() - t0) * 1e3)
            q = _left_basis(q.float(), m)
            energy = float(((q.T @ g) ** 2).sum()) / best
            rows.append({**row, "status": "ok", "ms": statistics.median(times), "reps": reps,
                         "energy_ratio": energy})
        except Exception as err:  # report, and go on with the other methods
            rows.append({**row, "status": f"failed: {type(err).__name__}: {err}"[:200]})
    return rows
