"""How much scratch a step may allocate, and how much each kind of step allocates per element (the planner's
figures).

A step's temporaries (the fp32 gradient, decoded moments, the direction, quantization buffers) would cost a
multiple of the tensor's size if a tensor were stepped whole: a 7B model's embedding (131M elements) with 8-bit
moments, 4.3 GB. So element-wise steps walk a tensor in windows (``windowed.py``), TACO's search walks row windows
(``taco.py``), and each allocates at most ``WINDOW_BYTES`` whatever the tensor. The per-element figures below were
measured with torch's MemTracker on CPU (torch 2.13); the planner (``slimopt.bench.planner``) sums them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WINDOW_BYTES", "SCRATCH_PER_ELEMENT", "ROUNDING_SCRATCH", "PROJECTED_RULE", "PROJECTED_APPLY",
           "PROJECTED_ROUNDING", "kind", "scratch_per_element", "window_elems", "window_lines", "rule_scratch",
           "apply_scratch", "projected_held", "projected_scratch"]

WINDOW_BYTES = 64 << 20

# Bytes per element of a parameter that its update allocates on top of the weights, gradient and state while it
# runs (fp32 gradient copy, decoded moments, direction, quantization buffers): (bf16 weights, fp32 weights).
# Measured with torch's MemTracker on CPU, torch 2.13 (a 2048 x 2048 weight stepped whole; tests/test_windowed.py
# checks the windowed kinds, tests/test_planner.py a LLaMA step); an estimate of what any device allocates, since
# kernels differ. The windowed kinds (plain, factored, momentum, 8bit, ternary_*, state_free) allocate this per
# element of a window; TACO's dense reference step (fused=False) per element of the tensor (its fused step
# searches row windows: taco.scratch_bytes). Projected steps have figures of their own (PROJECTED_*, below).
SCRATCH_PER_ELEMENT = {"plain": (20, 8), "factored": (20, 12), "momentum": (14, 4), "8bit": (33, 29),
                       "ternary_sr": (61, 57), "ternary_ef": (77, 73), "state_free": (8, 4), "taco": (12, 8)}
# Writing a bf16 weight with stochastic rounding or Kahan compensation (rules.write) is a phase of its own, after
# the moments are stored: the gradient and direction, the weight's fp32 value, and the random integers and rounded
# bits, or the compensation's fp32 copy and residual. Its peak per element (measured as above); the step's is the
# larger of the two phases.
ROUNDING_SCRATCH = {"nearest": 0, "stochastic": 27, "kahan": 18}
# A projected step between refreshes (``projected``), measured as above on a 1024 x 1024 weight stepped in one
# window (what it allocates less what it holds, ``projected_held``, over the elements), in two phases, each in
# windows:
# - the element-wise rule on the subspace gradient, per element of that gradient (fp32 already, so no copy: the
#   decoded moments, the direction and its temporaries), by scratch kind: (bf16 weights, fp32 weights);
# - the lifting, per element of a weight window (the window's fp32 gradient, the residual, its state-free
#   direction and the lifted update), by free rule ("none": no residual is formed), the same for orthonormal
#   and coordinate projectors; and that phase's peak when a bf16 weight is written with stochastic rounding or
#   Kahan compensation (the weight's fp32 value and the rounding's buffers on top).
PROJECTED_RULE = {"plain": (16, 8), "factored": (16, 12), "momentum": (12, 8), "8bit": (29, 29),
                  "ternary_sr": (57, 57), "ternary_ef": (73, 73)}
PROJECTED_APPLY = {"none": (4, 4), "sgd": (8, 8), "sign": (12, 12)}
PROJECTED_ROUNDING = {"none": {"nearest": 0, "stochastic": 23, "kahan": 14},
                      "sgd": {"nearest": 0, "stochastic": 27, "kahan": 18},
                      "sign": {"nearest": 0, "stochastic": 31, "kahan": 22}}


def kind(codecs: list[tuple[str, Any]], rule: str = "adamw") -> str:
    """The scratch kind of a full-space step of `rule` with these moment codecs (none: the state-free update)."""
    names = {codec.scratch_kind for _, codec in codecs}
    if not names:
        return "state_free"
    if "ternary_ef" in names:
        return "ternary_ef"
    if "ternary_sr" in names:
        return "ternary_sr"
    if names & {"int8", "int4"}:
        return "8bit"
    if rule in ("lion", "sgdm", "nesterov"):  # one moment: the momentum step's scratch
        return "momentum"
    return "factored" if "factored" in names else "plain"


def scratch_per_element(step_kind: str, dtype: torch.dtype, rounding: str = "nearest") -> int:
    """Bytes a step of `step_kind` allocates per element of a `dtype` weight (``SCRATCH_PER_ELEMENT``)."""
    narrow, wide = SCRATCH_PER_ELEMENT[step_kind]
    if dtype in (torch.float32, torch.float64):
        return wide
    return max(narrow, ROUNDING_SCRATCH[rounding])


def _budget(held: int) -> int:
    """Scratch bytes for one window of a step that keeps `held` bytes across its windows: what WINDOW_BYTES leaves,
    but at least an eighth of it, so that a step holding more than the window still walks in windows worth their
    overhead (it then allocates held + WINDOW_BYTES / 8)."""
    return max(WINDOW_BYTES - held, WINDOW_BYTES // 8)


def window_elems(numel: int, align: int, per_element: int, held: int = 0) -> int:
    """Elements of one window: as many as WINDOW_BYTES of scratch allow (less `held`, what the step keeps
    allocated across its windows: ``_budget``), a multiple of `align` (at least one `align`), at most the whole
    tensor."""
    size = (_budget(held) // max(1, per_element)) // align * align
    return max(1, min(numel, max(align, size)))  # at least one, so that an empty tensor walks no window


def window_lines(count: int, line: int, per_element: int, held: int = 0) -> int:
    """Lines (rows or columns of `line` elements each, `count` of them) in one window: as many as WINDOW_BYTES less
    `held` allow (``_budget``) at `per_element` bytes an element, at least one, at most all."""
    return max(1, min(count, (_budget(held) // max(1, per_element)) // max(1, line)))


def rule_scratch(step_kind: str, dtype: torch.dtype) -> int:
    """Bytes per element that the element-wise rule allocates on an fp32 subspace gradient (no gradient copy to
    make) whose moments a `dtype` weight's codecs store: the decoded moments, the direction, its temporaries."""
    return PROJECTED_RULE[step_kind][0 if dtype not in (torch.float32, torch.float64) else 1]


def apply_scratch(dtype: torch.dtype, free: str, rounding: str = "nearest") -> int:
    """Bytes per element of a weight window that the lifting and the write of a projected step allocate (the
    window's fp32 gradient, the lifted update, the residual and its state-free direction; ``free``: the free rule,
    "none" when no residual is formed), or its rounded write's, if larger."""
    narrow, wide = PROJECTED_APPLY[free]
    if dtype in (torch.float32, torch.float64):
        return wide
    return max(narrow, PROJECTED_ROUNDING[free][rounding])


def projected_held(low_numel: int, copy_bytes: int, residual: bool, work_bytes: int = 4) -> int:
    """Bytes a projected step keeps across its windows: the subspace gradient (work dtype), the direction (in its
    place when no residual needs the gradient afterwards) and the basis in the work dtype (copy_bytes: 0 when the
    stored basis is already in it)."""
    return copy_bytes + work_bytes * low_numel * (2 if residual else 1)


def projected_scratch(shape: tuple[int, int], dtype: torch.dtype, low_numel: int, axis: int, copy_bytes: int,
                      free: str, rounding: str, rule: tuple[str, int] | int) -> int:
    """What one non-refresh projected step of a (m, n) `dtype` weight allocates at most (``projected``): what it
    holds plus the larger of its rule's window and its lifting's window.

    low_numel: the subspace gradient's size; axis: ``projectors.window_axis``; copy_bytes: the basis in the work
    dtype when the stored one is narrower; free: the free rule, "none" when no residual is formed; rule: (scratch
    kind, codecs' alignment) of an element-wise rule, or the bytes a rule that needs the whole subspace matrix
    allocates, its direction included (Muon, TACO)."""
    work = 8 if dtype == torch.float64 else 4
    held = projected_held(low_numel, copy_bytes, free != "none", work)
    count, line = (shape[0], shape[1]) if axis == 0 else (shape[1], shape[0])
    per = apply_scratch(dtype, free, rounding)
    lift = held + per * window_lines(count, line, per, held) * line
    if isinstance(rule, tuple):
        per_rule = rule_scratch(rule[0], dtype)
        return max(lift, held + per_rule * window_elems(low_numel, rule[1], per_rule, held))
    return max(lift, copy_bytes + work * low_numel + rule)


