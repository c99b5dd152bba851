"""Projectors: which part of a gradient is state-full.

A projector splits a 2-D gradient ``G`` (m x n) into a low-dimensional part that a stateful rule (AdamW, ...) sees,
and a residual that a state-free rule may update. Every projector keeps its choice fixed between refreshes (every
``update_gap`` steps) and stores that choice as tensors in the optimizer state, so checkpoints load with
``torch.load(weights_only=True)``.

Details: docs/modules.md, ``slimopt.optim.algorithm.projectors``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.optim.algorithm.noise import CounterStream, mix_seed

PROJECTORS = ("none", "svd", "randomized_svd", "random", "columns", "rows", "block")
ORTHO_PROJECTORS = ("svd", "randomized_svd", "random")
PROJ_SIDES = ("std", "reverse_std", "left", "right")
PROJ_DTYPES = ("fp32", "grad", "auto")
BLOCK_ORDERS = ("ascending", "descending", "random")


def generator(device: torch.device, *parts: int) -> torch.Generator:
    """A generator on `device` seeded from `parts` (e.g. group seed, parameter index, refresh index)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(mix_seed(*parts))
    return gen


def stream(*parts: int) -> CounterStream:
    """The counter-based stream keyed by `parts` (group seed, parameter index, step, moment): what stochastic
    rounding draws from (noise.py)."""
    return CounterStream(mix_seed(*parts))


def side_for(shape: torch.Size, proj_side: str) -> str:
    """'left' or 'right' for a 2-D shape, following galore-torch's proj_type.

    std projects the shorter side away (left when m < n), reverse_std the longer one.
    """
    m, n = shape
    if proj_side == "left" or proj_side == "right":
        return proj_side
    if proj_side == "std":
        return "right" if m >= n else "left"
    return "left" if m >= n else "right"


def fast_16bit_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` multiplies `dtype` (bf16 or fp16) matrices faster than fp32 ones: a GPU's tensor cores, or
    for bf16 a CPU with AVX512-BF16 or AMX. Elsewhere torch's CPU bf16 product is emulated, and several to
    ~80x slower than fp32 (muon.py measured it)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                     "_is_amx_tile_supported"))


def matmul_dtype(proj_dtype: str, grad_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of an orthonormal projection's matrix products (``down``, and ``up`` of the direction).

    ``fp32``: the gradient and the basis read in fp32 (fp64 for an fp64 gradient): exact products, fp32 sums.
    ``grad``: a bf16 or fp16 gradient's own dtype, as galore-torch projects. The products of a 16-bit gradient and
    the 16-bit stored basis are the same values, the sums still fp32 inside BLAS and cuBLAS, but each result is
    rounded to 16 bits (the subspace gradient's and the lifted update's relative error ~2^-9), in exchange for
    16-bit matrix units: 3.6x the fp32 rate on a CPU core with AVX512-BF16 (a 2-core AMD EPYC, one thread), a
    GPU's tensor cores. ``auto``: ``grad`` where ``fast_16bit_matmul`` says the device has such units, else fp32.
    An fp32 gradient is projected in fp32 under every setting."""
    if grad_dtype in (torch.bfloat16, torch.float16) and (
            proj_dtype == "grad" or (proj_dtype == "auto" and fast_16bit_matmul(grad_dtype, device))):
        return grad_dtype
    return torch.float64 if grad_dtype == torch.float64 else torch.float32


def subspace_rank(shape: torch.Size, projector: str, side: str | None, rank: int | None,
                  density: float | None) -> int:
    """The number of kept directions (or coordinates) for a 2-D shape, clamped to the matrix."""
    m, n = shape
    if projector in ORTHO_PROJECTORS:
        dim = m if side == "left" else n
        if projector != "random":
            dim = min(dim, m, n)  # a decomposition has only min(m, n) singular vectors
    elif projector == "columns":
        dim = n
    else:  # rows
        dim = m
    if rank is not None:
        return max(0, min(int(rank), dim))
    return max(0, min(dim, int(round(float(density) * dim))))


# ----------------------------------------------------------------------------------------------------------------
# bases


def svd_basis(g: Tensor, r: int, side: str) -> Tensor:
    """Top-r singular vectors of g (fp32) on `side`: (m, r) left or (n, r) right."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u[:, :r].contiguous() if side == "left" else vh[:r].transpose(0, 1).contiguous()


def randomized_basis(g: Tensor, r: int, side: str, gen: torch.Generator, oversample: int = 8,
                     power_iters: int = 2) -> Tensor:
    """Approximate top-r singular vectors of g by a randomized range finder.

    g: (m, n) fp32. Sketch Y = A Omega with k = r + oversample Gaussian columns, sharpen it with `power_iters`
    rounds of A A^T (re-orthonormalised each time to keep it stable), then take the exact SVD of the small
    k x (other side) projection to rotate the sketch onto the singular vectors.
    """
    a = g if side == "left" else g.transpose(0, 1)  # (d, e): the basis spans a's column space
    d, e = a.shape
    k = min(r + oversample, d, e)
    omega = torch.randn(e, k, generator=gen, device=g.device, dtype=g.dtype)
    y = torch.linalg.qr(a @ omega).Q  # (d, k)
    for _ in range(power_iters):
        z = torch.linalg.qr(a.transpose(0, 1) @ y).Q  # (e, k)
        y = torch.linalg.qr(a @ z).Q  # (d, k)
    b = y.transpose(0, 1) @ a  # (k, e)
    ub = torch.linalg.svd(b, full_matrices=False).U  # (k, k)
    return (y @ ub[:, :r]).contiguous()


def random_basis(dim: int, r: int, gen: torch.Generator, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """A seeded (dim, r) matrix with orthonormal columns (QR of a Gaussian matrix, signs fixed by R's diagonal)."""
    q, rr = torch.linalg.qr(torch.randn(dim, r, generator=gen, device=device, dtype=dtype))
    signs = torch.sign(torch.diagonal(rr)).where(torch.diagonal(rr) != 0, torch.ones((), device=device))
    return (q * signs).contiguous()  # QR's Q is column-major: store row-major, as a checkpoint reloads it


def random_coordinates(dim: int, r: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """A seeded sorted subset of r indices out of dim (int64)."""
    return torch.randperm(dim, generator=gen, device=device)[:r].sort().values


# ----------------------------------------------------------------------------------------------------------------
# moving between the full space and the subspace


def down(projector: str, side: str | None, g: Tensor, basis: Tensor) -> Tensor:
    """Project g (m, n) into the subspace: (r, n) or (m, r)."""
    if projector in ORTHO_PROJECTORS:
        q = basis if basis.dtype == g.dtype else basis.to(g.dtype)
        return q.transpose(0, 1) @ g if side == "left" else g @ q
    if projector == "columns":
        return g.index_select(1, basis)
    return g.index_select(0, basis)  # rows


def up(projector: str, side: str | None, low: Tensor, basis: Tensor, shape: torch.Size) -> Tensor:
    """Map a subspace tensor back to the full (m, n) space (zero outside the subspace)."""
    if projector in ORTHO_PROJECTORS:
        q = basis if basis.dtype == low.dtype else basis.to(low.dtype)
        return q @ low if side == "left" else low @ q.transpose(0, 1)
    full = torch.zeros(shape, dtype=low.dtype, device=low.device)
    dim = 1 if projector == "columns" else 0
    return full.index_copy_(dim, basis, low)


def residual(projector: str, side: str | None, g: Tensor, low: Tensor, basis: Tensor) -> Tensor:
    """g minus its part inside the subspace."""
    if projector in ORTHO_PROJECTORS:
        # -up + g is g - up exactly (IEEE subtraction adds the negation), in up's own storage
        return up(projector, side, low, basis, g.shape).neg_().add_(g)
    dim = 1 if projector == "columns" else 0
    return g.index_fill(dim, basis, 0.0)


def window_axis(projector: str, side: str | None) -> int:
    """The axis of a (m, n) gradient that `projector` does not mix: 0 (rows) for a right projection and for
    ``columns``, 1 (columns) for a left projection and for ``rows``. A slice of the gradient along it projects on
    its own, with the same basis: ``down`` of rows a:b of G are rows a:b of ``down(G)`` (columns a:b for axis 1),
    and ``up`` and ``residual`` of those rows are rows a:b of the whole tensor's, so a step can walk the weight in
    windows of such slices (``windowed.projected``)."""
    if projector in ORTHO_PROJECTORS:
        return 0 if side == "right" else 1
    return 0 if projector == "columns" else 1


def rotate(projector: str, side: str | None, old: Tensor, new: Tensor, moment: Tensor, squared: bool) -> Tensor:
    """Carry a subspace moment from the old basis into the new one (on_refresh='project').

    For orthonormal bases the change of coordinates is R = Q_new^T Q_old (r x r): m' = R m (left) or m R^T (right),
    as LDAdam does (Robert et al., arXiv 2410.16103). A second moment is a per-coordinate variance, and for
    independent coordinates the variance of R x is (R * R) v: that is what `squared` selects. For coordinate
    subsets R is a selection: indices kept across the refresh keep their moments, new ones start at zero.
    """
    if projector in ORTHO_PROJECTORS:
        rot = new.to(moment.dtype).transpose(0, 1) @ old.to(moment.dtype)  # (r, r)
        if squared:
            rot = rot * rot
        return rot @ moment if side == "left" else moment @ rot.transpose(0, 1)
    dim = 1 if projector == "columns" else 0
    pos = torch.searchsorted(old, new).clamp_(max=old.numel() - 1)
    kept = old[pos] == new
    taken = moment.index_select(dim, pos)
    shape = [1, 1]
    shape[dim] = -1
    return taken * kept.view(shape).to(moment.dtype)


# ----------------------------------------------------------------------------------------------------------------
# block schedule


def active_blocks(num_blocks: int, density: float, refresh_index: int, order: str, seed: int) -> list[int]:
    """Positions (within the group) of the blocks that are state-full during refresh period `refresh_index`.

    k = round(density * num_blocks) blocks are active at once. ascending / descending walk through the blocks in
    windows of k, wrapping around, so that every block gets its turn; random draws k blocks from a permutation
    seeded by (seed, refresh_index). A pure function: nothing to store, the same on every rank.
    """
    if num_blocks == 0:
        return []
    k = min(num_blocks, int(round(density * num_blocks)))
    if k == 0:
        return []
    if order == "random":
        perm = torch.randperm(num_blocks, generator=generator(torch.device("cpu"), seed, refresh_index))
        return sorted(perm[:k].tolist())
    start = (refresh_index * k) % num_blocks
    chosen = [(start + i) % num_blocks for i in range(k)]
    if order == "descending":
        chosen = [num_blocks - 1 - c for c in chosen]
    return sorted(chosen)


def refresh_due(step: int, update_gap: int, phase: int = 0) -> bool:
    """True at the steps where the subspace is chosen anew: 1 + phase, 1 + phase + gap, ... (phase 0: galore-torch's
    iter % gap == 0; a staggered refresh's phase: ``subspace.refresh_phase``)."""
    return step - 1 >= phase and (step - 1 - phase) % update_gap == 0


def refresh_index(step: int, update_gap: int, phase: int = 0) -> int:
    """Which refresh period `step` lies in (-1 before a staggered parameter's first phase)."""
    return (step - 1 - phase) // update_gap



def subspace_shape(projector: str, side: str | None, shape: torch.Size, r: int) -> torch.Size:
    """The shape of a (m, n) parameter's subspace tensor (its projected gradient and moments) at `r` directions or
    coordinates."""
    m, n = shape
    if projector in ORTHO_PROJECTORS:
        return torch.Size((r, n) if side == "left" else (m, r))
    return torch.Size((m, r) if projector == "columns" else (r, n))
