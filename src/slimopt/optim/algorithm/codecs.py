"""Storage forms ("codecs") of optimizer moments: how an fp32 moment is kept between steps.

The optimizer computes in fp32 and stores narrow (docs/design.md, section 3): each step it calls
``decode(key, state, shape)``, updates the moment in fp32, and ``encode(key, x, state, generator)`` writes it back
into the same state tensors in place. A codec is a thin, stateless object around the pure functions of
`slimopt.optim.algorithm.quant`; everything it stores is a plain tensor in the optimizer state, named ``key`` (the main
tensor) or ``key + "_<suffix>"``, so state_dicts load with ``torch.load(weights_only=True)``.

Details: docs/modules.md, ``slimopt.optim.algorithm.codecs``.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, MutableMapping

import torch
from torch import Tensor

from slimopt.optim.algorithm import quant as Q

__all__ = [
    "SMALL_NUMEL",
    "M_SPECS",
    "V_SPECS",
    "TERNARY_DEFAULT",
    "TERNARY_SPECS",
    "Codec",
    "Fp32Codec",
    "Bf16Codec",
    "BlockCodec",
    "TernaryCodec",
    "FactoredCodec",
    "factored_means",
    "Window",
    "make_codec",
    "resolve_codecs",
]

SMALL_NUMEL = 4096  # tensors with fewer elements are always stored fp32 (as the peers do)

# The default behind the spec "ternary": the cheapest form that trained as well as AdamW (the comparisons above).
TERNARY_DEFAULT = "ternary_sr_rms64"

# The ternary specs: name -> (rounding, scale, block, scale dtype). rounding "sr": stochastic; "ef": nearest with
# a residual trit carried to the next encode. scale "absmax": the block's largest magnitude (every value lies in
# [-s, s]); "mean": its mean magnitude (BitNet b1.58's absmean, arXiv 2402.17764); "rms": its root mean square
# (values beyond +-s clip to +-s with these two). The module docstring compares them; issue 15 screened more forms
# (docs/reproduction.md, "Ternary optimizer state"), each one line here.
TERNARY_SPECS: dict[str, tuple[str, str, int, torch.dtype]] = {
    "ternary_sr": ("sr", "absmax", 256, torch.float32),
    "ternary_ef": ("ef", "absmax", 256, torch.float32),
    "ternary_sr_mean64": ("sr", "mean", 64, torch.bfloat16),
    "ternary_sr_rms64": ("sr", "rms", 64, torch.bfloat16),
    "ternary_ef_mean64": ("ef", "mean", 64, torch.bfloat16),
}

_COMMON_SPECS = ("auto", "fp32", "bf16", "bf16_sr", "int8", "int4")
M_SPECS = _COMMON_SPECS + ("ternary",) + tuple(TERNARY_SPECS)
V_SPECS = _COMMON_SPECS + ("factored",)
_ALL_SPECS = tuple(dict.fromkeys(M_SPECS + V_SPECS))
_STATE_BITS = {32: "fp32", 16: "bf16", 8: "int8", 4: "int4", 2: "ternary"}


def _numel(shape: torch.Size | tuple[int, ...]) -> int:
    return math.prod(shape)


def _check_into(key: str, new: Tensor, state: Mapping[str, Tensor]) -> None:
    old = state[key]
    if old.shape != new.shape:  # copy_ would broadcast silently
        raise ValueError(f"encode: state[{key!r}] has shape {tuple(old.shape)} but the value encodes to "
                         f"{tuple(new.shape)}; was the moment initialised for another shape?")


def _copy_dense(key: str, x: Tensor, state: MutableMapping[str, Tensor]) -> None:
    """Copy x into a dense state tensor of the same number of elements (any view of the moment's shape)."""
    dst = state[key]
    if x.numel() != dst.numel():
        raise ValueError(f"encode: state[{key!r}] has shape {tuple(dst.shape)} but x has shape {tuple(x.shape)}")
    dst.copy_(x.reshape(dst.shape))


class Codec:
    """How one moment is stored. Stateless: all data lives in the state tensors it creates.

    name: the canonical spec of what is stored (e.g. "int8"); needs_generator: True when encode draws random
    numbers (stochastic rounding); encode then uses the generator it is given, or torch's default one, or the
    uniform noise it is handed (``noise``, of ``noise_numel(shape)`` elements: a compiled step can draw it
    outside the graph, since a generator argument inside it breaks the graph).
    """

    name: str = "codec"
    needs_generator: bool = False

    @property
    def scratch_kind(self) -> str:
        """The codec whose measured step temporaries this one's match (the planner's tables are keyed by it)."""
        return self.name

    def init(self, key: str, shape: torch.Size, device) -> dict[str, Tensor]:
        """State tensors of an all-zero moment of `shape`: ``key`` is the main tensor, others ``key_<suffix>``."""
        raise NotImplementedError

    def decode(self, key: str, state: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        """The stored moment as a new fp32 tensor of `shape`."""
        raise NotImplementedError

    def encode(self, key: str, x: Tensor, state: MutableMapping[str, Tensor],
               generator: Q.Stream | None = None, noise: Tensor | None = None) -> None:
        """Store x (fp32, the moment's shape) into the existing state tensors in place (copy_).

        noise: optional uniform [0, 1) fp32 tensor of noise_numel(shape) elements, used instead of drawing from
        `generator`; ignored by deterministic codecs."""
        raise NotImplementedError

    def noise_numel(self, shape: torch.Size) -> int:
        """Number of uniform draws one encode of `shape` consumes (0 for deterministic codecs)."""
        return 0

    def estimate(self, key: str, state: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        """The codec's best fp32 estimate of the moment: decode plus any residual carried for error feedback.

        For transforming a stored moment (e.g. rotating it into a new subspace): rotate ``estimate``, call
        ``clear_feedback``, then ``encode``; the carried residual lives in the old coordinates."""
        return self.decode(key, state, shape)

    def clear_feedback(self, key: str, state: MutableMapping[str, Tensor]) -> None:
        """Zero any residual carried for error feedback, in place (nothing to do for other codecs)."""

    def nbytes(self, shape: torch.Size) -> int:
        """Exact bytes of the tensors ``init`` creates for `shape`, padding included."""
        raise NotImplementedError

    def align(self, shape: torch.Size) -> int:
        """Element ranges of a moment of `shape` can be read and written on their own (``open``) when they start at
        a multiple of this: 1 for plain storage, the block size for blockwise codes."""
        return 1

    def part(self, key: str, state: Mapping[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
        """Views of the state tensors that store elements [start, stop) of the flattened moment, under the same
        keys; ``decode`` / ``encode`` on them read and write only that range. start: a multiple of ``align``."""
        raise NotImplementedError

    def open(self, key: str, state: MutableMapping[str, Tensor], shape: torch.Size) -> "Window":
        """The moment `key` of `shape`, to be read and written one aligned element range at a time."""
        return Window(self, key, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Window:
    """One moment read and written one element range at a time (``slimopt.optim.routes.windowed``): decode a range, update
    it, encode it back, next range. Ranges start at a multiple of the codec's ``align``, in increasing order, and
    are each encoded at most once; ``close`` ends the pass."""

    def __init__(self, codec: Codec, key: str, state: MutableMapping[str, Tensor]) -> None:
        self.codec, self.key, self.state = codec, key, state

    def decode(self, start: int, stop: int) -> Tensor:
        """Elements [start, stop) of the flattened moment, fp32, shape (stop - start,)."""
        part = self.codec.part(self.key, self.state, start, stop)
        return self.codec.decode(self.key, part, torch.Size((stop - start,)))

    def encode(self, start: int, stop: int, x: Tensor, generator: Q.Stream | None = None) -> None:
        """Store x (fp32, stop - start elements) as elements [start, stop)."""
        part = self.codec.part(self.key, self.state, start, stop)
        self.codec.encode(self.key, x.reshape(-1), part, generator=generator)

    def close(self) -> None:
        """Finish the pass (a codec whose stored form spans ranges writes what it gathered)."""

    def defer_to(self, batch) -> None:
        """Let ``close`` leave what it must gather from other ranks to `batch` (a step's queue that runs it, with
        every other such collective, at the end of the step): nothing to leave here."""


def _flat_part(key: str, state: Mapping[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    return {key: state[key].view(-1)[start:stop]}


class Fp32Codec(Codec):
    """Plain fp32 (or fp64 for fp64 parameters under "auto"): 4 (8) bytes per value.

    decode returns the stored tensor itself, so the rule's in-place update is the store and encode has nothing
    left to copy: the full-precision path costs no extra pass over memory.
    """

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.name = "fp32" if dtype == torch.float32 else "fp64"

    def init(self, key, shape, device):
        return {key: torch.zeros(shape, dtype=self.dtype, device=device)}

    def decode(self, key, state, shape):
        return state[key].view(shape)

    def encode(self, key, x, state, generator=None, noise=None):
        dst = state[key]
        if x.data_ptr() == dst.data_ptr() and x.numel() == dst.numel():
            return  # x is the stored tensor, updated in place
        _copy_dense(key, x, state)

    def nbytes(self, shape):
        return torch.tensor([], dtype=self.dtype).element_size() * _numel(shape)

    def part(self, key, state, start, stop):
        return _flat_part(key, state, start, stop)


class Bf16Codec(Codec):
    """bf16 (2 bytes per value), round-to-nearest-even or stochastic rounding (unbiased)."""

    def __init__(self, stochastic: bool = False):
        self.stochastic = stochastic
        self.name = "bf16_sr" if stochastic else "bf16"
        self.needs_generator = stochastic

    def init(self, key, shape, device):
        return {key: torch.zeros(shape, dtype=torch.bfloat16, device=device)}

    def decode(self, key, state, shape):
        return state[key].float().view(shape)

    def encode(self, key, x, state, generator=None, noise=None):
        _copy_dense(key, Q.to_bf16(x, stochastic=self.stochastic, generator=generator, noise=noise), state)

    def noise_numel(self, shape):
        return _numel(shape) if self.stochastic else 0

    def nbytes(self, shape):
        return 2 * _numel(shape)

    def part(self, key, state, start, stop):
        return _flat_part(key, state, start, stop)


class BlockCodec(Codec):
    """Blockwise absmax quantization onto a fixed map: int8 (block 256, dynamic map) or int4 (block 128, two
    codes a byte; dynamic map for m, linear map without zero for v).

    State: key = uint8 codes, flat and padded to whole blocks ((n_blocks * block * bits / 8,)); key_scale = fp32
    per-block absmax (n_blocks,). Bytes: n_blocks * (block * bits / 8 + 4) with n_blocks = ceil(n / block):
    int8 ceil(n/256) * 256 + 4 ceil(n/256), int4 ceil(n/128) * 64 + 4 ceil(n/128).
    """

    def __init__(self, name: str, map_name: str, bits: int, block_size: int):
        if bits not in (4, 8):
            raise ValueError(f"BlockCodec: bits must be 4 or 8, got {bits}")
        self.name = name
        self.map_name = map_name
        self.bits = bits
        self.block_size = block_size

    def _nblocks(self, shape) -> int:
        return -(-_numel(shape) // self.block_size)

    def init(self, key, shape, device):
        nb = self._nblocks(shape)
        return {key: torch.zeros(nb * self.block_size * self.bits // 8, dtype=torch.uint8, device=device),
                key + "_scale": torch.zeros(nb, dtype=torch.float32, device=device)}

    def decode(self, key, state, shape):
        codes = state[key]
        if self.bits == 4:
            codes = Q.unpack_bits(codes, 4)
        qmap = Q.get_map(self.map_name, codes.device)
        return Q.dequantize_blockwise(codes, state[key + "_scale"], qmap, _numel(shape)).view(shape)

    def encode(self, key, x, state, generator=None, noise=None):
        qmap = Q.get_map(self.map_name, x.device)
        codes, scale = Q.quantize_blockwise(x, qmap, self.block_size)
        if self.bits == 4:
            codes = Q.pack_bits(codes, 4)
        _check_into(key, codes, state)
        state[key].copy_(codes)
        state[key + "_scale"].copy_(scale)

    def nbytes(self, shape):
        nb = self._nblocks(shape)
        return nb * self.block_size * self.bits // 8 + 4 * nb

    def align(self, shape):
        return self.block_size

    def part(self, key, state, start, stop):
        b0, b1 = start // self.block_size, -(-stop // self.block_size)  # whole blocks; the last one padded
        per_block = self.block_size * self.bits // 8
        return {key: state[key][b0 * per_block:b1 * per_block], key + "_scale": state[key + "_scale"][b0:b1]}


_ZERO_TRITS = 121  # a byte of five base-3 digits 1 (1 + 3 + 9 + 27 + 81): five zero trits


class TernaryCodec(Codec):
    """Ternary {-1, 0, +1} x a per-block scale, five trits a byte (base 3: 1.6 bits per value).

    rounding "sr": stochastic rounding (``ternary_sr``). "ef": nearest rounding with the residual carried to the
    next encode as one more trit, r in {-s/2, 0, +s/2} rounded stochastically (``ternary_ef``; see the module
    docstring for why a trit). scale "absmax", "mean" or "rms" of the block (``TERNARY_SPECS``).
    State: key = uint8 (ceil(n_blocks * B / 5),), key_scale = scale_dtype (n_blocks,), and for "ef"
    key_err = uint8 (ceil(n_blocks * B / 5),).
    Bytes: ceil(B nb / 5) (twice with "ef") + scale bytes * nb.
    """

    def __init__(self, name: str = "ternary_sr", rounding: str = "sr", scale: str = "absmax", block_size: int = 256,
                 scale_dtype: torch.dtype = torch.float32):
        if block_size < 1:
            raise ValueError(f"TernaryCodec: block_size must be >= 1, got {block_size}")
        if rounding not in ("sr", "ef") or scale not in ("absmax", "mean", "rms"):
            raise ValueError(f"TernaryCodec: rounding must be sr or ef and scale absmax, mean or rms, got "
                             f"{rounding!r}, {scale!r}")
        self.name = name
        self.rounding = rounding
        self.feedback = rounding == "ef"
        self.scale = scale
        self.block_size = block_size
        self.scale_dtype = scale_dtype
        self.needs_generator = True  # stochastic rounding of the value or of the carried residual

    @property
    def scratch_kind(self) -> str:
        # every block scale allocates what the absmax forms do
        return "ternary_ef" if self.feedback else "ternary_sr"

    def _nblocks(self, shape) -> int:
        return -(-_numel(shape) // self.block_size)

    def init(self, key, shape, device):
        nb = self._nblocks(shape)
        n_pad = nb * self.block_size
        # every digit 1, i.e. trit 0: the codes mean zero whatever the scale (which starts at 0 as well)
        out = {key: torch.full((Q.base3_nbytes(n_pad),), _ZERO_TRITS, dtype=torch.uint8, device=device),
               key + "_scale": torch.zeros(nb, dtype=self.scale_dtype, device=device)}
        if self.feedback:
            out[key + "_err"] = torch.full((Q.base3_nbytes(n_pad),), _ZERO_TRITS, dtype=torch.uint8, device=device)
        return out

    @staticmethod
    def _trits_times_scale(packed: Tensor, scale: Tensor, n_pad: int, unit: float) -> Tensor:
        """packed base-3 digits {0, 1, 2} -> (digit - 1) * unit * block scale, (n_blocks, block) fp32."""
        trits = Q.unpack_base3(packed, n_pad)
        return ((trits - 1).float() * unit).view(scale.shape[0], -1) * scale.float().unsqueeze(-1)

    def _values(self, key, state, n_pad) -> Tensor:
        """Decoded moment, padded: (n_blocks, block) fp32."""
        return self._trits_times_scale(state[key], state[key + "_scale"], n_pad, 1.0)

    def _residual(self, key, state, n_pad) -> Tensor:
        """Carried residual, padded: (n_blocks, block) fp32, in {-s/2, 0, +s/2}."""
        return self._trits_times_scale(state[key + "_err"], state[key + "_scale"], n_pad, 0.5)

    def decode(self, key, state, shape):
        n_pad = state[key + "_scale"].shape[0] * self.block_size
        return self._values(key, state, n_pad).view(-1)[: _numel(shape)].view(shape)

    def estimate(self, key, state, shape):
        if not self.feedback:
            return self.decode(key, state, shape)
        n_pad = state[key + "_scale"].shape[0] * self.block_size
        full = self._values(key, state, n_pad) + self._residual(key, state, n_pad)
        return full.view(-1)[: _numel(shape)].view(shape)

    def clear_feedback(self, key, state):
        if self.feedback:
            state[key + "_err"].fill_(_ZERO_TRITS)

    def noise_numel(self, shape):
        return self._nblocks(shape) * self.block_size

    def block_scale(self, blocks: Tensor, numel: int) -> Tensor:
        """(n_blocks, B) fp32 holding `numel` values -> (n_blocks,) fp32 scale, as stored (rounded to the scale
        dtype), so that encode normalizes by exactly what decode multiplies by."""
        if self.scale == "absmax":
            scale = Q.block_absmax(blocks)
        else:
            scale = (Q.block_absmean if self.scale == "mean" else Q.block_rms)(blocks, numel)
        return scale if self.scale_dtype == torch.float32 else scale.to(self.scale_dtype).float()

    def encode(self, key, x, state, generator=None, noise=None):
        n = x.numel()
        tmap = Q.get_map("ternary", x.device)
        if self.feedback:
            nb = state[key + "_scale"].shape[0]
            carried = self._residual(key, state, nb * self.block_size).view(-1)[:n]
            blocks = Q.to_blocks(x.reshape(-1) + carried, self.block_size)  # padding stays exactly zero
        else:
            blocks = Q.to_blocks(x, self.block_size)
        scale = self.block_scale(blocks, n)
        normed = Q.normalize_blocks(blocks, scale)  # beyond [-1, 1] where a value exceeds a mean or rounded scale
        u = Q.uniform(normed.shape, normed.device, generator) if noise is None else noise.view(normed.shape)
        err = None
        if self.feedback:
            trits = Q.nearest_codes(normed, tmap, torch.int32)  # pack_base3 takes int32
            resid2 = (normed - (trits - 1).float()) * 2.0  # twice the residual: in [-1, 1] unless clipped, exact
            err = Q.pack_base3(Q.stochastic_codes(resid2, tmap, u).view(-1))
            _check_into(key + "_err", err, state)
        else:
            trits = Q.stochastic_codes(normed, tmap, u)  # clamps to the end trits beyond [-1, 1]
        packed = Q.pack_base3(trits.view(-1))
        _check_into(key, packed, state)
        state[key].copy_(packed)
        state[key + "_scale"].copy_(scale)
        if err is not None:
            state[key + "_err"].copy_(err)

    def nbytes(self, shape):
        nb = self._nblocks(shape)
        n_pad = nb * self.block_size
        return (Q.base3_nbytes(n_pad) * (2 if self.feedback else 1)
                + torch.finfo(self.scale_dtype).bits // 8 * nb)

    def align(self, shape):
        return math.lcm(self.block_size, 5)  # whole blocks that start at a whole byte of five trits

    def part(self, key, state, start, stop):
        b0, b1 = start // self.block_size, -(-stop // self.block_size)
        byte0 = start // 5
        byte1 = byte0 + Q.base3_nbytes((b1 - b0) * self.block_size)
        out = {key: state[key][byte0:byte1], key + "_scale": state[key + "_scale"][b0:b1]}
        if self.feedback:
            out[key + "_err"] = state[key + "_err"][byte0:byte1]
        return out


def factored_means(x: Tensor, dim: int, count: int) -> Tensor:
    """Sums of the 2-D x along `dim` accumulated in fp64 (no fp64 copy of x is made) divided by `count`, rounded
    to fp32: the one arithmetic of every factored encode (whole tensor, windows of rows, the C kernel, row shards),
    whose fp64 sums round to the same fp32 means whatever order their terms come in."""
    return (x.sum(dim=dim, dtype=torch.float64) / count).float()


class FactoredCodec(Codec):
    """Adafactor-style second moment (arXiv 1804.04235) for 2-D (R, C) moments: key = fp32 row means (R,),
    key_col = fp32 column means (C,); decoded as outer(row, col) / mean(row). Any other shape is stored fp32.
    Bytes: 4 (R + C) for 2-D, else 4 n. The means are taken in fp64 (``factored_means``)."""

    name = "factored"

    def init(self, key, shape, device):
        if len(shape) != 2:
            return {key: torch.zeros(shape, dtype=torch.float32, device=device)}
        rows, cols = shape
        return {key: torch.zeros(rows, dtype=torch.float32, device=device),
                key + "_col": torch.zeros(cols, dtype=torch.float32, device=device)}

    def decode(self, key, state, shape):
        if len(shape) != 2:
            return state[key].float().clone().view(shape)
        row, col = state[key], state[key + "_col"]
        # mean(row) == mean(col) == mean(v); an all-zero v has mean 0 and decodes to 0 (0 / tiny).
        denom = row.mean().clamp_min(torch.finfo(torch.float32).tiny)
        return torch.outer(row, col) / denom

    def encode(self, key, x, state, generator=None, noise=None):
        if x.dim() != 2 or key + "_col" not in state:
            _copy_dense(key, x, state)
            return
        # the arithmetic of a pass over row ranges (FactoredRows), of the C kernel and of row shards
        row, col = factored_means(x, 1, x.shape[1]), factored_means(x, 0, x.shape[0])
        _check_into(key, row, state)
        _check_into(key + "_col", col, state)
        state[key].copy_(row)
        state[key + "_col"].copy_(col)

    def nbytes(self, shape):
        if len(shape) != 2:
            return 4 * _numel(shape)
        return 4 * (shape[0] + shape[1])

    def align(self, shape):
        return shape[1] if len(shape) == 2 else 1  # whole rows

    def part(self, key, state, start, stop):  # a moment that is not 2-D: stored fp32, element by element
        return _flat_part(key, state, start, stop)

    def open(self, key, state, shape):
        if len(shape) != 2 or key + "_col" not in state:
            return Window(self, key, state)
        return FactoredRows(key, state, shape)


class FactoredRows(Window):
    """A factored second moment read and written a range of whole rows at a time. A range decodes from the means
    stored before the pass (the mean of all rows is taken once, at the start); its new row means are written at
    once (no later range reads them), its column sums are added up in fp64 and the column means written by
    ``close``, as sum / rows, as the whole-tensor encode and the row-sharded form (which all-reduces the sums)
    compute them. (fp64 partial sums added in another order round to the same fp32 mean but where the exact mean
    lies within about n 2^-53 of a rounding boundary of fp32.)"""

    def __init__(self, key: str, state: MutableMapping[str, Tensor], shape: torch.Size) -> None:
        super().__init__(FactoredCodec(), key, state)
        self.rows, self.cols = shape
        row = state[key]
        self.denom = row.mean().clamp_min(torch.finfo(torch.float32).tiny)
        self.col = state[key + "_col"]  # the column means the pass decodes with (whole)
        self.col_sum = torch.zeros(self.cols, dtype=torch.float64, device=row.device)

    def decode(self, start, stop):
        r0, r1 = start // self.cols, stop // self.cols
        return (torch.outer(self.state[self.key][r0:r1], self.col) / self.denom).view(-1)

    def encode(self, start, stop, x, generator=None):
        r0, r1 = start // self.cols, stop // self.cols
        x = x.view(r1 - r0, self.cols)
        self.state[self.key][r0:r1] = factored_means(x, 1, self.cols)
        self.col_sum += x.sum(dim=0, dtype=torch.float64)

    def close(self):
        self.state[self.key + "_col"].copy_((self.col_sum / self.rows).float())


@functools.lru_cache(maxsize=None)
def _codec(name: str, role: str) -> Codec:
    """One shared instance per (canonical spec, role): codecs hold no data."""
    if name == "fp32":
        return Fp32Codec()
    if name == "fp64":
        return Fp32Codec(torch.float64)
    if name in ("bf16", "bf16_sr"):
        return Bf16Codec(stochastic=name == "bf16_sr")
    if name == "int8":
        return BlockCodec("int8", "dynamic8_signed" if role == "m" else "dynamic8_unsigned", 8, 256)
    if name == "int4":
        return BlockCodec("int4", "dynamic4_signed" if role == "m" else "linear4_nozero", 4, 128)
    if name in TERNARY_SPECS:
        rounding, scale, block, scale_dtype = TERNARY_SPECS[name]
        return TernaryCodec(name, rounding, scale, block, scale_dtype)
    if name == "factored":
        return FactoredCodec()
    raise AssertionError(name)


def make_codec(spec: str, role: str, numel: int, param_dtype: torch.dtype) -> Codec:
    """The codec storing one moment. role "m" (signed first moment / momentum) or "v" (non-negative second
    moment); numel: elements of the moment (below SMALL_NUMEL always fp32); param_dtype: the parameter's dtype,
    which "auto" follows (bf16 for bf16 parameters, else fp32)."""
    if role not in ("m", "v"):
        raise ValueError(f"make_codec: role must be 'm' or 'v', got {role!r}")
    allowed = M_SPECS if role == "m" else V_SPECS
    if spec not in allowed:
        why = ""
        if spec in _ALL_SPECS:
            why = (" (the second moment is non-negative: a ternary sign code has nothing to store)" if role == "v"
                   else " (factored stores a non-negative second moment only)")
        raise ValueError(f"make_codec: spec={spec!r} is not allowed for role {role!r}{why}; "
                         f"allowed: {', '.join(allowed)}")
    full = "fp64" if param_dtype == torch.float64 else "fp32"  # fp64 parameters compute and store in fp64
    if numel < SMALL_NUMEL:
        return _codec(full, role)
    if spec == "auto":
        spec = "bf16" if param_dtype == torch.bfloat16 else full
    elif spec == "ternary":
        spec = TERNARY_DEFAULT
    return _codec(spec, role)


def resolve_codecs(codec: str | None, m_codec: str | None, v_codec: str | None, state_bits: int | None
                   ) -> tuple[str, str]:
    """Per-param-group settings -> (m_spec, v_spec).

    codec: applies to both moments; a ternary codec means ternary m with factored v. m_codec / v_codec: override
    one moment. state_bits: 32 / 16 / 8 / 4 / 2, shorthand for fp32 / bf16 / int8 / int4 / ternary. codec and
    state_bits together must agree. Default (all None): ("auto", "auto").
    """
    for name, value, allowed in (("codec", codec, _ALL_SPECS), ("m_codec", m_codec, M_SPECS),
                                 ("v_codec", v_codec, V_SPECS)):
        if value is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not a codec allowed here; allowed: {', '.join(allowed)}")
    if state_bits is not None:
        if isinstance(state_bits, bool) or state_bits not in _STATE_BITS:
            raise ValueError(f"state_bits={state_bits!r} is not allowed; allowed: "
                             f"{', '.join(f'{b} ({s})' for b, s in _STATE_BITS.items())}")
        implied = _STATE_BITS[state_bits]
        if codec is not None and _canonical_family(codec) != _canonical_family(implied):
            raise ValueError(f"codec={codec!r} conflicts with state_bits={state_bits} (which means {implied!r}); "
                             "set one of them")
        if codec is None:
            codec = implied
    m_spec = v_spec = "auto"
    if codec is not None:
        if codec == "factored":
            raise ValueError("codec='factored' would factor the first moment too; it stores the second moment "
                             "only: use v_codec='factored'")
        if codec.startswith("ternary"):
            m_spec, v_spec = codec, "factored"
        else:
            m_spec = v_spec = codec
    if m_codec is not None:
        m_spec = m_codec
    if v_codec is not None:
        v_spec = v_codec
    return m_spec, v_spec


def _canonical_family(spec: str) -> str:
    """The storage family a spec belongs to, for comparing codec with state_bits (ternary_ef is 2-bit too)."""
    if spec.startswith("ternary"):
        return "ternary"
    if spec.startswith("bf16"):
        return "bf16"
    return spec
