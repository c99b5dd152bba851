"""The C kernel's int8 weight writer (kernels/int8_weight.h, native.quantize_int8) against its reference,
int8_weight.quantize: the same codes and scales, byte for byte, for fp32 and bf16 weights, one scale a row and
groups (a short last group too), nearest and stochastic rounding (from a counter offset, as a shard's), rows of
zeros and a weight large enough to be split over threads, for the kernel built for this machine, without AVX-512
and without vector extensions. A NaN or an infinity is left to the reference. The same bytes when a step writes
them in its own pass (native.Int8Sink), at any thread count, with the step's weight unchanged by it."""

import pytest
import torch

import slimopt
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
        assert lib is not None and (not why or native._state["why"]), why  # as asked, unless the default was not
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


STATES = {"adamw8bit": {"codec": "int8"}, "adamw4bit": {"codec": "int4"},
          "ternary_adamw": {"m_codec": "ternary", "v_codec": "factored"}, "lion8bit": {"rule": "lion", "codec": "int8"}}


def _stepped(state, w0, grads, group):
    """w0 stepped by SlimOptimizer under `state` with each gradient, each step inside an Int8Sink: the weight, the
    sink's codes and scales after the last step, and whether each step wrote them."""
    w = torch.nn.Parameter(w0.clone())
    opt = slimopt.SlimOptimizer([w], lr=1e-2, weight_decay=0.1, **STATES[state])
    rows, cols = w.shape
    codes = torch.full((rows, cols), 99, dtype=torch.int8)
    scales = torch.full((rows, int8_weight.group_count(cols, group)), -1.0)
    written = []
    for g in grads:
        with native.Int8Sink(w, group, codes, scales) as sink:
            opt.step_param(w, g)
        written.append(sink.written)
    return w.detach(), codes, scales, written


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [0, 64, 100])
def test_a_step_writes_the_reference_codes_in_its_own_pass(monkeypatch, level, state, dtype, group):
    _native(monkeypatch, level, torch.zeros(1, 1), 0, None)  # the build of this level, as the library
    w0 = _weight((37, 320), dtype)
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(w0.shape, generator=gen) * 1e-2).to(dtype) for _ in range(3)]
    w, codes, scales, written = _stepped(state, w0, grads, group)
    assert written == [True] * 3
    ref_codes, ref_scales = int8_weight.quantize(w, group)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    plain = torch.nn.Parameter(w0.clone())  # the same steps with no sink: the weight's bits unchanged by it
    opt = slimopt.SlimOptimizer([plain], lr=1e-2, weight_decay=0.1, **STATES[state])
    for g in grads:
        opt.step_param(plain, g)
    assert torch.equal(w, plain.detach())


def test_the_step_writes_the_codes_alike_on_any_thread_count():
    w0 = _weight((640, 1100), torch.float32, seed=2)  # 704k elements, rows that no group of 2^16 holds whole
    grads = [torch.randn(w0.shape, generator=torch.Generator().manual_seed(4)) * 1e-2]
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out.append(_stepped("ternary_adamw", w0, grads, 0))
    finally:
        torch.set_num_threads(before)
    ref_codes, ref_scales = int8_weight.quantize(out[0][0], 0)
    for w, codes, scales, written in out:
        assert written == [True] and torch.equal(w, out[0][0])
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


def test_codes_the_step_did_not_write_are_not_claimed():
    w0 = _weight((64, 128), torch.float32)  # large enough for 8-bit moments
    nan = torch.full((64, 128), 1e-3)
    nan[2, 5] = float("nan")  # a NaN weight after the step: the kernel leaves its codes to the reference
    *_, written = _stepped("adamw8bit", w0, [torch.full((64, 128), 1e-3), nan], 0)
    assert written == [True, False]
    w = torch.nn.Parameter(w0.clone())
    opt = slimopt.SlimOptimizer([w], lr=1e-2, rule="lion")
    codes, scales = torch.zeros(64, 128, dtype=torch.int8), torch.zeros(64, 1)
    with native.Int8Sink(w, 0, codes, scales) as sink:
        opt.step_param(w, torch.ones(64, 128))
        assert sink.written
        with torch.no_grad():
            w.add_(1.0)  # changed after the kernel wrote the codes: they no longer hold its rounding
    assert not sink.written
    other = torch.nn.Parameter(w0.clone())
    opt = slimopt.SlimOptimizer([w, other], lr=1e-2, rule="lion")
    with native.Int8Sink(w, 0, codes, scales) as sink:
        opt.step_param(other, torch.ones(64, 128))  # another weight's step writes nothing of w's
    assert not sink.written
