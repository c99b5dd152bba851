"""TACO's step (Jiang et al., arXiv 2610.02199) at one component a column as Triton kernels on CUDA weights: the
GPU's counterpart of the C kernel's ``taco_one`` (``native.py``), the same arithmetic as ``taco.sparse_update``
then ``taco.apply_sparse`` at nearest rounding.

Every 2-D weight of one shape, dtype and setting steps in the same launches (``prepare`` makes a weight's row of
addresses, ``multi_tensor.Batch`` queues them during ``step()``, ``run`` steps them together), so that a step
launches per shape, not per weight (LLaMA-1B: some 170 weights in three shapes): ``taco_columns`` finds the rows
each weight stores, to hide from the search; ``column_best`` searches every column of every gradient over row
chunks; the weights decay (one multi-tensor multiply); ``taco_columns`` keeps the larger of the stored and the
found component, stores it (fp8 or int8 code, scale, row) and moves the weight at the kept rows. Scratch is the
hidden rows (k, n) and the search's keys (k, chunks, n), int64: at most ``triton_step._SCRATCH_BYTES`` a launch
(``batch_size``), as the element-wise step's.

Details: docs/modules.md, ``slimopt.optim.routes.triton.triton_taco``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.triton import triton_step
from slimopt.optim.routes.triton.triton_step import (
    _COMPILED,
    _DTYPES,
    _OPTIONS,
    _PLAIN,
    _cdiv,
    _device_ok,
    _failed,
    _table,
    _triton,
    available,
)

__all__ = ["column_best_applies", "column_best", "declines", "applies", "Launch", "prepare", "batch_size", "run"]

_CHUNK, _BLOCK_N = 64, 128  # rows and columns a program of the column search
_TACO_BLOCK = 256  # columns a program of taco_columns
_FP8_VALUES: dict[torch.device, Tensor] = {}
# the kernel's A_* for a stored component's rows (the narrowest integer type that holds m: taco.init_state)
_ROWS = {torch.uint8: 2, torch.int16: 1, torch.int32: 4, torch.int64: 5}


def column_best_applies(group: dict[str, Any], g: Tensor) -> bool:
    """Whether TACO's one-candidate search of the 2-D gradient g runs as a Triton kernel (``column_best``)."""
    return (bool(group["fused"]) and _device_ok(g) and g.dtype in _DTYPES
            and g.dim() == 2 and g.is_contiguous() and available()
            and ("column_best", g.dtype, g.device.type) not in _failed)


def column_best(g: Tensor, hidden: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """``native.column_best`` on the GPU: (rows (1, n) int64, |g| there (1, n) fp32, -1 where no candidate is
    valid), from one launch over (column blocks, row chunks) and a max over the chunks' packed (|g|, row) keys;
    None (after one warning) where the kernel failed to compile or launch. hidden: (n,) int64 or None."""
    kernels = _triton()
    m, n = g.shape
    chunks = _cdiv(m, _CHUNK)
    out = torch.empty((chunks, n), dtype=torch.int64, device=g.device)
    table = _table([_Row((g.data_ptr(), 0, 0, 0, 0), g.device)])  # kept: no copy while the same g is searched
    h = hidden.contiguous() if hidden is not None else out  # a placeholder pointer when nothing is hidden
    try:
        kernels.column_best[(_cdiv(n, _BLOCK_N), chunks, 1)](
            table, h, out, m, n, chunks, CHUNK=_CHUNK, HAS_HIDDEN=hidden is not None,
            G_BF16=g.dtype == torch.bfloat16, BLOCK_N=_BLOCK_N, **_OPTIONS)
    except Exception as exc:
        _fail(("column_best", g.dtype, g.device.type), exc, f"the Triton column search of TACO failed for a {g.dtype} "
              "gradient")
        return None
    best = out.amax(dim=0, keepdim=True)  # (1, n): the largest |g|, then the smallest row
    key = best >> 32
    rows = 4294967295 - (best & 4294967295)
    absval = torch.where((key >= 0) & (key <= 0x7F800000), key.to(torch.int32).view(torch.float32), -1.0)
    return rows, absval


class _Row:
    """A table row of one gradient alone (``column_best``), as ``triton_step._table`` reads it."""

    __slots__ = ("row", "device")

    def __init__(self, row: tuple, device: torch.device) -> None:
        self.row, self.device = row, device


def declines(group: dict[str, Any], p: Tensor, grad: Tensor) -> str | None:
    """Why TACO's whole step at taco_k 1 of the 2-D weight p does not run as Triton kernels, or None where it
    does: a fused group, a CUDA weight (or a CPU one under the interpreter hook) of fp32 or bf16 written to
    nearest, a gradient of fp32 or bf16, both contiguous plain tensors; the C kernel's conditions
    (``native.taco_declines``)."""
    if not group["fused"]:
        return "fused=False"
    if group["taco_k"] != 1:
        return f"taco_k {group['taco_k']}"
    if p.dim() != 2 or grad.shape != p.shape:
        return "not a 2-D weight with its gradient"
    if not _device_ok(p):
        return f"a {p.device.type} weight"
    if p.dtype not in _DTYPES or grad.dtype not in _DTYPES:
        return f"a {p.dtype} weight with a {grad.dtype} gradient"
    if group["param_rounding"] != "nearest" and p.dtype != torch.float32:
        return f"param_rounding {group['param_rounding']!r}"
    if not (type(p) in _PLAIN and type(grad) in _PLAIN and p.is_contiguous() and grad.is_contiguous()):
        return "not contiguous plain tensors"
    if not available():
        return "triton is not installed or SLIMOPT_TRITON=0"
    if _kind(p, grad) in _failed:
        return "this kernel failed earlier in this process"
    return None


def applies(group: dict[str, Any], p: Tensor, grad: Tensor) -> bool:
    return declines(group, p, grad) is None


def _kind(p: Tensor, grad: Tensor) -> tuple:
    """What a failure is recorded under (``triton_step.fallbacks``)."""
    return ("taco", p.dtype, grad.dtype, p.device.type)


class Launch:
    """One weight's part of TACO's launches (``prepare``): its row of addresses (g, p, codes, scales, rows), what
    selects the launches it can share (``key``: the group, the shape, the dtypes, the step's scalars), and the
    weight itself, which ``run`` decays."""

    __slots__ = ("key", "row", "device", "p", "shape", "scalars", "flags", "kind")

    def __init__(self, key, row, device, p, shape, scalars, flags, kind):
        self.key, self.row, self.device, self.p, self.shape = key, row, device, p, shape
        self.scalars, self.flags, self.kind = scalars, flags, kind


def prepare(p: Tensor, grad: Tensor, state: dict[str, Tensor], beta: float, lr: float, weight_decay: float,
            coef: float, group: dict[str, Any]) -> Launch:
    """p's TACO step (``taco.sparse_update`` then ``apply_sparse``) from grad and its stored component (state's
    ``taco_rows``, ``taco_values``, ``taco_absmax``, each (1, n) and contiguous), ready to run with the other
    weights of its ``key``: the decay factor 1 - lr weight_decay, the move -lr coef at the kept rows."""
    rows, codes, absmax = state["taco_rows"], state["taco_values"], state["taco_absmax"]
    fp8 = codes.dtype == torch.float8_e4m3fn
    scalars = (448.0 if fp8 else 127.0, float(beta), float(1.0 - beta), float(-lr * coef), float(lr * weight_decay))
    flags = (fp8, absmax.dtype == torch.bfloat16, grad.dtype == torch.bfloat16, p.dtype == torch.bfloat16,
             _ROWS[rows.dtype])
    row = (grad.data_ptr(), p.data_ptr(), codes.data_ptr(), absmax.data_ptr(), rows.data_ptr())
    key = ("taco", id(group), tuple(p.shape), p.device, grad.dtype, flags, scalars)
    return Launch(key, row, p.device, p, tuple(p.shape), scalars, flags, _kind(p, grad))


def batch_size(launch: Launch) -> int:
    """How many weights of `launch`'s key one set of launches may step: as many as keep the scratch (the hidden
    rows and the search's keys, int64) within ``triton_step._SCRATCH_BYTES``."""
    m, n = launch.shape
    return max(1, triton_step._SCRATCH_BYTES // (8 * n * (1 + _cdiv(m, _CHUNK))))


def run(launches: list[Launch]) -> bool | None:
    """Step every weight of `launches` (all of one ``key``): three kernel launches and one multi-tensor decay
    whatever their number. Returns True, or None (after one warning; the caller then runs each weight's tensor
    operations, and so does every later step of this kind) where a kernel failed to compile or launch, as
    ``triton_step.run`` does."""
    kernels = _triton()
    first = launches[0]
    kind = first.kind
    if kind in _failed:  # failed already, in a launch queued in the same step
        return None
    (m, n), k, device = first.shape, len(launches), first.device
    top, beta, w, alpha, decay = first.scalars
    fp8, scale_bf16, g_bf16, p_bf16, rows_kind = first.flags
    if device not in _FP8_VALUES:
        _FP8_VALUES[device] = native._fp8_values().to(device)
    chunks = _cdiv(m, _CHUNK)
    hidden = torch.empty((k, n), dtype=torch.int64, device=device)
    keys = torch.empty((k, chunks, n), dtype=torch.int64, device=device)
    table = _table(launches)

    def columns(keep: bool, grid: tuple[int, int]) -> None:
        kernels.taco_columns[grid](
            table, _FP8_VALUES[device], hidden, keys, n, chunks, top, beta, w, alpha, KEEP=keep, FP8=fp8,
            SCALE_BF16=scale_bf16, G_BF16=g_bf16, P_BF16=p_bf16, ROWS=rows_kind, BLOCK_N=_TACO_BLOCK, **_OPTIONS)

    grid = (_cdiv(n, _TACO_BLOCK), k)
    try:
        if (kind, first.flags) not in _COMPILED:
            columns(True, (0, k))  # compiled and loaded, nothing run
            _COMPILED.add((kind, first.flags))
        columns(False, grid)
        kernels.column_best[(_cdiv(n, _BLOCK_N), chunks, k)](
            table, hidden, keys, m, n, chunks, CHUNK=_CHUNK, HAS_HIDDEN=True, G_BF16=g_bf16, BLOCK_N=_BLOCK_N,
            **_OPTIONS)
    except Exception as exc:  # nothing written but scratch
        _fail(kind, exc, f"the Triton TACO step failed for a {first.p.dtype} weight")
        return None
    if decay != 0.0:  # rules.decay, as apply_sparse decays before the entries move
        torch._foreach_mul_([x.p for x in launches], 1.0 - decay)
    columns(True, grid)
    return True


def _fail(kind: tuple, exc: Exception, what: str) -> None:
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _failed[kind] = why
    warnings.warn(f"slimopt: {what} ({why}); it runs as torch ops from now on", RuntimeWarning, stacklevel=4)
