"""One parameter's element-wise update in windows, so that what the step allocates stays under ``WINDOW_BYTES``.

The update of an element-wise rule (adamw, lion, sgdm) in full space or on an active block, and the state-free
update of an inactive block or of FRUGAL at density 0, treat every element on its own: only a codec's blocks and a
factored second moment's rows tie elements together. So the step walks the flattened parameter in aligned ranges
("windows"): decode the window's moments, run the rule on its gradient, encode them, write the window of the
weight, then the next window. What it allocates is the step's scratch per element (``SCRATCH_PER_ELEMENT``: the
fp32 gradient copy, the decoded moments, the direction, quantization buffers) times the window, not times the
tensor: at most ``WINDOW_BYTES`` (64 MiB) whatever the tensor's size. A 7B model's embedding (131M elements)
stepped whole with 8-bit moments allocates 4.3 GB; in windows, 64 MiB.

Details: docs/modules.md, ``slimopt.optim.routes.windowed``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.budget import (  # noqa: F401
    PROJECTED_APPLY,
    PROJECTED_ROUNDING,
    PROJECTED_RULE,
    ROUNDING_SCRATCH,
    SCRATCH_PER_ELEMENT,
    WINDOW_BYTES,
    apply_scratch,
    kind,
    projected_held,
    projected_scratch,
    rule_scratch,
    scratch_per_element,
    window_elems,
    window_lines,
)
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.algorithm.rules import PARAM_STREAM, apply_update, comp_of, direction, rounding_of
from slimopt.optim.distributed.shardcomm import Rows, gather_rows
from slimopt.optim.routes import choice
from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.triton import triton_step

__all__ = ["WINDOW_BYTES", "SCRATCH_PER_ELEMENT", "ROUNDING_SCRATCH", "kind", "scratch_per_element",
           "window_elems", "launch", "in_windows", "projected", "directions"]

def launch(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], codecs: list[tuple[str, Any]],
           age: int, stream: Callable[[int, int], CounterStream], batch: Any) -> Any:
    """Queue p's update as one Triton launch (``triton_step.prepare``) in `batch` (a ``multi_tensor.Batch``), to
    step with the other tensors of its size and setting at the end of ``step()``, its eager windows standing by
    where the launch fails; returns the launch. codecs: the rule's (key, codec) list, its ``moment_step`` already
    counted as `age`, or none for the state-free update; stream(i, start): the random stream of moment i (or of
    the weight, ``i = rules.PARAM_STREAM``) from element `start` of the window on."""
    rounding = rounding_of(group, p)
    comp = comp_of(state, p, rounding)
    prepared = triton_step.prepare(p, grad, state, group, codecs, age, comp=comp,
                                   gen=stream(PARAM_STREAM, 0) if rounding == "stochastic" else None,
                                   streams=moment_streams(codecs, stream))

    def eager() -> None:
        in_windows(p, grad, state, group, codecs, age, stream, rounding, comp, one_pass=False)

    batch.launch(prepared, eager)
    return prepared


def moment_streams(codecs: list[tuple[str, Any]], stream: Callable[[int, int], CounterStream]
                   ) -> list[CounterStream | None]:
    """Each moment's random stream from element 0 where its codec rounds stochastically, else None (what a
    whole-tensor kernel reads: ``triton_step.prepare``)."""
    return [stream(i, 0) if codec.needs_generator else None for i, (_, codec) in enumerate(codecs)]


def spans(p: Tensor, group: dict[str, Any], codecs: list[tuple[str, Any]], rounding: str) -> list[tuple[int, int]]:
    """The [start, stop) element ranges of p's windows: aligned to every codec's blocks, each within the scratch
    budget (``window_elems``)."""
    n = p.numel()
    per = scratch_per_element(kind(codecs, group["rule"]), p.dtype, rounding)
    align = math.lcm(1, *(codec.align(p.shape) for _, codec in codecs))
    size = window_elems(n, align, per)
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def kernel_spans(p: Tensor, group: dict[str, Any], codecs: list[tuple[str, Any]], rounding: str
                 ) -> list[tuple[int, int]]:
    """The C kernel's windows of p: all of it where the kernel reads every moment in place (it allocates nothing
    per element and splits a window over its threads itself; one window also lets it write an int8 weight's codes
    row by row, ``native.Int8Sink``), else ``spans``. Windows are cut at whole blocks: the bits do not depend on them."""
    if all(native.in_kernel(codec) for _, codec in codecs):
        return [(0, p.numel())] if p.numel() else []
    return spans(p, group, codecs, rounding)


def in_windows(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any],
               codecs: list[tuple[str, Any]], age: int, stream: Callable[[int, int], CounterStream], rounding: str,
               comp: Tensor | None, one_pass: bool, batch: Any = None) -> None:
    """One update of p from grad in windows: the rule on codec-stored moments (codecs: the rule's (key, codec)
    list, its ``moment_step`` already counted as `age`), or with no codecs the state-free update of the residual;
    each window in one pass of the C kernel (`one_pass`) or as the eager tensor operations. p, grad: contiguous
    tensors of one shape; stream as ``launch``'s; comp: the weight's Kahan compensation under ``kahan``; batch: the
    step's queue, where a row shard's factored moment leaves its column sums to be summed over the ranks."""
    weight, gradient = p.view(-1), grad.view(-1)
    windows = [(i, key, codec, codec.open(key, state, p.shape)) for i, (key, codec) in enumerate(codecs)]
    if batch is not None:
        for *_, w in windows:
            w.defer_to(batch)
    for start, stop in (kernel_spans if one_pass else spans)(p, group, codecs, rounding):
        gen = stream(PARAM_STREAM, start) if rounding == "stochastic" else None
        part = comp.view(-1)[start:stop] if comp is not None else None
        if one_pass:
            native.window_step(weight[start:stop], gradient[start:stop], state, group, windows, start, age, stream,
                               comp=part, gen=gen)
            continue
        _window(weight[start:stop], gradient[start:stop], part, group, windows, start, age, stream, gen)
    for _, _, _, w in windows:
        w.close()


def _window(p: Tensor, grad: Tensor, comp: Tensor | None, group: dict[str, Any], windows: list, start: int, age: int,
            stream: Callable[[int, int], CounterStream], gen: CounterStream | None) -> None:
    """One window [start, start + p.numel()): p, grad, comp are its flat views. A function of its own so that its
    temporaries are gone before the next window allocates."""
    g = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()
    if not windows:
        apply_update(p, None, 0.0, g, group, comp=comp, generator=gen)
        return
    d, c = _rule(g, group, windows, start, age, stream)
    apply_update(p, d, c, None, group, comp=comp, generator=gen)


def _rule(g: Tensor, group: dict[str, Any], windows: list, start: int, age: int,
          stream: Callable[[int, int], CounterStream]) -> tuple[Tensor, float]:
    """The rule on elements [start, start + g.numel()) of the moments: decode them, update them with the fp32
    gradient g, encode them back; returns the rule's (direction, coefficient)."""
    stop = start + g.numel()
    mom = {key: w.decode(start, stop) for _, key, _, w in windows}
    d, c = direction(group["rule"], g, mom, age, group)
    for i, key, codec, w in windows:
        w.encode(start, stop, mom[key], stream(i, start) if codec.needs_generator else None)
    return d, c


# ----------------------------------------------------------------------------------------------------------------
# projected steps: GaLore's and FRUGAL's subspace projectors on a 2-D weight


def projected(p: Tensor, grad: Tensor, basis: Tensor, projector: str, side: str | None, residual: bool,
              state: dict[str, Tensor], group: dict[str, Any], codecs: list[tuple[str, Any]], age: int,
              stream: Any, coef_scale: float,
              whole_rule: Callable[[Tensor], tuple[Tensor, float]] | None = None,
              reduce: Callable[[Tensor, Callable[[], None]], Any] | None = None, split: Rows | None = None) -> None:
    """One step of a subspace projector on the 2-D weight p between refreshes, in windows of slices along the axis
    the projector does not mix (``projectors.window_axis``: rows for a right projection and ``columns``, columns
    for a left one and ``rows``), with ``projectors.down`` / ``up`` / ``residual`` applied to each slice as they
    are to the whole gradient:

    1. the subspace gradient ``low``, slice by slice (each slice's fp32 gradient made, projected, dropped);
    2. the rule on it: an element-wise rule (codecs: its (key, codec) list, ``moment_step`` counted as `age`) in
       aligned flat windows of ``low``, as ``step`` walks a weight, writing the direction over ``low`` unless the
       residual still needs it; another rule (Muon, TACO: ``whole_rule(low) -> (d, c)``) on the whole matrix;
    3. per slice window: the residual of the slice's fp32 gradient (when `residual`), the lifted direction, and
       ``rules.apply_update`` on the weight's slice (its Kahan compensation's slice, a stream of its own).

    p may be a row shard of an FSDP2 weight (basis: the rows of a left basis it holds, or the local numbers of the
    chosen rows it holds): `reduce(low, rest)` then sums ``low`` over the ranks after step 1 (a left projection)
    and runs steps 2 and 3 (``rest``) once the sum is there, now or later in the step, and stream
    (``sharded.Streams``) reads the weight's and the moments' streams from the shard's elements. `split`: the rows
    of ``low`` this rank steps, where a left projection's moments are split by rows over the ranks
    (``sharded.chunks_of``): the rule runs on them (it needs only their sum) and their direction is gathered
    from every rank for step 3.

    What it holds across windows is ``low`` and the direction (a subspace's size) and an fp32 copy of a bf16 basis;
    the windows get what WINDOW_BYTES leaves (``projected_scratch``). Every element sees the whole-tensor step's
    arithmetic, with one caveat: a matrix product of a slice is not always bit for bit the slice of the product
    (BLAS picks its kernels and blocking by the operand sizes; on a 2-core AVX2 MKL, torch 2.13, some slice widths
    differ in the last bits, up to ~2e-6 of the largest entry), so projections can differ from the whole-tensor
    step's by that much. The coordinate projectors (``columns``, ``rows``) select and scatter: exact.
    """
    axis, work, mm, q, low_shape, held, spans = projected_geometry(p, grad, basis, projector, side, residual, group)
    m, n = p.shape
    rounding = rounding_of(group, p)
    low = torch.empty(low_shape, dtype=work, device=p.device)
    for a, k in spans:
        down_into(low.narrow(axis, a, k), grad.narrow(axis, a, k), projector, side, q, mm)

    def rest() -> tuple[Tensor, Rows, Callable[[Tensor], None]] | None:
        """The rule on the subspace gradient, then the lifted write; on split rows, the rule on this rank's and a
        request for every rank's direction rows ((rows, split, what to do with them whole): the caller gathers
        them, with the step's others where it can)."""
        if whole_rule is None and split is not None:
            mine = slice(split.start, split.stop)
            d = torch.empty_like(low) if residual else low
            c = directions(low[mine], d[mine], state, group, codecs, age, stream, p.dtype, held)
            return d[mine], split, lambda whole: lift(whole, c)
        if whole_rule is None:
            d = torch.empty_like(low) if residual else low
            c = directions(low, d, state, group, codecs, age, stream, p.dtype, held)
        else:
            d, c = whole_rule(low)
        lift(d, c)
        return None

    def lift(d: Tensor, c: float) -> None:  # the lifted write, window by window
        comp = comp_of(state, p, rounding)
        for a, k in spans:
            # rows [a, a + k) are elements [a n, (a + k) n) of the weight; a column window is no range of them
            gen = None if rounding != "stochastic" else stream(PARAM_STREAM, a * n) if axis == 0 else \
                stream.columns(a, k)
            _lift(p.narrow(axis, a, k), grad.narrow(axis, a, k), comp.narrow(axis, a, k) if comp is not None
                  else None, d.narrow(axis, a, k), low.narrow(axis, a, k) if residual else None, projector, side, q,
                  work, mm, c * coef_scale, group, gen)

    if reduce is None:
        request = rest()
        if request is not None:
            rows_mine, rows_split, use = request
            use(gather_rows(rows_mine, rows_split))
    else:
        reduce(low, rest)


def projected_geometry(p: Tensor, grad: Tensor, basis: Tensor, projector: str, side: str | None, residual: bool,
                       group: dict[str, Any]) -> tuple:
    """How ``projected`` walks p: (the axis its windows slice, the work dtype, the products' dtype, the basis in
    it, the subspace gradient's shape, the bytes held across windows, the windows as (first line, lines))."""
    axis = P.window_axis(projector, side)
    work = torch.float64 if grad.dtype == torch.float64 else torch.float32
    # the projections' products run in `mm` (projectors.matmul_dtype): a narrow basis read in it once
    mm = P.matmul_dtype(group["proj_dtype"], grad.dtype, grad.device) if basis.is_floating_point() else work
    q = basis.to(mm) if basis.is_floating_point() else basis
    copy_bytes = q.numel() * q.element_size() if q is not basis else 0
    m, n = p.shape
    r = q.shape[1] if basis.is_floating_point() else basis.numel()
    if projector in P.ORTHO_PROJECTORS:
        low_shape = (m, r) if side == "right" else (r, n)
    else:
        low_shape = (m, r) if projector == "columns" else (r, n)
    held = projected_held(math.prod(low_shape), copy_bytes, residual, work.itemsize)
    count, line = (m, n) if axis == 0 else (n, m)
    per = apply_scratch(p.dtype, group["free_rule"] if residual else "none", rounding_of(group, p))
    size = window_lines(count, line, per, held)
    return axis, work, mm, q, low_shape, held, [(a, min(count, a + size) - a) for a in range(0, count, size)]


def down_into(out: Tensor, grad: Tensor, projector: str, side: str | None, q: Tensor, mm: torch.dtype) -> None:
    """out <- down(grad) in the products' dtype mm, for one slice (a function of its own, so that its temporaries
    go before the next)."""
    out.copy_(P.down(projector, side, grad if grad.dtype == mm else grad.to(mm), q))


def _lift(p: Tensor, grad: Tensor, comp: Tensor | None, d: Tensor, low: Tensor | None, projector: str,
          side: str | None, q: Tensor, work: torch.dtype, mm: torch.dtype, coef: float, group: dict[str, Any],
          gen: CounterStream | None) -> None:
    """Step 3 of ``projected`` on one slice window: p, grad, comp, d, low are its slices; the direction is lifted
    in the products' dtype mm, the residual formed in the work dtype (sign() needs its small entries)."""
    if low is not None:
        kernel = choice.lifted_write(group, p, grad, mm, True)
        if kernel != "eager":
            # FRUGAL's residual -up + g, its free rule, the decay, the update and the write in one pass: the C
            # kernel on a CPU, one Triton launch on CUDA. For the coordinate projectors up(low) holds the gradient's
            # own entries at the chosen coordinates (zeros elsewhere), so -up + g is index_fill's residual wherever
            # g is finite (a non-finite entry steps the weight to NaN either way)
            inside = P.up(projector, side, low, q, grad.shape)  # the gradient's part inside the subspace, fp32
            full = P.up(projector, side, d.to(mm), q, p.shape)
            if kernel == "c_kernel":
                native.lift_update(p, full, grad, inside, group, coef, comp, gen)
                return
            write = {**group, "lift_coef": coef}
            if triton_step.run([triton_step.prepare(p, full, {}, write, [], 0, comp=comp, gen=gen,
                                                    lift=(grad, inside))]) is not None:
                return
            del inside, full  # the kernel failed (one warning; later steps do not ask it): the eager write
    resid = None
    if low is not None:
        g = grad.to(work)
        resid = P.residual(projector, side, g, low, q)
        del g
    full = P.up(projector, side, d.to(mm), q, p.shape)
    kernel = choice.lifted_write(group, p, grad, full, False) if resid is None else "eager"
    if kernel == "c_kernel":  # decay, update and write in one pass
        native.add_update(p, full, group, coef, comp, gen)
        return
    if kernel == "triton":  # the same pass as the Triton step's state-free SGD of the update, one launch
        write = native.add_group(group, coef)
        if triton_step.run([triton_step.prepare(p, full, {}, write, [], 0, comp=comp, gen=gen)]) is not None:
            return
    apply_update(p, full.to(work), coef, resid, group, comp=comp, generator=gen)


def directions(low: Tensor, out: Tensor, state: dict[str, Tensor], group: dict[str, Any],
               codecs: list[tuple[str, Any]], age: int, stream: Callable[[int, int], CounterStream],
               dtype: torch.dtype, held: int = 0) -> float:
    """The element-wise rule on the fp32 subspace gradient `low` in aligned flat windows, against the moments of
    `low`'s shape that `codecs` store (those of a `dtype` weight); the direction goes to `out` (low's shape; `low`
    itself is fine: each window reads its gradient before it writes); `held`: what the caller keeps allocated.
    Returns the rule's coefficient c (the same for every window)."""
    kernel = choice.subspace_rule(group, low, codecs)  # out, low: fp32 (or fp64: no kernel), contiguous
    if kernel == "triton":
        launch = triton_step.prepare(out, low, state, group, codecs, age, direction=True,
                                     streams=moment_streams(codecs, stream))
        c = triton_step.run([launch])
        if c is not None:
            return c
    windows = [(i, key, codec, codec.open(key, state, low.shape)) for i, (key, codec) in enumerate(codecs)]
    src, dst = low.view(-1), out.view(-1)
    c = 1.0
    one_pass = kernel == "c_kernel"
    for start, stop in direction_spans(low.shape, codecs, group, dtype, held):
        c = _direction(src[start:stop], dst[start:stop], state, group, windows, start, age, stream, one_pass)
    for _, _, _, w in windows:
        w.close()
    return c


def direction_spans(shape: torch.Size | tuple, codecs: list[tuple[str, Any]], group: dict[str, Any],
                    dtype: torch.dtype, held: int) -> list[tuple[int, int]]:
    """The [start, stop) flat windows in which ``directions`` runs the rule on a subspace gradient of `shape`."""
    n = math.prod(shape)
    per = rule_scratch(kind(codecs, group["rule"]), dtype)
    align = math.lcm(1, *(codec.align(torch.Size(shape)) for _, codec in codecs))
    size = window_elems(n, align, per, held)
    return [(start, min(n, start + size)) for start in range(0, n, size)]


def _direction(g: Tensor, out: Tensor, state: dict[str, Tensor], group: dict[str, Any], windows: list, start: int,
               age: int, stream: Callable[[int, int], CounterStream], one_pass: bool) -> float:
    if one_pass:
        # the one-pass kernel, writing the direction where it would write a weight
        return native.window_step(out, g, state, group, windows, start, age, stream, direction=True)
    d, c = _rule(g, group, windows, start, age, stream)
    out.copy_(d)
    return c
