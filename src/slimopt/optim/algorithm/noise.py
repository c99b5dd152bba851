"""Counter-based random streams for stochastic rounding: the noise of element j is half of a hash of (key, j // 2).

A stateful generator (torch.Generator) hands out numbers in the order they are asked for, so a kernel that rounds
a tile at a time cannot draw its own: the caller had to draw the whole window's noise into a tensor first (a pass
over memory and, on a CPU, 4-7 ns an element, more than the rest of a ternary step), and a window or an FSDP2
shard had to extend the seed to get a stream of its own. A counter-based stream (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) makes the number of element j a pure function of the stream's key and j:
any kernel (the C kernel of ``native.py``, a Triton kernel, the eager torch ops here) computes exactly the same
noise for the same elements, in any order, tile by tile, with nothing stored. A window starting at element s of a
parameter, or a shard starting at its row r, reads the parameter's one stream from s (or r times the row length):
every window and every shard draws exactly the numbers of the whole-tensor step.

Details: docs/modules.md, ``slimopt.optim.algorithm.noise``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CounterStream", "mix_seed", "mix32_int"]

_M32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (splitmix64), so nearby inputs give unrelated streams."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        x = z ^ (z >> 31)
    return x & ((1 << 63) - 1)


_C1, _C2 = 0x7FEB352D, 0x846CA68B
_PHI = 0x9E3779B9  # 2^32 / the golden ratio, odd: a counter's high word times it, mod 2^32


def mix32_int(x: int) -> int:
    """mix32 of one Python integer (the same function as ``_mix32_`` on tensors)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _signed(c: int) -> int:
    """A 32-bit pattern as the int32 value that holds it."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _mix32_(x: Tensor) -> Tensor:
    """mix32 in place on an int32 tensor holding 32-bit patterns: int32 products wrap mod 2^32 (their low 32
    bits are the unsigned product's), and each right shift is masked to be a logical one."""
    t = x >> 16
    x ^= t.bitwise_and_(0xFFFF)
    x.mul_(_signed(_C1))
    t = x >> 15
    x ^= t.bitwise_and_(0x1FFFF)
    x.mul_(_signed(_C2))
    t = x >> 16
    x ^= t.bitwise_and_(0xFFFF)
    return x


@dataclass(frozen=True)
class CounterStream:
    """The random numbers of one tensor's stochastic rounding at one step: element j (counted from `offset`)
    gets 16 bits of ``hash(key, (offset + j) // 2)`` (``int16``). key: a 63-bit seed (``projectors.mix_seed`` of
    the group's seed, the parameter, the step and the moment); offset: the counter of the first element this view
    draws for."""

    key: int
    offset: int = 0

    def at(self, start: int) -> "CounterStream":
        """The same stream read from element `start` of this view on (a window, a shard)."""
        return CounterStream(self.key, self.offset + int(start))

    def fork(self, part: int) -> "CounterStream":
        """A stream of its own for a part that is not a range of this one's elements (a column window): the key
        mixed with `part`, read from the same offset."""
        return CounterStream(mix_seed(self.key, part), self.offset)

    @property
    def key_words(self) -> tuple[int, int]:
        """The key's low and high 32-bit words (what the kernels take)."""
        return self.key & _M32, (self.key >> 32) & _M32

    @property
    def key32(self) -> int:
        """The 32-bit key the hash mixes in: the two key words mixed, ``mix32(mix32(high) ^ low)`` (each kernel
        computes it from the key words once per call)."""
        k0, k1 = self.key_words
        return mix32_int(mix32_int(k1) ^ k0)

    def bits(self, numel: int, device: torch.device | str) -> Tensor:
        """(numel,) int32 holding the 32-bit hashes of counters [offset, offset + numel) as bit patterns (4 bytes
        an element, with one temporary of the same size): counter c's is ``mix32(lo ^ hi * PHI ^ key32)``, lo and
        hi its low and high 32-bit words, PHI = 0x9E3779B9 (products mod 2^32): one round a counter."""
        key = self.key32
        out = torch.empty(numel, dtype=torch.int32, device=device)
        done = 0
        while done < numel:  # a run of counters that share their high word
            j = self.offset + done
            lo, hi = j & _M32, j >> 32
            k = min(numel - done, (1 << 32) - lo, 1 << 30)
            x = out[done:done + k]
            torch.arange(k, dtype=torch.int32, device=device, out=x)
            x.add_(_signed(lo))  # the int32 sum wraps where the uint32 counter does not: the same bits
            x ^= _signed(((hi * _PHI) ^ key) & _M32)
            _mix32_(x)
            done += k
        return out

    def uniform(self, shape: torch.Size | tuple[int, ...], device: torch.device | str) -> Tensor:
        """Uniform [0, 1) fp32 of `shape`, element j of its row-major order from counter offset + j: its 16-bit
        integer (``int16``) times 2^-16, exact."""
        return self.int16(shape, device).float().mul_(2.0 ** -16)

    def int16(self, shape: torch.Size | tuple[int, ...], device: torch.device | str) -> Tensor:
        """Uniform integers in [0, 65536) as int32 of `shape`, element j of its row-major order from counter
        c = offset + j: a half of the hash of c // 2, the high half for an even c and the low half for an odd
        one (one hash serves two elements: half the work of a hash an element, in every kernel)."""
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=torch.int32, device=device)
        first = self.offset // 2
        h = CounterStream(self.key, first).bits((self.offset + n - 1) // 2 - first + 1, device)
        halves = torch.stack([(h >> 16).bitwise_and_(0xFFFF), h.bitwise_and_(0xFFFF)], dim=1).view(-1)
        start = self.offset % 2
        return halves[start:start + n].view(shape)
