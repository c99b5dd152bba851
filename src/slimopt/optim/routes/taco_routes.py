"""TACO's step (arXiv 2610.02199; the arithmetic in ``taco.py``) through its fast routes.

- ``c_kernel_step``: the whole step at one component a column in one C call (``native.taco_one``): one pass over
  the gradient, one entry a column of the weight written;
- ``queue_triton``: the same as Triton kernels on a CUDA weight, batched by shape (``triton_taco.py``);
- ``sparse_step``: ``taco.sparse_update`` then ``taco.apply_sparse`` as tensor operations, the one-candidate
  search in a kernel where one applies (``search_for``): one entry a column written, not a dense pass;
- ``sharded_step``: the sparse step of a row shard, the columns' max-loc over ranks (``sharded_taco.py``).

``choice.py`` decides which one a weight takes.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import torch
from torch import Tensor

from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.budget import ROUNDING_SCRATCH, window_elems
from slimopt.optim.algorithm.rules import rounding_of
from slimopt.optim.distributed import sharded_taco
from slimopt.optim.distributed.shardcomm import Rows
from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.triton import triton_taco

__all__ = ["search_for", "scratch_bytes", "c_kernel_step", "queue_triton", "sparse_step", "sharded_step"]


def search_for(group: Mapping[str, Any], g: Tensor) -> taco.Search | None:
    """The one-candidate column search of the 2-D gradient g in one pass, where a kernel takes it (a fused group;
    the C kernel for a CPU gradient, Triton for a CUDA one), else None (``taco.sparse_update`` searches row windows
    as tensor operations)."""
    if not g.is_contiguous():
        return None
    if native.column_best_applies(group, g.dtype, g.device.type):
        return native.column_best
    if triton_taco.column_best_applies(group, g):
        return triton_taco.column_best
    return None


def scratch_bytes(shape: torch.Size | tuple[int, ...], group: Mapping[str, Any], dtype: torch.dtype,
                  device_type: str) -> int:
    """What one fused TACO step of a `shape` weight on `device_type` allocates at most: in the CPU kernel
    (``c_kernel_step``) its per-column buffers (a step that keeps a NaN adds the tensor operations' few per-column
    ones); otherwise a window of the candidate search (none in the CPU kernel's one-pass search) and its per-column
    bookkeeping, or, for a bf16 weight written with stochastic rounding or Kahan compensation under weight decay,
    the decay pass's window if that is larger."""
    m, n = shape
    if native.taco_kernel_applies(group, dtype, device_type):  # the whole step in the kernel
        return native.TACO_COLUMN_SCRATCH * n
    rows = max(2 * max(1, min(group["taco_k"], m)) + 1,
               window_elems(m * n, n, taco._CANDIDATE_SCRATCH) // n)
    search = taco._CANDIDATE_SCRATCH * min(m, rows) * n
    if group["taco_k"] <= 1 and native.column_best_applies(group, dtype, device_type):
        search = 0
    search += (taco._COLUMN_SCRATCH * max(1, group["taco_k"]) + 8) * n
    rounding = rounding_of(group, torch.empty(0, dtype=dtype, device="meta"))
    if rounding == "nearest" or float(group["weight_decay"]) == 0.0:
        return search
    window = window_elems(m * n, n, ROUNDING_SCRATCH[rounding])  # the rows apply_sparse decays at a time
    return max(search, taco._DECAY_SCRATCH[rounding] * window + taco._DECAY_COLUMN_SCRATCH * n)


def _one_component(p: Tensor, state: MutableMapping[str, Tensor], group: Mapping[str, Any], shape=None) -> bool:
    """The stored component of p (one a column; of the whole weight's `shape`, p's own by default) created where
    missing; whether the kernels can read it through its pointers (contiguous)."""
    shape = p.shape if shape is None else shape
    n = shape[1]
    if "taco_rows" not in state or state["taco_rows"].shape != (1, n):
        state.update(taco.init_state(shape, 1, group["taco_format"], group["taco_scale_dtype"], p.device))
    return all(state[key].is_contiguous() for key in taco.KEYS)


def _coef(group: Mapping[str, Any], shape) -> float:
    return float(group["taco_alpha"]) * taco.dimension_factor(shape, group["taco_norm"])


def c_kernel_step(p: Tensor, grad: Tensor, state: MutableMapping[str, Tensor], group: Mapping[str, Any],
                  stream: Any = None) -> None:
    """``taco.sparse_update`` then ``taco.apply_sparse`` of the (m, n) weight p at taco_k 1 in one C call
    (``native.taco_applies``); a kept NaN is stored and applied as the tensor operations do."""
    if not _one_component(p, state, group):
        sparse_step(p, grad, state, group, stream)
        return
    c = _coef(group, p.shape)
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    kept = native.taco_one(p, grad, state, float(group["taco_decay"]), lr, wd, c)
    if kept is not None:  # a NaN kept value: stored and applied as the tensor operations do
        rows, values = kept
        taco._encode(state, rows, values)
        taco.apply_sparse(p, rows, values.sign(), c, group)


def queue_triton(p: Tensor, grad: Tensor, state: MutableMapping[str, Tensor], group: Mapping[str, Any],
                 batch: Any, stream: Any = None) -> None:
    """p's step as Triton kernels (``triton_taco.applies`` holds), queued in `batch` to run with the other
    weights of its shape at the end of ``step()``, the tensor operations standing by where the kernels fail."""
    if not _one_component(p, state, group):
        sparse_step(p, grad, state, group, stream)
        return
    launch = triton_taco.prepare(p, grad, state, float(group["taco_decay"]), float(group["lr"]),
                                 float(group["weight_decay"]), _coef(group, p.shape), group)

    def tensor_ops() -> None:
        sparse_step(p, grad, state, group, stream)

    batch.launch(launch, tensor_ops)


def sparse_step(p: Tensor, grad: Tensor, state: MutableMapping[str, Tensor], group: Mapping[str, Any],
                stream: Any = None, comp: Tensor | None = None) -> None:
    """``taco.sparse_update`` then ``taco.apply_sparse`` as tensor operations (the search in a kernel where one
    takes it): one entry a column written. stream: the weight's stochastic rounding stream, where it has one;
    comp: its Kahan compensation."""
    rows, signs, c = taco.sparse_update(state, grad, group, p.shape, search_for(group, grad))
    taco.apply_sparse(p, rows, signs, c, group, comp, stream)


def sharded_step(p: Tensor, grad: Tensor, state: MutableMapping[str, Tensor], group: Mapping[str, Any], shape,
                 rows: Rows, batch: Any) -> None:
    """The sparse step at taco_k 1, nearest rounding, of this rank's rows p of a (rows.total, n) weight
    (``sharded_taco``): every column's history gathered from the ranks' column chunks, the local search and the
    keys in one C call where the kernel takes the shard (else tensor operations, the search in a kernel where one
    takes it); the keys queued in `batch` for one MAX all-reduce with every other such weight's at the end of
    ``step()``, after which the kept component is stored (this rank's columns of it kept) and one entry a column
    written where this rank holds its row."""
    beta, lr, wd = float(group["taco_decay"]), float(group["lr"]), float(group["weight_decay"])
    c = _coef(group, shape)
    whole = sharded_taco.record(state, group, shape[0], shape[1], 1, rows, p.device, batch.taco_records)
    if native.taco_declines(group, p, grad) is None and all(whole[key].is_contiguous() for key in taco.KEYS):
        shard = native.TacoShard(p, grad, whole, rows.start)
        keys = shard.keys(grad)

        def finish(reduced: Tensor) -> None:
            nan = shard.step(reduced, beta, lr, wd, c)
            if nan is not None:  # a NaN kept value: stored and applied as the tensor operations do
                kept_rows, values = nan
                taco._encode(whole, kept_rows, values)
                sharded_taco.apply_local(p, kept_rows, values.sign(), c, group, rows)
            sharded_taco.keep_columns(state, whole, rows)

        batch.reduce(rows, keys, "max", finish)
        return
    keys = sharded_taco.local_keys(whole, grad, rows, search_for(group, grad))

    def finish_ops(reduced: Tensor) -> None:
        kept_rows, signs, coef = sharded_taco.finish_k1(whole, reduced, group, shape)
        sharded_taco.apply_local(p, kept_rows, signs, coef, group, rows)
        sharded_taco.keep_columns(state, whole, rows)

    batch.reduce(rows, keys, "max", finish_ops)
