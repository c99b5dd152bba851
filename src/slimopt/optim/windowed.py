"""One parameter's element-wise update in windows, so that what the step allocates stays under ``WINDOW_BYTES``.

The update of an element-wise rule (adamw, lion, sgdm) in full space or on an active block, and the state-free
update of an inactive block or of FRUGAL at density 0, treat every element on its own: only a codec's blocks and a
factored second moment's rows tie elements together. So the step walks the flattened parameter in aligned ranges
("windows"): decode the window's moments, run the rule on its gradient, encode them, write the window of the
weight, then the next window. What it allocates is the step's scratch per element (``SCRATCH_PER_ELEMENT``: the
fp32 gradient copy, the decoded moments, the direction, quantization buffers) times the window, not times the
tensor: at most ``WINDOW_BYTES`` (64 MiB) whatever the tensor's size. A 7B model's embedding (131M elements)
stepped whole with 8-bit moments allocates 4.3 GB; in windows, 64 MiB.

The result is the whole-tensor step's, bit for bit: every element sees the same arithmetic in the same order
(the weight decay, the rule, the codecs' blocks, which windows never cut). One exception: a factored second
moment's column means are sums over rows divided by the row count, and windows add the rows' partial sums in
another order (a few fp32 ulps; the row-sharded form differs from one process the same way). Stochastic rounding draws each window from its own
stream, the parameter's stream extended by the window's first element (as a row shard of an FSDP2 run extends it
by its first row), so the first window, and any tensor that fits one, draws exactly the whole-tensor numbers.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from .rules import PARAM_STREAM, apply_update, comp_of, direction, rounding_of

__all__ = ["WINDOW_BYTES", "SCRATCH_PER_ELEMENT", "ROUNDING_SCRATCH", "kind", "scratch_per_element",
           "window_elems", "step"]

WINDOW_BYTES = 64 << 20

# Bytes per element of a parameter that its update allocates on top of the weights, gradient and state while it
# runs (fp32 gradient copy, decoded moments, direction, quantization buffers): (bf16 weights, fp32 weights).
# Measured with torch's MemTracker on CPU, torch 2.13 (a 2048 x 2048 weight stepped whole; tests/test_windowed.py
# checks the windowed kinds, tests/test_planner.py a LLaMA step); an estimate of what any device allocates, since
# kernels differ. The windowed kinds (plain, factored, momentum, 8bit, ternary_*, state_free) allocate this per
# element of a window; the others per element of the tensor: projected steps, and TACO's dense reference step
# (fused=False; its fused step searches row windows: taco.scratch_bytes).
SCRATCH_PER_ELEMENT = {"plain": (20, 8), "factored": (20, 12), "momentum": (14, 4), "8bit": (33, 29),
                       "ternary_sr": (61, 57), "ternary_ef": (77, 73), "state_free": (8, 4), "taco": (12, 8),
                       "projected": (11, 7), "projected_8bit": (17, 13), "coordinates": (18, 14)}
# Writing a bf16 weight with stochastic rounding or Kahan compensation (rules.write) is a phase of its own, after
# the moments are stored: the gradient and direction, the weight's fp32 value, and the random integers and rounded
# bits, or the compensation's fp32 copy and residual. Its peak per element (measured as above); the step's is the
# larger of the two phases.
ROUNDING_SCRATCH = {"nearest": 0, "stochastic": 27, "kahan": 18}


def kind(codecs: list[tuple[str, Any]], rule: str = "adamw") -> str:
    """The scratch kind of a full-space step of `rule` with these moment codecs (none: the state-free update)."""
    names = {codec.name for _, codec in codecs}
    if not names:
        return "state_free"
    if "ternary_ef" in names:
        return "ternary_ef"
    if "ternary_sr" in names:
        return "ternary_sr"
    if names & {"int8", "int4"}:
        return "8bit"
    if rule in ("lion", "sgdm"):
        return "momentum"
    return "factored" if "factored" in names else "plain"


def scratch_per_element(step_kind: str, dtype: torch.dtype, rounding: str = "nearest") -> int:
    """Bytes a step of `step_kind` allocates per element of a `dtype` weight (``SCRATCH_PER_ELEMENT``)."""
    narrow, wide = SCRATCH_PER_ELEMENT[step_kind]
    if dtype in (torch.float32, torch.float64):
        return wide
    return max(narrow, ROUNDING_SCRATCH[rounding])


def window_elems(numel: int, align: int, per_element: int) -> int:
    """Elements of one window: as many as WINDOW_BYTES of scratch allow, a multiple of `align` (at least one
    `align`), at most the whole tensor."""
    size = (WINDOW_BYTES // max(1, per_element)) // align * align
    return min(numel, max(align, size))


def step(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], codecs: list[tuple[str, Any]],
         age: int, stream: Callable[[int, int], torch.Generator]) -> None:
    """One update of p from grad in windows: the rule on codec-stored moments (codecs: the rule's (key, codec)
    list, its ``moment_step`` already counted as `age`), or with no codecs the state-free update of the residual.

    p, grad: contiguous tensors of one shape; stream(i, start): the random stream of moment i (or of the weight,
    ``i = rules.PARAM_STREAM``) for the window starting at element `start`.
    """
    n = p.numel()
    rounding = rounding_of(group, p)
    per = scratch_per_element(kind(codecs, group["rule"]), p.dtype, rounding)
    align = math.lcm(1, *(codec.align(p.shape) for _, codec in codecs))
    size = window_elems(n, align, per)
    windows = [(i, key, codec, codec.open(key, state, p.shape)) for i, (key, codec) in enumerate(codecs)]
    weight, gradient = p.view(-1), grad.view(-1)
    comp = comp_of(state, p, rounding)
    for start in range(0, n, size):
        stop = min(n, start + size)
        gen = stream(PARAM_STREAM, start) if rounding == "stochastic" else None
        _window(weight[start:stop], gradient[start:stop], comp.view(-1)[start:stop] if comp is not None else None,
                group, windows, start, age, stream, gen)
    for _, _, _, w in windows:
        w.close()


def _window(p: Tensor, grad: Tensor, comp: Tensor | None, group: dict[str, Any], windows: list, start: int, age: int,
            stream: Callable[[int, int], torch.Generator], gen: torch.Generator | None) -> None:
    """One window [start, start + p.numel()): p, grad, comp are its flat views. A function of its own so that its
    temporaries are gone before the next window allocates."""
    stop = start + p.numel()
    g = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()
    if not windows:
        apply_update(p, None, 0.0, g, group, comp=comp, generator=gen)
        return
    mom = {key: w.decode(start, stop) for _, key, _, w in windows}
    d, c = direction(group["rule"], g, mom, age, group)
    for i, key, codec, w in windows:
        w.encode(start, stop, mom[key], stream(i, start) if codec.needs_generator else None)
    del mom
    apply_update(p, d, c, None, group, comp=comp, generator=gen)
