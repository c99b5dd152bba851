"""Symmetric int8 weights: one int8 per element and one fp32 scale per row, or per group of a row's elements.

The device format of a weight whose higher-precision master copy is stepped elsewhere (the host), and of a weight
updated in place without a master (Q-GaLore, arXiv 2407.08296, which rounds stochastically so that small updates
survive on average). This module is the reference every writer of the format must equal bit for bit: scale =
absmax / 127 of the row or group, code = round(w / scale) (nearest, ties to even; or stochastic from a
counter-based stream), clamped to [-127, 127]; an all-zero row or group has scale 0 and codes 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimopt.optim.algorithm.noise import CounterStream

__all__ = ["QMAX", "check_group", "group_count", "quantize", "dequantize"]

QMAX = 127  # symmetric: -128 is never written, so negating a weight negates its codes


def check_group(group: object) -> int:
    """`group` as an int: 0 (one scale per row) or the number of consecutive elements of a row sharing a scale."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ValueError(f"int8_group must be an integer >= 0 (0: one scale per row); got {group!r}")
    return group


def group_count(cols: int, group: int) -> int:
    """Scales per row of `cols` elements: 1 for group 0, else ceil(cols / group) (the last group may be short)."""
    return 1 if check_group(group) == 0 else -(-cols // group)


def _grouped(w: Tensor, group: int) -> Tensor:
    """(rows, cols) -> (rows, groups, width) in w's dtype, the short last group padded with zeros (which never
    change an absmax and are cut again after rounding)."""
    rows, cols = w.shape
    width = cols if group == 0 else group
    groups = group_count(cols, group)
    if groups * width != cols:
        w = F.pad(w, (0, groups * width - cols))
    return w.view(rows, groups, width)


def quantize(w: Tensor, group: int = 0, *, noise: CounterStream | None = None) -> tuple[Tensor, Tensor]:
    """w (rows, cols) any float dtype -> codes (rows, cols) int8 and scales (rows, groups) fp32.

    noise: None rounds to nearest (ties to even); a stream rounds up with probability equal to the fraction, the
    uniform number of element j of w's row-major order drawn from the stream's counter offset + j.
    """
    if w.dim() != 2:
        raise ValueError(f"an int8 weight is a matrix; got shape {tuple(w.shape)}")
    rows, cols = w.shape
    blocks = _grouped(w.float(), check_group(group))
    # the row's (or group's) absmax in one pass, without an |w| copy: the same value as abs().amax()
    scale = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1).div_(QMAX)
    # Divide (not multiply by a reciprocal) so the absmax element lands on exactly +-127; a zero scale (an
    # all-zero group) divides zeros by the smallest normal float and stays 0. One new tensor, then in place.
    x = blocks / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    if noise is None:
        x.round_()
    else:
        x.add_(_grouped(noise.uniform((rows, cols), w.device), group)).floor_()
    codes = x.clamp_(-QMAX, QMAX).to(torch.int8).view(rows, -1)
    return (codes if codes.shape[1] == cols else codes[:, :cols].contiguous()), scale


def dequantize(codes: Tensor, scale: Tensor, group: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (rows, cols) int8, scales (rows, groups) fp32 of `quantize(w, group)` -> (rows, cols) in `dtype`: code
    times scale in fp32, then one rounding to `dtype`."""
    rows, cols = codes.shape
    if tuple(scale.shape) != (rows, group_count(cols, group)):
        raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit codes {tuple(codes.shape)} at "
                         f"int8_group={group} (expected {(rows, group_count(cols, group))})")
    values = _grouped(codes, group) * scale.unsqueeze(-1)  # int8 times fp32: fp32, with no fp32 copy of the codes
    return values.view(rows, -1)[:, :cols].to(dtype)
