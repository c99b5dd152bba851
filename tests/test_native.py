"""The one-pass CPU step (native.py, kernels/elementwise_step.c) against the eager window step, the reference.

Every rule x codec combination the kernel reads and writes itself, plus the codecs it steps through an fp32 buffer
(factored, bf16_sr): same state tensors, bit for bit here; the fp32 weights within rounding (the kernel's square
root is correctly rounded, torch's CPU square root is not always: one fp32 ulp in some elements of the update).
Windows, a path switch across a weights_only checkpoint, the count tables, and the fallback without a compiler.
"""

import multiprocessing
import os
import re
import shutil
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state, assert_state_close, random_grads, random_params, run_steps, save_and_load

import slimopt
from slimopt.optim.algorithm import budget
from slimopt.optim.algorithm import quant as Q
from slimopt.optim.algorithm import rules
from slimopt.optim.routes import abi
from slimopt.optim.routes.cpu import native
from slimopt.optim.settings import DEFAULTS

SHAPES = [(40, 300), (5000,), (30,)]  # 2-D (partial last blocks, several tiles), 1-D, small (always fp32)
LRS = [1e-2, 8e-3, 6e-3, 4e-3]


_params = partial(random_params, SHAPES)
_grads = partial(random_grads, SHAPES, scale=0.1)
_run = partial(run_steps, lrs=LRS)


class _Counting:
    """The library, counting the kernel's calls."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def slimopt_elementwise_step(self, s):
        self.calls += 1
        return self.lib.slimopt_elementwise_step(s)


@pytest.fixture
def counted(monkeypatch):
    lib = native.library()
    if lib is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    counting = _Counting(lib)
    monkeypatch.setitem(native._state, "lib", counting)
    return counting


def _assert_same(opt_a, opt_b, a, b, dtype, steps):
    for pa, pb in zip(a, b):
        if dtype == torch.float32:
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        else:  # an update one fp32 ulp apart may round the bf16 weight the other way: one bf16 step a step
            ulp = torch.finfo(torch.bfloat16).eps * (pa.float().abs() + 2 * sum(LRS))
            assert bool(((pa.float() - pb.float()).abs() <= steps * ulp).all())
        assert_state_close(opt_a, opt_b, pa, pb)


NEW_TERNARY = ("ternary_sr_rms64", "ternary_sr_mean64", "ternary_ef_mean64")
CASES = [  # (rule, m codec, v codec, settings)
    *[("adamw", m, v, {}) for m in ("int8", "int4", "ternary_sr", "ternary_ef") for v in ("int8", "int4", "factored")],
    ("adamw", "fp32", "int8", {}), ("adamw", "bf16", "fp32", {}), ("adamw", "int8", "bf16", {}),
    ("adamw", "int8", "bf16_sr", {}), ("adamw", "fp32", "factored", {}),
    ("adamw", "int8", "int8", dict(eps_placement="galore")), ("adamw", "int4", "int8", dict(betas=(0.8, 0.95), eps=1e-6)),
    *[(rule, m, None, {}) for rule in ("lion", "sgdm") for m in ("fp32", "bf16", "int8", "int4", "ternary_sr", "ternary_ef")],
    # the mean / rms scaled ternary forms with bf16 scales in blocks of 64 (partial last blocks: 12000 and 5000)
    *[("adamw", m, v, {}) for m in NEW_TERNARY for v in ("int8", "factored")],
    *[(rule, m, None, {}) for rule in ("lion", "sgdm") for m in NEW_TERNARY],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule,m,v,settings", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_one_pass_equals_the_eager_step(counted, dtype, rule, m, v, settings):
    kw = dict(lr=1e-2, weight_decay=0.1, rule=rule, m_codec=m, **settings)
    if v is not None:
        kw["v_codec"] = v
    if rule == "sgdm":
        kw["momentum"] = 0.9
    a, b = _params(dtype), _params(dtype)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    _run(a, fast, _grads(dtype, 4))
    assert counted.calls >= 4 * 2  # the two tensors of >= 4096 elements, every step
    _run(b, eager, _grads(dtype, 4))
    _assert_same(fast, eager, a, b, dtype, 4)


@pytest.mark.parametrize("m,v", [("int8", "int4"), ("ternary_ef", "factored"), ("ternary_sr", "int8"),
                                 ("ternary_sr_rms64", "factored"), ("ternary_ef_mean64", "int4")])
def test_windows_of_a_tensor(counted, monkeypatch, m, v):
    """Small windows: each is one kernel call, stochastic codes draw per window as the eager windows do."""
    monkeypatch.setattr(budget, "WINDOW_BYTES", 1 << 16)
    kw = dict(lr=1e-2, m_codec=m, v_codec=v)
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    _run(a, fast, _grads(torch.bfloat16, 3))
    assert counted.calls > 3 * 2  # more than one window per tensor
    _run(b, eager, _grads(torch.bfloat16, 3))
    _assert_same(fast, eager, a, b, torch.bfloat16, 3)


@pytest.mark.parametrize("m,v", [("ternary_sr_rms64", "factored"), ("ternary_ef_mean64", "int4")])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_streams_from_an_odd_counter(counted, monkeypatch, m, v, rounding):
    """Every stream read from an odd counter (as a shard's can start): the kernel's draws for the first element of a
    pair and the rest (the fused path's fallback, or the tile loop's with a stochastically rounded weight) equal
    the eager encode's."""
    from slimopt.optim.algorithm import projectors as P
    whole = P.stream
    monkeypatch.setattr(P, "stream", lambda *parts: whole(*parts).at(1))
    kw = dict(lr=1e-2, m_codec=m, v_codec=v, param_rounding=rounding)
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    _run(a, fast, _grads(torch.bfloat16, 3))
    assert counted.calls >= 3 * 2
    _run(b, eager, _grads(torch.bfloat16, 3))
    _assert_same(fast, eager, a, b, torch.bfloat16, 3)


@pytest.mark.parametrize("m,v", [("int8", "int8"), ("ternary_ef", "factored"), ("ternary_sr_rms64", "factored")])
def test_path_switch_across_a_checkpoint(counted, m, v):
    """Three steps in one pass, a weights_only checkpoint, three eager steps: the eager run's result, and the
    checkpoint holds the eager path's tensors."""
    kw = dict(lr=1e-2, weight_decay=0.1, m_codec=m, v_codec=v)
    grads = _grads(torch.float32, 6)
    a, ref = _params(torch.float32), _params(torch.float32)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(ref, fused=False, **kw)
    _run(a, fast, grads[:3])
    _run(ref, eager, grads)
    saved = save_and_load(fast.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = slimopt.SlimOptimizer(b, fused=False, **kw)
    resumed.load_state_dict(saved)
    resumed.param_groups[0]["fused"] = False  # the saved group said True: this run asks for the eager step
    _run(b, resumed, grads[3:], lrs=LRS[3:] + LRS[:3])
    _assert_same(resumed, eager, b, ref, torch.float32, 6)


def test_other_paths_keep_their_steps(counted):
    """fp64 weights are not the kernel's: the eager window step runs."""
    p = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.float64))
    opt = slimopt.SlimOptimizer([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    assert counted.calls == 0


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("settings", [dict(codec="int8"), dict(m_codec="ternary_sr", v_codec="factored"),
                                      dict(rule="lion", m_codec="int4"),
                                      dict(projector="block", density=0.0, free_rule="sign")],
                         ids=["int8", "ternary-factored", "lion-int4", "state-free"])
def test_stochastic_and_kahan_weight_writes_equal_the_eager_step(counted, monkeypatch, rounding, settings):
    """bf16 weights written with stochastic rounding (the weight's own counter-based stream, window by window) or
    with a Kahan compensation: the kernel's write is the eager write, in whole tensors and in windows. Bit for bit
    for the state-free sign step (exact arithmetic on any processor). Under Lion (torch's lerp may round
    otherwise on another processor) and AdamW (the square root's ulp, test_one_pass_equals_the_eager_step) the
    fp32 update may differ by an ulp, which a Kahan compensation keeps: there the weight plus its compensation
    agree within the compensation's own rounding and the rest as _assert_same says."""
    exact = "free_rule" in settings
    kw = dict(lr=1e-2, weight_decay=0.1, param_rounding=rounding, **settings)
    for window in (budget.WINDOW_BYTES, 8 << 10):  # whole tensors, then windows of a few thousand elements
        monkeypatch.setattr(budget, "WINDOW_BYTES", window)
        a, b = _params(torch.bfloat16), _params(torch.bfloat16)
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        calls = counted.calls
        _run(a, fast, _grads(torch.bfloat16, 4))
        assert counted.calls - calls >= 4 * 2
        _run(b, eager, _grads(torch.bfloat16, 4))
        if not exact:
            if rounding == "kahan":
                for pa, pb in zip(a, b):
                    value_a = pa.float() + fast.state[pa]["kahan_comp"].float()
                    value_b = pb.float() + eager.state[pb]["kahan_comp"].float()
                    # an update an ulp apart can round the weight the other way; the compensation, itself bf16,
                    # then stands for the rest within 2^-9 of itself, 2^-17 of the weight
                    torch.testing.assert_close(value_a, value_b, rtol=2 ** -15, atol=1e-7)
                    fast.state[pa]["kahan_comp"] = eager.state[pb]["kahan_comp"]  # compared above
            _assert_same(fast, eager, a, b, torch.bfloat16, 4)
            continue
        for pa, pb in zip(a, b):
            assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
            assert_same_state(fast.state[pa], eager.state[pb], bitwise=True)


@pytest.mark.parametrize("name", ["dynamic8_signed", "dynamic8_unsigned", "dynamic4_signed", "linear4_nozero",
                                  "ternary"])
def test_packed_tables_count_as_quant(name):
    """The kernel's one-look-up table gives quant's count of points <= x, for the nearest-rounding decision points
    and for the map itself, on random values, on every point and its fp32 neighbours, on zeros and infinities."""
    qmap = Q.get_map(name)
    tables = Q._tables(qmap)
    for table in (tables.nearest, tables.bracket):
        points = table.padded[: table.padded.numel() - table.extra]
        x = torch.cat([torch.randn(20000), torch.rand(20000) * 2 - 1, torch.rand(2000) * 1e-6, points,
                       torch.nextafter(points, torch.full_like(points, float("inf"))),
                       torch.nextafter(points, torch.full_like(points, -float("inf"))),
                       torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40])])
        packed = native._packed(table).long()
        key = Q._order_key(x).long()
        entry = packed[(key >> 16) + 32768]
        count = (entry + (key & 0xFFFF)) >> 16
        assert torch.equal(count, table.count_le(x).long())


# the kernel built for fewer instruction sets than this machine has: each of its vector paths (AVX-512 permutes
# and comparisons, AVX2 gathers, plain C) against the eager step; on a machine without one the build is the same
ISA_LEVELS = {"no-avx512": ["-march=native", "-mno-avx512f"], "portable": []}
ISA_CASES = [("adamw", "int8", "int8"), ("adamw", "int4", "int4"), ("adamw", "ternary_ef", "int4"),
             ("adamw", "ternary_sr", "factored"), ("lion", "int4", None), ("sgdm", "ternary_ef_mean64", None),
             ("adamw", "fp32", "fp32"), ("lion", "fp32", None)]


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("rule,m,v", ISA_CASES, ids=lambda x: x if isinstance(x, str) else "-")
def test_every_instruction_set_path_equals_the_eager_step(monkeypatch, level, rule, m, v):
    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    lib, why = native._build(ISA_LEVELS[level])
    assert lib is not None and (not why or native._state["why"]), why  # built as asked, unless the default was not
    counting = _Counting(lib)
    monkeypatch.setitem(native._state, "lib", counting)
    kw = dict(lr=1e-2, weight_decay=0.1, rule=rule, m_codec=m, **({"v_codec": v} if v else {}),
              **({"momentum": 0.9} if rule == "sgdm" else {}))
    for dtype in (torch.float32, torch.bfloat16):
        a, b = _params(dtype), _params(dtype)
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        _run(a, fast, _grads(dtype, 3))
        _run(b, eager, _grads(dtype, 3))
        _assert_same(fast, eager, a, b, dtype, 3)
    # fp32 weights with fp32 AdamW moments take torch's fused step: only the bf16 weights' 3 steps x 3 tensors here
    assert counting.calls >= (3 * 3 if (rule, m, v) == ("adamw", "fp32", "fp32") else 2 * 3 * 2)


@pytest.mark.parametrize("level", ["native", *ISA_LEVELS])
@pytest.mark.parametrize("m,v", [("int4", "int4"), ("int8", "int8"), ("ternary_ef", "int4")])
def test_a_nan_gradient_codes_its_blocks_as_the_eager_step(monkeypatch, level, m, v):
    """A NaN gradient entry makes its block's absmax NaN, and every normalized value of the block NaN: the kernel's
    nearest-code searches (table, register search, comparisons) code them as quant does, scales NaN alike. The
    NaNs are positive: a negative one's sign, which compilers' and torch's kernels may carry through an operation
    differently, decides a ternary residual's trit."""
    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    lib, why = native._build(ISA_LEVELS[level]) if level != "native" else (native.library(), "")
    assert lib is not None and (not why or native._state["why"]), why
    monkeypatch.setitem(native._state, "lib", _Counting(lib))
    kw = dict(lr=1e-2, weight_decay=0.1, m_codec=m, v_codec=v)
    a, b = _params(torch.float32), _params(torch.float32)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    grads = _grads(torch.float32, 2)
    grads[1][0][3, 7] = float("nan")
    grads[1][1][100] = float("nan")
    _run(a, fast, grads)
    _run(b, eager, [[g.clone() for g in gs] for gs in grads])
    for pa, pb in zip(a, b):
        for key, x in fast.state[pa].items():
            y = eager.state[pb][key]
            if x.is_floating_point():
                assert torch.equal(x.isnan(), y.isnan()), key
                assert torch.allclose(x[~x.isnan()].float(), y[~y.isnan()].float(), rtol=1e-6, atol=1e-12), key
            else:
                assert torch.equal(x, y), key


@pytest.mark.parametrize("free_rule", ["sign", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_free_step_equals_the_eager_step(counted, dtype, free_rule):
    """The state-free update (density 0) on fp32 gradients of fp32 and bf16 weights, which the windowed step takes
    (torch's residual kernels want the weight's dtype): zeros and a NaN in the gradient, bit for bit."""
    kw = dict(lr=1e-2, weight_decay=0.1, projector="block", density=0.0, free_rule=free_rule, free_scale=0.5)
    a, b = _params(dtype), _params(dtype)
    for p in a + b:
        p.grad_dtype = None  # fp32 gradients of bf16 weights (mixed-precision training keeps them so)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    grads = _grads(torch.float32, 3)
    for gs in grads:
        gs[0][0, :7] = 0.0
        gs[1][5] = float("nan")
    _run(a, fast, grads)
    assert counted.calls >= 3 * len(SHAPES)
    _run(b, eager, [[g.clone() for g in gs] for gs in grads])
    for pa, pb in zip(a, b):
        assert torch.equal(pa.view(-1)[pa.view(-1) == pa.view(-1)], pb.view(-1)[pb.view(-1) == pb.view(-1)])
        assert torch.equal(pa.isnan(), pb.isnan())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_weight_update_equals_apply_update(rounding, dtype):
    """A projected step's write (decay, p -= lr c d, the rounding) in one pass, against rules.apply_update on a
    weight with zeros, a NaN and an inf in the direction: bit for bit, the compensation too."""
    from slimopt.optim.algorithm import noise, rules

    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    gen = torch.Generator().manual_seed(4)
    group = {"lr": 3e-3, "weight_decay": 0.1, "param_rounding": rounding, "fused": True, "free_rule": "none", "rule": "adamw",
             "free_scale": 1.0}
    shape = (64, 96)  # whole vectors of torch's kernels on AVX2 and AVX-512 alike: no scalar tails
    p0 = torch.randn(shape, generator=gen).to(dtype)
    d = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-6, 2, shape, generator=gen).float()
    d[0, :5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])
    comp0 = (torch.randn(shape, generator=gen) * 1e-4).to(dtype) if rounding == "kahan" else None
    stream = noise.CounterStream(0x5DEECE66D1234, 77) if rounding == "stochastic" else None
    a, b = p0.clone(), p0.clone()
    ca, cb = (comp0.clone(), comp0.clone()) if comp0 is not None else (None, None)
    r = rules.rounding_of(group, a)
    assert native.add_applies(group, a, d)
    native.add_update(a, d, group, 0.7, ca if r == "kahan" else None, stream if r == "stochastic" else None)
    rules.apply_update(b, d.clone(), 0.7, None, group, comp=cb if r == "kahan" else None,
                       generator=stream if r == "stochastic" else None)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    # NaN where the other has NaN (torch's vectorized bf16 conversion writes its NaN as 0xFFFF, c10's and the
    # kernel's as 0x7FC0); every other element bit for bit
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()].view(bits), b[~b.isnan()].view(bits))
    if r == "kahan":
        assert torch.equal(ca.isnan(), cb.isnan())
        assert torch.equal(ca[~ca.isnan()].view(torch.int16), cb[~cb.isnan()].view(torch.int16))


TACO_CASES = [dict(), dict(taco_format="int8"), dict(taco_scale_dtype="fp32"),
              dict(taco_format="int8", taco_scale_dtype="fp32", weight_decay=0.0), dict(taco_decay=0.0)]


@pytest.mark.parametrize("settings", TACO_CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_taco_one_component_step_equals_the_tensor_operations(monkeypatch, dtype, settings):
    """TACO's whole k = 1 step in the kernel against the sparse tensor-operation step (the kernel off) and the
    dense eager step (fused=False), bit for bit on the weight and every state tensor: 300 rows (int16 row
    indices) and 8 (uint8), ties, zero columns, tiny gradients (subnormal fp8 codes) and a NaN gradient entry."""
    from slimopt.optim.algorithm import taco

    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    calls = []
    one, applies = native.taco_one, native.taco_applies
    monkeypatch.setattr(native, "taco_one", lambda *a: calls.append(1) or one(*a))
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 48), (8, 32)]  # whole vectors of torch's kernels on AVX2 and AVX-512 alike: no scalar tails
    grads = []
    for step in range(5):
        gs = [torch.randint(-6, 7, s, generator=gen).float() * 0.5 ** torch.randint(0, 30, s, generator=gen)
              for s in shapes]
        gs[0][:, 3] = 0.0  # a zero column: nothing stored, no move
        gs[0][:, 7] = torch.randint(-6, 7, (300,), generator=gen) * 1e-43  # subnormal values: subnormal codes
        if step == 3:
            gs[1][2, 5] = float("nan")  # a NaN kept: encoded and applied by the tensor operations
        grads.append([g.to(dtype) for g in gs])

    def run(fused, kernel):
        monkeypatch.setattr(native, "taco_applies", applies if kernel else lambda *a: False)
        ws = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1)).to(dtype)) for s in shapes]
        kw = {**dict(lr=1e-2, weight_decay=0.1, rule="taco", taco_alpha=1.0, fused=fused), **settings}
        opt = slimopt.SlimOptimizer(ws, **kw)
        for gs in grads:
            for w, g in zip(ws, gs):
                w.grad = g.clone()
            opt.step()
        return ws, opt

    ref_w, ref = run(True, False)
    for fused in (True, False):
        calls.clear()
        ws, opt = run(fused, True)
        assert len(calls) == (10 if fused else 0)
        for a, b in zip(ws, ref_w):
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
            assert_same_state(opt.state[a], ref.state[b], bitwise=True)
    assert taco.DEFAULTS["taco_k"] == 1  # the default is what the kernel serves


def test_the_kernel_builds_where_a_compiler_is():
    if native._state.get("lib") is None and not shutil.which(os.environ.get("CC") or "cc"):
        pytest.skip("no C compiler on this machine")
    assert native.library() is not None


def test_no_compiler_costs_one_warning_and_the_eager_step(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path))
    a, b = _params(torch.float32), _params(torch.float32)
    fast = slimopt.SlimOptimizer(a, lr=1e-2, codec="int8")
    eager = slimopt.SlimOptimizer(b, lr=1e-2, codec="int8", fused=False)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        _run(a, fast, _grads(torch.float32, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one a step
        _run(a, fast, _grads(torch.float32, 2)[1:], lrs=LRS[1:])
    _run(b, eager, _grads(torch.float32, 2))
    for pa, pb in zip(a[:2], b[:2]):  # the quantized ones: the eager window step on both sides (the small fp32
        assert torch.equal(pa, pb)    # one takes torch's fused AdamW when fused)


def test_flags_the_compiler_refuses_cost_one_warning_and_leave_a_working_build(monkeypatch, tmp_path):
    # a compiler that refuses the machine's flags (or fails on their code paths) still builds the kernel without
    # them, says so once, and later processes loading the cached library say so too
    if native._state.get("lib") is None and not shutil.which(os.environ.get("CC") or "cc"):
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path))
    refused = ["-mno-such-flag-slimopt"]
    lib, note = native._build(refused)
    assert lib is not None and note.startswith("without -mno-such-flag-slimopt (") and "failed" in note, note
    assert native._build(refused)[1] == note  # read back from beside the cached library
    if not native._VECTOR_PATHS:
        return  # no vector paths to lose: no warning
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "NATIVE_FLAGS", refused)
    with pytest.warns(RuntimeWarning, match="built without -mno-such-flag-slimopt"):
        assert native.library() is not None


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("SLIMOPT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None


@pytest.mark.parametrize("settings", [dict(projector="svd", rank=8, state_bits=8),
                                      dict(projector="columns", density=0.25, free_rule="sign"),
                                      dict(projector="random", rank=8, rule="lion", m_codec="int8"),
                                      dict(projector="svd", rank=8, v_codec="factored", m_codec="ternary_sr_rms64")])
def test_projected_steps_run_their_subspace_rule_in_the_kernel(counted, settings):
    # the subspace rule of GaLore / FRUGAL's projections writes its direction through the kernel: the same state,
    # weights within the square root's rounding (amplified by the projection back)
    kw = dict(lr=1e-2, weight_decay=0.1, update_gap=2, **settings)
    a = [torch.nn.Parameter(p.data) for p in _params(torch.bfloat16)[:1]]
    b = [torch.nn.Parameter(p.data.clone()) for p in a]
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    grads = [[g[0]] for g in _grads(torch.bfloat16, 4)]
    _run(a, fast, grads)
    assert counted.calls >= 4
    _run(b, eager, grads)
    _assert_same(fast, eager, a, b, torch.bfloat16, 4)


LIFTED = [(torch.float32, "nearest"), (torch.bfloat16, "nearest"), (torch.bfloat16, "kahan"),
          (torch.bfloat16, "stochastic")]


@pytest.mark.parametrize("dtype,rounding", LIFTED, ids=[f"{str(d)[6:]}-{r}" for d, r in LIFTED])
@pytest.mark.parametrize("projector,free_rule,proj_dtype", [("svd", "sign", "fp32"), ("random", "sgd", "fp32"),
                                                            ("svd", "sgd", "grad"), ("columns", "sgd", "fp32"),
                                                            ("rows", "sign", "fp32")])
def test_a_projected_write_with_a_residual_is_one_kernel_pass(counted, monkeypatch, dtype, rounding, projector,
                                                               free_rule, proj_dtype):
    # FRUGAL's projections (orthonormal and coordinate): decay, c up(d) + free_scale free_rule(g - up(low)) and the
    # write in one pass
    # (native.lift_update), bit for bit with the eager write; SGD momentum in the subspace, so that no square root
    # separates the two paths' directions on another processor
    lifted = []
    lift = native.lift_update
    monkeypatch.setattr(native, "lift_update", lambda *a, **k: lifted.append(1) or lift(*a, **k))
    size = dict(density=0.25) if projector in ("columns", "rows") else dict(rank=8)
    kw = dict(lr=1e-2, weight_decay=0.1, rule="sgdm", momentum=0.9, projector=projector, update_gap=2,
              free_rule=free_rule, free_scale=0.5, param_rounding=rounding, proj_dtype=proj_dtype, **size)
    a = [torch.nn.Parameter(p.data) for p in _params(dtype)[:1]]  # 40 x 300: a right projection, one window
    b = [torch.nn.Parameter(p.data.clone()) for p in a]
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    grads = [[g[0]] for g in _grads(dtype, 4)]
    _run(a, fast, grads)
    _run(b, eager, grads)
    assert len(lifted) == 4
    assert torch.equal(a[0], b[0])
    for key in eager.state[b[0]]:
        assert torch.equal(fast.state[a[0]][key], eager.state[b[0]][key]), key


@pytest.mark.parametrize("m,v,settings", [
    ("int8", "int8", {}), ("int4", "int4", {}), ("ternary_sr", "factored", {}), ("ternary_ef_mean64", "int8", {}),
    ("bf16", "factored", dict(param_rounding="stochastic")), ("int8", "fp32", dict(param_rounding="kahan")),
    ("int4", None, dict(rule="lion")),
], ids=["int8", "int4", "ternary-factored", "ternary_ef-int8", "bf16-factored-sr", "int8-kahan", "lion-int4"])
def test_a_window_split_over_threads_gives_the_same_bits(counted, m, v, settings):
    """A window of two or more groups of 2^16 elements is split over torch's threads, at places that do not depend on their number
    (whole blocks, whole rows of a factored moment, its column sums added group by group, in rounds of 16 groups a
    thread): 1, 2 and 3 threads end in the same weights and state, bit for bit, and equal the eager step as every
    kernel step does."""
    kw = dict(lr=1e-2, weight_decay=0.1, m_codec=m, **({"v_codec": v} if v else {}), **settings)
    shapes = [(1000, 1100), (700, 1536)]  # 1.1M and 1.08M elements: 16 or 17 groups
    if v == "factored":
        shapes.append((1600, 1600))  # 40 groups: two rounds at 2 threads
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3, None):
            torch.set_num_threads(threads or 1)
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in shapes]
            opt = slimopt.SlimOptimizer(params, fused=threads is not None, **kw)
            for step in range(3):
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16)
                opt.step()
            runs.append((params, opt))
    finally:
        torch.set_num_threads(before)
    (a, opt_a), eager = runs[0], runs[-1]
    for b, opt_b in runs[1:-1]:
        for pa, pb in zip(a, b):
            assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
            for key, t in opt_a.state[pa].items():
                if torch.is_tensor(t):
                    assert torch.equal(t.view(-1).view(torch.uint8), opt_b.state[pb][key].view(-1).view(torch.uint8)), key
    if settings.get("param_rounding") != "kahan":  # a compensation an ulp apart: checked in its own test above
        _assert_same(opt_a, eager[1], a, eager[0], torch.bfloat16, 3)


def _two_thread_steps(out=None) -> list[torch.Tensor]:
    """An 8-bit AdamW window of 1.1M elements stepped 3 times, the last two at 2 threads: the weight and the state's
    tensors. torch's own parallel work (the tensors made, the state allocated) runs at one thread: in a process
    forked after the pool ran, torch's threaded ops would wait forever too."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, 1100, generator=gen).to(torch.bfloat16))
    grads = [(torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16) for _ in range(3)]
    opt = slimopt.SlimOptimizer([p], lr=1e-2, codec="int8")
    for step, g in enumerate(grads):
        torch.set_num_threads(1 if step == 0 else 2)
        p.grad = g
        opt.step()
    torch.set_num_threads(1)
    tensors = [p.detach().clone()] + [t.clone() for t in opt.state[p].values() if torch.is_tensor(t)]
    if out is not None:
        torch.save(tensors, out)
    return tensors


def test_a_forked_process_steps_over_threads_of_its_own(tmp_path):
    """Built with OpenMP the kernel runs on the process's OpenMP pool, whose threads a forked child does not have
    (libgomp would wait on them forever): a child forked after a threaded step takes threads of its own and ends
    with the parent's bits."""
    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    before = torch.get_num_threads()
    try:
        parent = _two_thread_steps()  # the pool has run
        child = multiprocessing.get_context("fork").Process(target=_two_thread_steps, args=(tmp_path / "child.pt",))
        child.start()
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0, "the forked child did not finish its steps"
    finally:
        torch.set_num_threads(before)
    for a, b in zip(parent, torch.load(tmp_path / "child.pt", weights_only=True)):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# the kernels' contract (routes/abi.py): one registry, the C source's ids


def _c_enums() -> dict[str, int]:
    text = Path(native.SOURCE).read_text()
    out = {}
    for body in re.findall(r"^enum \{([^}]*)\};", text, flags=re.M):
        for name, value in re.findall(r"(\w+) = (\d+)", body):
            out[name] = int(value)
    return out


def test_the_c_kernel_ids_are_the_abi_tables():
    enums = _c_enums()
    assert enums["RULE_FIRST_FREE"] == abi.FIRST_FREE_ID
    for name, i in abi.RULES.items():
        if rules.REGISTRY[name].elementwise:  # taco's fallback is AdamW's id
            assert enums[f"RULE_{name.upper()}"] == i, name
    for name, i in abi.FREE_RULES.items():
        assert enums[f"RULE_{name.upper()}"] == i, name
    for name, i in abi.LIFT_RULES.items():
        assert enums[f"RULE_LIFT_{name.upper()}"] == i, name
    for prefix, table in (("C", abi.C_CODECS), ("S", abi.SCALES), ("W", abi.ROUNDINGS)):
        assert {k: v for k, v in enums.items() if k.startswith(prefix + "_")} == {
            f"{prefix}_{n.upper()}": i for n, i in table.items()}, prefix
    assert (enums["D_FP32"], enums["D_BF16"]) == (abi.DTYPES[torch.float32], abi.DTYPES[torch.bfloat16])


def test_the_step_record_is_the_rule_arithmetic():
    group = {**DEFAULTS, "lr": 0.1, "weight_decay": 0.5, "betas": (0.8, 0.95)}
    r = abi.scalars(group, 3)
    assert r.coef == 1.0 / (1 - 0.8 ** 3) and r.alpha == -0.1 * r.coef and r.decay == 1.0 - 0.1 * 0.5
    assert r.bias2_sqrt == (1 - 0.95 ** 3) ** 0.5 and (r.w1, r.w2) == (1 - 0.8, 1 - 0.95)
    assert abi.scalars({**group, "rule": "sgdm"}, 3).coef == 1.0
    assert abi.scalars({**group, "free_scale": 0.5}, 3, "free").alpha == -0.1 * 0.5
