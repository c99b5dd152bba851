"""Muon: momentum orthogonalized by a Newton-Schulz iteration, for 2-D weights.

Muon (K. Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/; at LLM scale: J. Liu et al., "Muon is Scalable for LLM Training"
(Moonlight), arXiv 2502.16982) keeps one moment per weight, a momentum buffer B, and steps along an approximation
of its orthogonal (polar) factor: for B = U S V^T, the update is about U V^T, every singular value set to ~1. It is
steepest descent under the spectral norm of the layer. ``SlimOptimizer`` runs it as ``rule="muon"``: the buffer is
a moment like any other (state key ``momentum_buffer``, role "m"), so it is stored through the group's m codec
(fp32, bf16, int8, int4, ternary; 8-bit Muon holds about 1 byte per parameter).

Details: docs/modules.md, ``slimopt.optim.algorithm.muon``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

__all__ = ["DEFAULTS", "NS_COEFFICIENTS", "ADJUST_LR_FNS", "NS_DTYPES", "validate", "orthogonalize", "lr_ratio",
           "momentum_update", "direction", "iteration_dtype", "scratch_bytes", "orthogonalize_many"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, torch.optim.Muon's default
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # None means "original", as in torch
NS_DTYPES = ("auto", "bf16", "fp32")

DEFAULTS: dict[str, Any] = dict(
    nesterov=True,
    ns_steps=5,
    ns_coefficients=NS_COEFFICIENTS,
    ns_eps=1e-7,
    ns_dtype="auto",
    adjust_lr_fn="original",
)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def validate(group: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first invalid Muon setting of a parameter group and what is allowed; under
    ``rule="muon"``, also a parameter that is not 2-D (Muon orthogonalizes matrices)."""
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"ns_steps (Newton-Schulz iterations) must be an integer in [0, 99], got {steps!r}")
    coeffs = group["ns_coefficients"]
    if not isinstance(coeffs, (tuple, list)) or len(coeffs) != 3 or not all(_is_number(c) for c in coeffs):
        raise ValueError(f"ns_coefficients must be three finite numbers (a, b, c), got {coeffs!r}")
    eps = group["ns_eps"]
    if not _is_number(eps) or not float(eps) > 0:
        raise ValueError(f"ns_eps must be a finite number > 0, got {eps!r}")
    if group["ns_dtype"] not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}; got {group['ns_dtype']!r}")
    if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {', '.join(ADJUST_LR_FNS)} (or None: original); "
                         f"got {group['adjust_lr_fn']!r}")
    if group.get("rule") == "muon":
        for p in group.get("params", ()):
            if p.dim() != 2:
                raise ValueError(f"rule 'muon' orthogonalizes 2-D weights; a parameter of shape {tuple(p.shape)} "
                                 "is in its group: give it another rule (slimopt.build(model, 'muon') puts "
                                 "embeddings, norms, biases and the head in AdamW)")


def iteration_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype the Newton-Schulz iteration runs in for ``ns_dtype=setting`` on `device`."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def orthogonalize(u: Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """~U V^T for u = U S V^T (2-D), by `steps` quintic Newton-Schulz iterations in `dtype`; u is not modified.

    Returns a tensor of u's shape in `dtype` (possibly a transposed view).
    """
    if u.dim() != 2:
        raise ValueError(f"Muon orthogonalizes 2-D matrices, got shape {tuple(u.shape)}")
    x = u.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: the Gram matrix x x^T is the smaller side
    # scale so that every singular value is <= 1 (the Frobenius norm bounds the spectral one); a new tensor,
    # so u (or a bf16 u, which to() returns as it is) stays untouched
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):  # each iterate rebound here, so only the current one and the next are alive
        x = _newton_schulz_step(x, coefficients)
    return x.T if tall else x


def _newton_schulz_step(x: Tensor, coefficients) -> Tensor:
    """One quintic iteration of a wide matrix (k, l) or of a stack of them (b, k, l)."""
    a, b, c = coefficients
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm  # one kernel a product for a whole stack
    gram = x @ x.mT  # (k, k)
    poly = addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
    return addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X: singular values s -> a s + b s^3 + c s^5


def orthogonalize_many(us: list[Tensor], coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
                       dtype: torch.dtype = torch.bfloat16, stack: bool | None = None) -> Iterable[Tensor]:
    """``orthogonalize`` of each 2-D matrix in `us`, with `stack` the matrices of one shape stacked into one
    batched product chain (bmm / baddbmm: one kernel a product for the stack, not one a matrix). stack None: on
    CUDA, where it saves launches; a CPU core runs it no faster (docs/distributed.md), and a batched product need
    not round as the per-matrix one on every processor, so a CPU keeps one process's and torch.optim.Muon's bits.
    A stacked result equals its own ``orthogonalize`` to rounding (bit for bit on the CPU tests/test_muon.py ran
    on). Returns the results in `us`' order, each in `dtype`; unstacked, one at a time as they are taken (so a
    caller that writes each result before taking the next holds one at a time)."""
    out: list[Tensor | None] = [None] * len(us)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, u in enumerate(us):
        if u.dim() != 2:
            raise ValueError(f"Muon orthogonalizes 2-D matrices, got shape {tuple(u.shape)}")
        by_shape.setdefault(tuple(u.shape), []).append(i)
    if stack is None:
        stack = bool(us) and us[0].is_cuda
    if not stack:
        return (orthogonalize(u, coefficients, steps, eps, dtype) for u in us)
    for shape, idx in by_shape.items():
        if len(idx) == 1:
            out[idx[0]] = orthogonalize(us[idx[0]], coefficients, steps, eps, dtype)
            continue
        x = torch.stack([us[i].to(dtype) for i in idx])  # (k, A, B)
        tall = shape[0] > shape[1]
        if tall:
            x = x.transpose(1, 2)  # (k, B, A): the wide orientation, as ``orthogonalize``
        # each matrix's own norm, computed as ``orthogonalize`` computes it (a batched norm sums in another order)
        norms = torch.stack([m.norm() for m in x]).clamp(min=eps)
        x = x / norms.view(-1, 1, 1)
        for _ in range(steps):
            x = _newton_schulz_step(x, coefficients)
        for j, i in enumerate(idx):
            out[i] = x[j].T if tall else x[j]
    return out  # type: ignore[return-value]


def lr_ratio(adjust_lr_fn: str | None, shape) -> float:
    """The factor s of the step lr * s * O for a parameter of `shape` (A, B) (torch.optim.Muon's adjustment)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


# What the step of one A x B weight allocates on top of its weight, gradient and state (k = min(A, B)), measured with
# torch's MemTracker on CPU (square, 1:2, 1:4, 1:8 and 1:16 shapes, tall and wide; fp32 and bf16 weights, every m
# codec, both iteration dtypes; tests/test_muon.py checks the planner's peak against it). The step stores the
# momentum first, then iterates (routes/torch/muon_batch.py):
# - the iteration: the matrix waiting in the iteration's dtype, the iterate before and after a step and the two
#   k x k products: 8 A B + 8 k^2 bytes in fp32, max(4 A B, 2 A B + 4 k^2) in bf16; plus 4 A B for a decoded momentum
#   that is not the stored tensor (of an fp32 weight: every codec but fp32); a bf16 weight, whose momentum is decoded
#   beside the gradient's fp32 copy and the look-ahead before the iteration, and whose write rounds through fp32:
#   max(12 A B, the fp32 weight's figure + 2 A B);
# - storing the momentum through a quantizing codec: bytes per element below (+6 for a bf16 weight), the codes'
#   temporaries: the same as an AdamW step's in windowed.py minus 12, the second moment's share.
# Matrices waiting for a batched iteration come on top (``muon_batch.peak_bytes``).
_ENCODE_PER_ELEMENT = {"int8": 22, "int4": 22, "ternary_sr": 50, "ternary_ef": 66}


def scratch_bytes(shape, weight_dtype: torch.dtype, ns_dtype: torch.dtype, m_codec: str) -> int:
    """Bytes the Muon step of a (A, B) weight allocates while it runs (the planner's estimate; see above).
    m_codec: the momentum codec's scratch kind (``Codec.scratch_kind``: ``fp32``, ``bf16``, ``int8``, ...)."""
    rows, cols = shape[0], shape[1]
    area, k2 = rows * cols, min(rows, cols) ** 2
    narrow = weight_dtype not in (torch.float32, torch.float64)
    iterate = 8 * area + 8 * k2 if ns_dtype == torch.float32 else max(4 * area, 2 * area + 4 * k2)
    iterate += 4 * area if m_codec not in ("fp32", "fp64") and not narrow else 0
    if narrow:
        iterate = max(12 * area, iterate + 2 * area)
    encode = (_ENCODE_PER_ELEMENT[m_codec] + (6 if narrow else 0)) * area if m_codec in _ENCODE_PER_ELEMENT else 0
    return max(iterate, encode)


def momentum_update(g: Tensor, buf: Tensor, group: Mapping[str, Any]) -> Tensor:
    """Update the fp32 momentum buffer in place and return the matrix to orthogonalize (Nesterov's look-ahead
    G + mu (B - G), or B itself)."""
    mu = float(group["momentum"])
    buf.lerp_(g, 1 - mu)
    return g.lerp(buf, mu) if group["nesterov"] else buf


def direction(g: Tensor, buf: Tensor, group: Mapping[str, Any], shape=None) -> tuple[Tensor, float]:
    """(d, c) of ``rules.direction`` for rule "muon": d = NS(momentum) in fp32, c = ``lr_ratio`` of `shape` (the
    parameter's; g's own shape when None). A matrix whose rows are spread over ranks: ``muon_sharded``."""
    dtype = iteration_dtype(group["ns_dtype"], g.device)
    u = momentum_update(g, buf, group)
    o = orthogonalize(u, group["ns_coefficients"], group["ns_steps"], float(group["ns_eps"]), dtype)
    return o.float(), lr_ratio(group["adjust_lr_fn"], g.shape if shape is None else shape)
