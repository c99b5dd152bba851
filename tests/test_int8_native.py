"""The C kernel's int8 weight writer (kernels/int8_weight.h, native.quantize_int8) against its reference,
int8_weight.quantize: the same codes and scales, byte for byte, for fp32 and bf16 weights, one scale a row and
groups (a short last group too), nearest and stochastic rounding (from a counter offset, as a shard's), rows of
zeros and a weight large enough to be split over threads, for the kernel built for this machine, without AVX-512
and without vector extensions. A NaN or an infinity is left to the reference."""

import pytest
import torch

from slimopt.optim.algorithm import int8_weight
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.routes.cpu import native

LEVELS = {"native": None, "no-avx512": ["-march=native", "-mno-avx512f"], "portable": []}


def _native(monkeypatch, level, w, group, noise):
    lib = native.library()
    if lib is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    if LEVELS[level] is not None:
        lib, why = native._build(LEVELS[level])
        assert lib is not None, why
    monkeypatch.setitem(native._state, "lib", lib)
    rows, cols = w.shape
    codes = torch.full((rows, cols), 99, dtype=torch.int8)
    scales = torch.full((rows, int8_weight.group_count(cols, group)), -1.0)
    done = native.quantize_int8(w, group, noise, codes, scales)
    return done, codes, scales


def _weight(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # magnitudes spread along a row
    w[1] = 0.0  # an all-zero row: scale 0, codes 0
    w[2, :5] = 1e-40  # subnormals
    return w.to(dtype)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [0, 64, 100])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_the_kernel_writes_the_reference_bytes(monkeypatch, level, dtype, group, stochastic):
    w = _weight((37, 333), dtype)
    noise = CounterStream(key=0x1234_5678_9ABC, offset=1000) if stochastic else None
    done, codes, scales = _native(monkeypatch, level, w, group, noise)
    ref_codes, ref_scales = int8_weight.quantize(w, group, noise=noise)
    assert done
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


def test_a_weight_split_over_threads_gives_the_same_bytes(monkeypatch):
    w = _weight((640, 1024), torch.float32, seed=1)  # 655k elements: two threads' worth
    noise = CounterStream(key=77, offset=0)
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            done, codes, scales = _native(monkeypatch, "native", w, 0, noise)
            assert done
            out.append((codes, scales))
    finally:
        torch.set_num_threads(before)
    ref_codes, ref_scales = int8_weight.quantize(w, 0, noise=noise)
    for codes, scales in out:
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_an_infinity_is_left_to_the_reference(monkeypatch, bad):
    w = _weight((8, 40), torch.float32)
    w[3, 7] = bad
    done, _, _ = _native(monkeypatch, "native", w, 0, None)
    assert not done
