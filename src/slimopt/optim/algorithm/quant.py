"""Pure quantize / dequantize functions for compressed optimizer state.

Everything here is a stateless tensor function: the storage forms that hold codes and scales between steps live
in `slimopt.optim.algorithm.codecs`. The functions are written as whole-tensor ops (no Python loops over elements or
blocks, no host syncs) so that a `torch.compile`d optimizer step can fuse them.

Details: docs/modules.md, ``slimopt.optim.algorithm.quant``.
"""

from __future__ import annotations

import weakref
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor

from slimopt.optim.algorithm.noise import CounterStream

__all__ = [
    "TERNARY_MAP",
    "dynamic_map",
    "linear_map",
    "get_map",
    "nearest_codes",
    "stochastic_codes",
    "to_blocks",
    "block_absmax",
    "block_absmean",
    "block_rms",
    "normalize_blocks",
    "quantize_blockwise",
    "dequantize_blockwise",
    "pack_bits",
    "unpack_bits",
    "pack_base3",
    "unpack_base3",
    "base3_nbytes",
    "uniform",
    "to_bf16",
]

TERNARY_MAP = (-1.0, 0.0, 1.0)


def dynamic_map(signed: bool = True, bits: int = 8) -> Tensor:
    """The dynamic-exponent quantization map of arXiv 2110.02861, as a sorted fp32 tensor of 2**bits values.

    Each decade 10**-(E-1) .. 10**0 (E = bits - 1 exponent values) holds the midpoints of a linear grid on
    [0.1, 1] scaled by that decade; the number of fraction values doubles with every decade, so precision is
    relative. The map also holds 0 and 1.0 (and, when signed, the negatives of the fractions, but not -1).
    The construction follows the same fp32 arithmetic as bitsandbytes' `create_dynamic_map` (with
    max_exponent_bits = bits - 1) so that the values are bit-identical.
    """
    if bits < 2 or bits > 8:
        raise ValueError(f"dynamic_map: bits must be in 2..8, got {bits}")
    exponents = bits - 1
    values: list[Tensor] = []
    for i in range(exponents):  # one linear grid per decade: construction time only
        n_fractions = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, n_fractions + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        decade = mids * (10 ** (i - (exponents - 1)))
        values.append(decade)
        if signed:
            values.append(-decade)
    values.append(torch.tensor([0.0, 1.0]))
    qmap = torch.cat(values).sort().values
    assert qmap.numel() == 2**bits
    return qmap


def linear_map(bits: int = 4, zero: bool = False) -> Tensor:
    """A linear map on [0, 1] with 2**bits values: 1/2**bits, 2/2**bits, ..., 1 (no zero), or with zero
    0, 1/(2**bits - 1), ..., 1. The zero-free form is the 4-bit second-moment map of arXiv 2309.01507."""
    n = 2**bits
    if zero:
        return torch.linspace(0, 1, n, dtype=torch.float32)
    return torch.linspace(0, 1, n + 1, dtype=torch.float32)[1:].contiguous()


def _build_map(name: str) -> Tensor:
    if name == "dynamic8_signed":
        return dynamic_map(True, 8)
    if name == "dynamic8_unsigned":
        return dynamic_map(False, 8)
    if name == "dynamic4_signed":
        return dynamic_map(True, 4)
    if name == "linear4_nozero":
        return linear_map(4, zero=False)
    if name == "ternary":
        return torch.tensor(TERNARY_MAP, dtype=torch.float32)
    raise ValueError(
        f"get_map: unknown map name {name!r}; allowed: dynamic8_signed, dynamic8_unsigned, dynamic4_signed, "
        "linear4_nozero, ternary"
    )


_MAPS: dict[tuple[str, str], Tensor] = {}


def get_map(name: str, device: torch.device | str | None = None) -> Tensor:
    """A named map on `device`, built once and cached (maps are tiny constants, shared by all codecs)."""
    dev = torch.device("cpu" if device is None else device)
    key = (name, str(dev))
    qmap = _MAPS.get(key)
    if qmap is None:
        qmap = _build_map(name).to(dev)
        _MAPS[key] = qmap
    return qmap


def _order_key(x: Tensor) -> Tensor:
    """fp32 (any shape) -> int32 that orders like the float: the bit pattern, magnitude bits flipped for negative
    numbers. -0.0 is first turned into +0.0 (they compare equal)."""
    bits = (x.float() + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _from_order_key(key: Tensor) -> Tensor:
    """The inverse of ``_order_key``: int32 -> fp32."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)


class _CountTable:
    """count(points <= x) for fp32 x and sorted fp32 points, by table look-up: exact, and on CPU an order of
    magnitude faster than ``torch.bucketize(x, points, right=True)`` (a scalar binary search, ~150 ns an element,
    which was most of an 8-bit encode).

    The top 16 bits of ``_order_key`` cut the real line into 65,536 ranges. ``base[r]`` counts the points below
    range r and ``extra`` is the most points any one range holds (1 for every map here), so
    count(points <= x) = base[r] + sum over t < extra of [x >= points[base[r] + t]]: the same exact comparisons as
    a binary search, fewer of them. Gathers use ``index_select`` with int32 indices (advanced indexing and int64
    ``where`` are several times slower on CPU).
    """

    def __init__(self, points: Tensor) -> None:
        ranges = self.range_of(points).long()  # (n,) ascending
        self.base = torch.searchsorted(ranges, torch.arange(65536, device=points.device)).int()  # (65536,)
        self.extra = int(torch.bincount(ranges, minlength=65536).max()) if points.numel() else 0
        # NaN sentinels: base[r] + t never reads past the end, and x >= NaN is False
        self.padded = torch.cat([points.float(), points.new_full((self.extra,), float("nan"), dtype=torch.float32)])

    @staticmethod
    def range_of(x: Tensor) -> Tensor:
        """fp32 (any shape) -> int32 range index in [0, 65536), monotone in x."""
        return (_order_key(x) >> 16) + 32768

    def count_le(self, x: Tensor) -> Tensor:
        """x fp32 (any shape) -> int32 count of points <= x (NaN: counted as above every point, as bucketize)."""
        shape, flat = x.shape, x.float().reshape(-1)
        idx = self.base.index_select(0, self.range_of(flat))
        count = idx.clone()
        for t in range(self.extra):
            count += flat >= self.padded.index_select(0, idx + t if t else idx)
        return count.view(shape)


def _nearest_points(qmap: Tensor) -> Tensor:
    """(n - 1,) fp32: for each pair of neighbours q[i] < q[i + 1], the smallest fp32 x with
    fl(q[i + 1] - x) <= fl(x - q[i]), i.e. from which nearest rounding (ties up, fp32 distances) picks q[i + 1].
    The predicate is monotone in x, so a bisection over the ordered fp32 patterns finds it exactly."""
    q = qmap.float()
    lo_v, hi_v = q[:-1], q[1:]
    lo, hi = _order_key(lo_v).long(), _order_key(hi_v).long()  # the predicate is False at lo, True at hi
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        x = _from_order_key(mid.int())
        up = (hi_v - x) <= (x - lo_v)
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    return _from_order_key(hi.int())


class _MapTables:
    """The look-up tables of one map: its bracketing (``bracket``) and its nearest-rounding decisions (``nearest``)."""

    def __init__(self, qmap: Tensor) -> None:
        self.bracket = _CountTable(qmap)
        self.nearest = _CountTable(_nearest_points(qmap))


_TABLES: dict[int, _MapTables] = {}


def _tables(qmap: Tensor) -> _MapTables | None:
    """The tables of a map tensor (built on first use, dropped when the map is freed), or None where
    ``torch.bucketize`` is used instead: off CPU (a parallel search there) and under torch.compile."""
    if qmap.device.type != "cpu" or qmap.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    tables = _TABLES.get(id(qmap))
    if tables is None:
        tables = _TABLES[id(qmap)] = _MapTables(qmap)
        weakref.finalize(qmap, _TABLES.pop, id(qmap), None)
    return tables


def _bracket(x: Tensor, qmap: Tensor) -> tuple[Tensor, Tensor]:
    """Indices (lo, hi = lo + 1) of the map values bracketing each x: qmap[lo] <= x < qmap[hi] inside the range,
    clamped to the first/last pair outside it. Exact comparisons."""
    n = qmap.numel()
    tables = _tables(qmap)
    if tables is not None:
        hi = tables.bracket.count_le(x).long().clamp_(1, n - 1)
    else:
        hi = torch.bucketize(x, qmap, right=True).clamp_(1, n - 1)
    return hi - 1, hi


def nearest_codes(x: Tensor, qmap: Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
    """x (any shape, fp32) -> codes (same shape, integer `dtype`) of the nearest map value; ties to the higher code.

    qmap: (n,) sorted ascending, fp32, same device as x. An encoder that stores uint8 codes asks for them directly,
    which spares an int64 copy of the tensor.
    """
    tables = _tables(qmap)
    if tables is not None:  # the count of decision points <= x is the code: one look-up, no distances
        return tables.nearest.count_le(x).to(dtype)
    lo, hi = _bracket(x, qmap)
    d_lo = x - qmap[lo]  # >= 0 inside the range
    d_hi = qmap[hi] - x  # >= 0 inside the range
    return torch.where(d_hi <= d_lo, hi, lo).to(dtype)


def stochastic_codes(x: Tensor, qmap: Tensor, u: Tensor) -> Tensor:
    """x (any shape, fp32), u (same shape, uniform in [0, 1)) -> int64 codes, rounding up with probability
    (x - lo) / (hi - lo) between the bracketing map values (unbiased inside the map's range)."""
    lo, hi = _bracket(x, qmap)
    q_lo = qmap.index_select(0, lo.reshape(-1)).view(lo.shape)
    q_hi = qmap.index_select(0, hi.reshape(-1)).view(hi.shape)
    p_up = ((x - q_lo) / (q_hi - q_lo)).clamp_(0.0, 1.0)
    return lo + (u < p_up)  # hi = lo + 1 (an integer where() is several times slower on CPU)


Stream = Union[torch.Generator, CounterStream]


def uniform(shape: torch.Size | tuple[int, ...], device: torch.device, generator: Stream | None = None) -> Tensor:
    """Uniform [0, 1) fp32 noise of `shape`: from a counter-based stream (noise.py; what the optimizer draws
    from), a torch.Generator, or torch's default generator when None."""
    if isinstance(generator, CounterStream):
        return generator.uniform(shape, device)
    return torch.rand(shape, device=device, generator=generator)


def to_blocks(x: Tensor, block_size: int) -> Tensor:
    """x (any shape) -> (n_blocks, block_size) fp32, flattened in row-major order and zero-padded at the end.

    Zero padding never changes a block's absmax, so the padded tail quantizes like a short block.
    """
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def block_absmax(blocks: Tensor) -> Tensor:
    """blocks (n_blocks, block_size) -> (n_blocks,) fp32 absmax. An all-zero block has scale 0 and decodes to
    exactly 0 whatever its codes, for every map."""
    return blocks.abs().amax(dim=-1)


def block_absmean(blocks: Tensor, numel: int) -> Tensor:
    """blocks (n_blocks, block_size) holding `numel` values (the rest zero padding) -> (n_blocks,) fp32 mean
    absolute value of each block's values (the padded last block's over its own values only): the "absmean" scale
    of BitNet b1.58 (Ma et al., arXiv 2402.17764), which rounds x / mean|x| to {-1, 0, +1}. An all-zero block has
    scale 0."""
    return _block_mean(blocks.abs(), numel).float()


def block_rms(blocks: Tensor, numel: int) -> Tensor:
    """blocks (n_blocks, block_size) holding `numel` values (the rest zero padding) -> (n_blocks,) fp32 root mean
    square of each block's values (the padded last block's over its own values only). For Gaussian values it is
    1.25 x the mean absolute value, near the scale that minimizes the error of stochastic ternary rounding with
    clipping (codecs.py). An all-zero block has scale 0."""
    return _block_mean(blocks.square(), numel).sqrt_().float()


def _block_mean(values: Tensor, numel: int) -> Tensor:
    """(n_blocks, block_size) fp32, `numel` of them values and the rest zeros -> (n_blocks,) fp64 means over each
    block's values. Summed in fp64 (without an fp64 copy): a block's sum is then exact or within an ulp of a
    double whatever order the reduction takes, so its fp32 rounding is the same for torch's vectorized sum and a
    plain loop (the native kernel's)."""
    n_blocks, block_size = values.shape
    sums = values.sum(dim=-1, dtype=torch.float64)
    tail = numel - (n_blocks - 1) * block_size  # values in the last block, 1..block_size
    if tail == block_size:
        return sums.div_(block_size)
    return torch.cat([sums[:-1] / block_size, sums[-1:] / tail])


def normalize_blocks(blocks: Tensor, scale: Tensor) -> Tensor:
    """blocks (n_blocks, block_size) / scale (n_blocks,) -> values in [-1, 1]."""
    # Divide (not multiply by a reciprocal) so that the largest entry maps to exactly +-1.0; the clamp only
    # guards all-zero blocks (0 / tiny = 0).
    return blocks / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)


def quantize_blockwise(x: Tensor, qmap: Tensor, block_size: int, *, stochastic: bool = False,
                       generator: Stream | None = None, noise: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Blockwise absmax quantization (arXiv 2110.02861 section 2.1) onto `qmap`.

    x: any shape, any float dtype; flattened and zero-padded to whole blocks.
    qmap: (n,) sorted fp32 map with n <= 256, on x's device.
    Returns codes (n_blocks * block_size,) uint8 and scale (n_blocks,) fp32, the per-block absmax.
    stochastic=True rounds stochastically with noise from `generator` (default generator when None), or with
    `noise`: uniform [0, 1) fp32 of n_blocks * block_size elements drawn by the caller (e.g. outside a compiled
    region, where a generator argument would break the graph).
    """
    blocks = to_blocks(x, block_size)
    scale = block_absmax(blocks)
    normed = normalize_blocks(blocks, scale)
    if stochastic:
        u = uniform(normed.shape, normed.device, generator) if noise is None else noise.view(normed.shape)
        codes = stochastic_codes(normed, qmap, u)
    else:
        codes = nearest_codes(normed, qmap, torch.uint8)
    return codes.to(torch.uint8).view(-1), scale


def dequantize_blockwise(codes: Tensor, scale: Tensor, qmap: Tensor, numel: int | None = None) -> Tensor:
    """codes (n_blocks * block_size,) integer, scale (n_blocks,) fp32 -> (numel,) fp32 (padding dropped;
    numel=None keeps the padded length)."""
    values = qmap.index_select(0, codes.reshape(-1).long()).view(scale.shape[0], -1) * scale.unsqueeze(-1)
    flat = values.view(-1)
    return flat if numel is None else flat[:numel]


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """codes (n,) integer in [0, 2**bits), n divisible by 8 // bits -> (n * bits // 8,) uint8.

    bits in {1, 2, 4}; within a byte the first code takes the highest bits (torchao's 4-bit order).
    """
    if bits not in (1, 2, 4):
        raise ValueError(f"pack_bits: bits must be 1, 2 or 4, got {bits}")
    per_byte = 8 // bits
    shifts = torch.arange(per_byte - 1, -1, -1, device=codes.device, dtype=torch.int32) * bits
    grouped = codes.reshape(-1, per_byte).to(torch.int32) << shifts
    return grouped.sum(dim=-1).to(torch.uint8)  # disjoint bit fields: sum == bitwise or


def unpack_bits(packed: Tensor, bits: int) -> Tensor:
    """packed (m,) uint8 -> (m * 8 // bits,) int32 codes; inverse of `pack_bits`."""
    if bits not in (1, 2, 4):
        raise ValueError(f"unpack_bits: bits must be 1, 2 or 4, got {bits}")
    per_byte = 8 // bits
    shifts = torch.arange(per_byte - 1, -1, -1, device=packed.device, dtype=torch.int32) * bits
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(-1)


_POW3 = (1, 3, 9, 27, 81)


def base3_nbytes(n: int) -> int:
    """Bytes that `pack_base3` produces for n ternary digits: ceil(n / 5)."""
    return -(-n // 5)


def pack_base3(trits: Tensor) -> Tensor:
    """trits (n,) integer in {0, 1, 2} -> (ceil(n / 5),) uint8, digit k of each byte weighted 3**k
    (zero-padded to a multiple of 5 digits)."""
    flat = trits.reshape(-1).to(torch.int32)
    pad = (-flat.numel()) % 5
    if pad:
        flat = F.pad(flat, (0, pad))
    weights = torch.tensor(_POW3, dtype=torch.int32, device=flat.device)
    return (flat.view(-1, 5) * weights).sum(dim=-1).to(torch.uint8)


_BASE3_DIGITS: dict[str, Tensor] = {}


def _base3_digits(device: torch.device) -> Tensor:
    """(256, 5) int32: the five base-3 digits of every byte value, lowest first (a look-up replaces a division and
    a remainder per digit)."""
    table = _BASE3_DIGITS.get(str(device))
    if table is None:
        weights = torch.tensor(_POW3, dtype=torch.int32)
        table = torch.div(torch.arange(256, dtype=torch.int32).unsqueeze(-1), weights, rounding_mode="floor") % 3
        table = _BASE3_DIGITS[str(device)] = table.to(device)
    return table


def unpack_base3(packed: Tensor, n: int | None = None) -> Tensor:
    """packed (m,) uint8 -> (n,) int32 digits in {0, 1, 2} (n = 5 * m when None); inverse of `pack_base3`."""
    flat = _base3_digits(packed.device).index_select(0, packed.reshape(-1).long()).view(-1)
    return flat if n is None else flat[:n]


def to_bf16(x: Tensor, *, stochastic: bool = False, generator: Stream | None = None,
            noise: Tensor | None = None) -> Tensor:
    """x fp32 (any shape) -> bf16, round-to-nearest-even, or stochastically rounded (unbiased).

    Stochastic rounding adds a uniform 16-bit integer to the low half of the fp32 bit pattern and truncates:
    the magnitude rounds up (away from zero) with probability equal to the dropped fraction, so E[bf16(x)] = x.
    The integer comes from `generator` (a counter-based stream or a torch.Generator), or from `noise` (uniform
    [0, 1) fp32 of x's size: floor(u * 2**16) is an exact uniform 16-bit integer). NaN and inf pass through
    unchanged.
    """
    x = x.float()
    if not stochastic:
        return x.to(torch.bfloat16)
    x = x.contiguous()  # the bit view needs it
    if isinstance(generator, CounterStream) and noise is None:
        r16 = generator.int16(x.shape, x.device)
    elif noise is None:
        r16 = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    else:
        r16 = (noise.view(x.shape) * 65536.0).to(torch.int32)
    bits = (x.view(torch.int32) + r16) & -65536  # -65536 == 0xFFFF0000 as int32
    rounded = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)
