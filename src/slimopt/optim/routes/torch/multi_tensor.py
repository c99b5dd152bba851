"""Multi-tensor steps: the parameters of a group whose update is a standard kernel, stepped in one call.

Some updates slimopt composes are exactly a kernel torch already ships (fused AdamW) or a one-pass kernel of
slimopt's: one call over a list of tensors replaces a dozen passes per tensor of the eager step.

Details: docs/modules.md, ``slimopt.optim.routes.torch.multi_tensor``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm.codecs import Bf16Codec, Fp32Codec
from slimopt.optim.distributed.shardcomm import gather_row_chunks, hold, reduce_scatter_rows
from slimopt.optim.routes import abi
from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.triton import triton_step, triton_taco
from slimopt.optim.routes.whole_queue import WholeQueue

__all__ = ["adamw_declines", "adamw_applies", "residual_declines", "residual_applies", "adamw_kernel_declines",
           "adamw_kernel_applies", "residual_kernel_declines", "residual_kernel_applies", "residual_scratch_bytes",
           "Batch"]

_DTYPES = (torch.float32, torch.bfloat16)
_DEVICES = ("cpu",)  # CUDA: the Triton kernels are the route there (torch's fused AdamW wants device step tensors)


def adamw_kernel_declines(group: dict[str, Any], dtype: torch.dtype, device_type: str,
                          codecs: list[tuple[str, Any]]) -> str | None:
    """Why a full-space state-full update of a `dtype` weight on `device_type` with these moment codecs is not
    torch's fused AdamW, or None where it is: rule adamw (or TACO's AdamW fallback), torch's eps placement, both
    moments stored plainly in the weight's dtype. (The planner asks this for weights it only describes.)"""
    if not group["fused"]:
        return "fused=False"
    if group["compile"]:
        return "compile=True takes the compiled step"
    if group["eps_placement"] != "torch":
        return f"eps_placement {group['eps_placement']!r} (torch's kernel adds eps after the bias correction)"
    if group["rule"] not in ("adamw", "taco"):
        return f"rule {group['rule']!r}"
    why = _weights_declined(group, dtype, device_type)
    if why:
        return why
    if [k for k, _ in codecs] != ["exp_avg", "exp_avg_sq"]:
        return "not AdamW's two moments"
    for _, c in codecs:
        if not ((isinstance(c, Fp32Codec) and c.dtype == dtype)
                or (isinstance(c, Bf16Codec) and not c.stochastic and dtype == torch.bfloat16)):
            return f"moments stored as {c.name}"
    return None


def adamw_kernel_applies(group: dict[str, Any], dtype: torch.dtype, device_type: str,
                         codecs: list[tuple[str, Any]]) -> bool:
    """``adamw_kernel_declines`` is None."""
    return adamw_kernel_declines(group, dtype, device_type, codecs) is None


def residual_kernel_declines(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> str | None:
    """Why a whole-tensor state-free update (an inactive block) of a `dtype` weight is not stepped here, or None."""
    if not group["fused"]:
        return "fused=False"
    if group["free_rule"] not in ("sign", "sgd"):
        return f"free_rule {group['free_rule']!r}"
    return _weights_declined(group, dtype, device_type)


def _weights_declined(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> str | None:
    """Why torch's multi-tensor kernels do not write `dtype` weights on `device_type` as the group asks, or None."""
    if device_type not in _DEVICES:
        return f"{device_type} weights take the Triton kernel"
    if dtype not in _DTYPES:
        return f"{dtype} weights"
    if not _rounds_nearest(group, dtype):
        return f"param_rounding {group['param_rounding']!r}"
    return None


def residual_kernel_applies(group: dict[str, Any], dtype: torch.dtype, device_type: str) -> bool:
    """``residual_kernel_declines`` is None."""
    return residual_kernel_declines(group, dtype, device_type) is None


def _rounds_nearest(group: dict[str, Any], dtype: torch.dtype) -> bool:
    """torch's kernels write a narrow weight with nearest rounding: other ``param_rounding`` takes the eager step."""
    return dtype == torch.float32 or group["param_rounding"] == "nearest"


def residual_scratch_bytes(group: dict[str, Any], p: Tensor) -> int:
    """What the residual step allocates at most for p (its gradient has p's dtype): nothing in the one-pass C
    kernel, else sign(grad) and its fp32 copy for a narrower gradient, or the fp32 copy alone for sgd."""
    if native.kernel_applies(group, p.dtype, p.device.type, []):
        return 0
    fp32 = 4 * p.numel() if p.dtype != torch.float32 else 0
    sign = p.numel() * p.element_size() if group["free_rule"] == "sign" else 0
    return sign + fp32


def _plain_tensors(p: Tensor, grad: Tensor) -> str | None:
    """Why p and grad are not tensors torch's multi-tensor kernels take (same dtype, dense, contiguous), or None."""
    if grad.dtype != p.dtype:
        return f"a {grad.dtype} gradient of a {p.dtype} weight"
    if grad.layout != torch.strided or not (p.is_contiguous() and grad.is_contiguous()):
        return "not contiguous"
    if type(p.data) is not Tensor:
        return f"a {type(p.data).__name__} weight"
    return None


def adamw_declines(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> str | None:
    """``adamw_kernel_declines`` for this weight and gradient (same dtype, dense, contiguous)."""
    return (adamw_kernel_declines(group, p.dtype, p.device.type, codecs) or _plain_tensors(p, grad))


def adamw_applies(group: dict[str, Any], p: Tensor, grad: Tensor, codecs: list[tuple[str, Any]]) -> bool:
    return adamw_declines(group, p, grad, codecs) is None


def residual_declines(group: dict[str, Any], p: Tensor, grad: Tensor) -> str | None:
    """``residual_kernel_declines`` for this weight and gradient (same dtype, dense, contiguous)."""
    return residual_kernel_declines(group, p.dtype, p.device.type) or _plain_tensors(p, grad)


def residual_applies(group: dict[str, Any], p: Tensor, grad: Tensor) -> bool:
    return residual_declines(group, p, grad) is None


class Batch:
    """The parameters queued during one ``step()``, run group by group at its end."""

    def __init__(self) -> None:
        # (group id, dtype) -> [params, grads, exp_avgs, exp_avg_sqs, moment steps]
        self._adamw: dict[tuple[int, torch.dtype], tuple[list[Tensor], ...]] = defaultdict(lambda: ([], [], [], [], []))
        self._resid: dict[tuple[int, torch.dtype], tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
        self._groups: dict[int, dict[str, Any]] = {}
        # triton_step.Launch.key -> [(launch, the tensor's eager step, for a kernel that fails)]
        self._launches: dict[tuple, list[tuple[Any, Callable[[], None]]]] = defaultdict(list)
        # all-reduces over a row shard's ranks: (rows, tensor, op, what to do with the result, whether it may finish
        # after the step), in the order queued
        self._reduces: list[tuple[Any, Tensor, str, Callable[[Tensor], None], bool]] = []
        # the all-reduces started by run() that finish after the step (``after_step``): the optimizer's to finish
        self.later: list = []
        # sums over ranks started already (asynchronous): (their work, what runs once each is done), in that order
        self._started: list[tuple[Any, Callable[[], None]]] = []
        self.whole = WholeQueue()  # whole-matrix work: Muon's iterations, FSDP2 refreshes (whole_queue.py)
        # row-split TACO weights' histories gathered at the start of the step (sharded_taco.prefetch): id(state) ->
        # every column's
        self.taco_records: dict[int, dict[str, Tensor]] = {}
        # row-split weights' right bases gathered at the start of the step (sharded_bases.gather_bases): id(this
        # rank's chunk) -> (the chunk, its version then, the whole basis)
        self.bases: dict[int, tuple[Tensor, int, Tensor]] = {}
        # a row shard's factored moments: every column mean, from the sums the last step all-reduced (settled at
        # the start of this one); id(the rank's chunk of them) -> (the chunk, its version then, every column mean)
        self.columns: dict[int, tuple[Tensor, int, Tensor]] = {}

    def hold_columns(self, written: list[tuple[Tensor, Tensor]]) -> None:
        """Hold every column mean of the factored moments whose chunks were just written ((chunk, every mean) each)
        for this step's windows (``sharded.ShardFactoredRows``): nothing is gathered to decode them."""
        self.columns.update(hold(written))

    def adamw(self, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict[str, Tensor]) -> None:
        """Queue p for a fused AdamW step; its ``moment_step`` is already counted for this step."""
        self._groups[id(group)] = group
        lists = self._adamw[(id(group), p.dtype)]
        for lst, t in zip(lists, (p, grad, state["exp_avg"], state["exp_avg_sq"], state["moment_step"])):
            lst.append(t)

    def residual(self, group: dict[str, Any], p: Tensor, grad: Tensor) -> None:
        """Queue p for its state-free update: decay, then ``p -= lr * free_scale * free_rule(grad)``."""
        self._groups[id(group)] = group
        params, grads = self._resid[(id(group), p.dtype)]
        params.append(p)
        grads.append(grad)

    def launch(self, launch: Any, eager: Callable[[], None]) -> None:
        """Queue a tensor's Triton step (``triton_step.prepare``, or ``triton_taco.prepare``), to run in one launch
        with the others of its key; eager: its step without the kernel, run instead where the launch fails."""
        self._launches[launch.key].append((launch, eager))

    def reduce(self, rows: Any, tensor: Tensor, op: str, finish: Callable[[Tensor], None],
               after_step: bool = False) -> None:
        """Queue an all-reduce of `tensor` over the ranks of `rows` (``shardcomm.Rows``; op "sum" or "max"), and
        `finish(result)` after it: the step's all-reduces of one group, op, dtype and device go as one (TACO's keys
        of every sharded weight: one collective a step, not one a weight). after_step: `finish` writes only what
        the next step reads first (a factored second moment's column means), so the all-reduce may run on during
        the next forward and backward: run() leaves it started in ``later``, for the optimizer to finish
        (``SlimOptimizer.settle``)."""
        self._reduces.append((rows, tensor, op, finish, after_step))

    def reduce_async(self, rows: Any, tensor: Tensor, then: Callable[[], Any]) -> None:
        """Start the sum of `tensor` over the ranks of `rows` now, in place and in the background, and run `then()`
        once it is done, at the end of the step: the rest of the step goes on meanwhile (a left projection's
        partial products: their round trips overlap the other parameters' steps). then() may ask for rows to be
        gathered (``_finish_started``)."""
        import torch.distributed as dist
        work = dist.all_reduce(tensor, group=rows.group, async_op=True) if rows.distributed else None
        self._started.append((work, then))

    def sum_rows_async(self, rows: Any, tensor: Tensor, then: Callable[[], Any]) -> None:
        """Start the sum over the ranks of `rows`' group of only this rank's rows of `tensor` (``rows``: a chunked
        split of its dim 0, ``sharded.chunks_of``), written into them, and run `then()` once it is done, at the
        end of the step: a reduce-scatter, half an all-reduce's traffic, where the rest of the step needs no other
        rows (a left projection whose moments are split by rows). then() may ask for rows to be gathered
        (``_finish_started``)."""
        work, mine = reduce_scatter_rows(tensor, rows)

        def write_then() -> Any:
            tensor[rows.start: rows.stop].copy_(mine[: rows.local])
            return then()
        self._started.append((work, write_then))

    def _finish_started(self) -> None:
        """Each started sum's `then()`, in order, once its sum is there. A then() that returns (this rank's rows t,
        their split, use) has t gathered whole with the others' in one all-gather (``gather_row_chunks``), and
        use(whole) runs after it: a left projection's direction rows, one collective a step instead of one a
        weight."""
        asked = []
        for work, then in self._started:
            if work is not None:
                work.wait()
            request = then()
            if request is not None:
                asked.append(request)
        self._started.clear()
        if asked:
            for (_, _, use), whole in zip(asked, gather_row_chunks([(t, rows) for t, rows, _ in asked])):
                use(whole)

    def _start_reduces(self) -> list:
        """Start the queued reduces in the background, one all-reduce a bucket (group, op, dtype, device), in the
        order every rank queued them: [(work, flat result, the bucket's items)]."""
        import torch.distributed as dist
        buckets: dict[tuple, list] = {}
        for item in self._reduces:  # every rank queues the same reduces in the same order: same buckets
            rows, tensor, op, _, after_step = item
            buckets.setdefault((id(rows.group), op, tensor.dtype, tensor.device, after_step), []).append(item)
        self._reduces = []
        started, later = [], []
        for (_, op, _, _, after_step), items in buckets.items():
            rows = items[0][0]
            flat = torch.cat([t.reshape(-1) for _, t, _, _, _ in items])
            work = None
            if rows.distributed:
                work = dist.all_reduce(flat, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                                       group=rows.group, async_op=True)
            entry = (work, flat, [(t.shape, finish) for _, t, _, finish, _ in items])
            (later if after_step else started).append(entry)
        self.later += later
        return started

    @staticmethod
    def finish_reduces(started: list) -> list:
        """Wait for started all-reduces ([(work, flat result, [(shape, finish)])]) and run each item's finish on its
        part of the result, in order. Returns what the finishes returned other than None (a
        row shard's factored moment: the chunk of column means it wrote, and every column mean)."""
        written = []
        for work, flat, items in started:
            if work is not None:
                work.wait()
            for (shape, finish), part in zip(items, flat.split([math.prod(shape) for shape, _ in items])):
                out = finish(part.view(shape))
                if out is not None:
                    written.append(out)
        return written

    def run(self) -> None:
        """Step everything queued, then forget it: the reduces the parameters' steps queued start first, and run
        in the background while the launches and the multi-tensor kernels run."""
        started = self._start_reduces()
        self.whole.flush()
        for queued in self._launches.values():
            # the element-wise step's launches, or TACO's (triton_taco.py)
            kernels = triton_taco if isinstance(queued[0][0], triton_taco.Launch) else triton_step
            size = kernels.batch_size(queued[0][0])  # what one launch may allocate bounds its tensors
            for part in (queued[i:i + size] for i in range(0, len(queued), size)):
                if kernels.run([launch for launch, _ in part]) is None:  # a kernel failed: eagerly
                    for _, eager in part:
                        eager()
        for (gid, _), (params, grads, exp_avgs, exp_avg_sqs, steps) in self._adamw.items():
            r = abi.scalars(self._groups[gid], 0, "free")  # torch's kernel counts the steps (bias corrections)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=r.lr,
                                beta1=r.beta1, beta2=r.beta2, weight_decay=r.weight_decay, eps=r.eps,
                                maximize=False, grad_scale=None, found_inf=None)
        for (gid, _), (params, grads) in self._resid.items():
            group = self._groups[gid]
            if native.kernel_applies(group, params[0].dtype, params[0].device.type, []):
                for p, g in zip(params, grads):  # one pass a weight, the same arithmetic
                    native.free_step(p, g, group)
                continue
            r = abi.scalars(group, 0, "free")
            if r.has_decay:
                torch._foreach_mul_(params, r.decay)
            sign = group["free_rule"] == "sign"
            for p, g in zip(params, grads):  # one temporary at a time, not one per queued tensor
                # in fp32, as the eager step: a bf16 operand would round lr * free_scale * sign(g) to bf16 first
                d = (g.sign() if sign else g).float()
                p.add_(d, alpha=r.alpha)
        self._finish_started()
        self.finish_reduces(started)
        self._start_reduces()  # what the launches left: a row shard's factored sums, to finish after the step
        self._adamw.clear()
        self._resid.clear()
        self._launches.clear()
        self._groups.clear()
