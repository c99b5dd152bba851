"""Tests of slimopt.optim.algorithm.codecs: round trips, exact byte counts, the fp32 fallback, in-place encoding, ternary
stochastic rounding and error feedback, factored v, and make_codec / resolve_codecs errors."""

import math

import pytest
import torch

from slimopt.optim.algorithm import codecs as C
from slimopt.optim.algorithm import quant as Q

SHAPES = [torch.Size((64, 64)), torch.Size((4096,)), torch.Size((97, 131)), torch.Size((3, 50, 70)),
          torch.Size((4096, 4096))]
ALL = [(s, "m") for s in C.M_SPECS] + [(s, "v") for s in C.V_SPECS]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def moment(shape, role, seed=0):
    x = torch.randn(shape, generator=gen(seed)) * torch.logspace(-4, 0, shape[-1])
    return x.square() if role == "v" else x


def analytic_nbytes(name: str, shape: torch.Size) -> int:
    """The formulas of the codecs module docstring."""
    n = math.prod(shape)
    if name == "fp32":
        return 4 * n
    if name in ("bf16", "bf16_sr"):
        return 2 * n
    if name == "int8":
        nb = -(-n // 256)
        return 256 * nb + 4 * nb
    if name == "int4":
        nb = -(-n // 128)
        return 64 * nb + 4 * nb
    if name in C.TERNARY_SPECS:
        rounding, _, block, scale_dtype = C.TERNARY_SPECS[name]
        nb = -(-n // block)
        return -(-block * nb // 5) * (2 if rounding == "ef" else 1) + (4 if scale_dtype == torch.float32 else 2) * nb
    if name == "factored":
        return 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n
    raise AssertionError(name)


# --------------------------------------------------------------------------------------------- bytes

@pytest.mark.parametrize("spec,role", ALL)
def test_nbytes_equals_init_tensors_and_formula(spec, role):
    for shape in SHAPES[:-1] + [torch.Size((5000, 3)), torch.Size((10, 10))]:
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)
        state = codec.init("exp_avg", shape, "cpu")
        assert codec.nbytes(shape) == sum(t.nbytes for t in state.values())
        assert codec.nbytes(shape) == analytic_nbytes(codec.name, shape)


def test_bytes_per_parameter_4096_squared():
    shape = torch.Size((4096, 4096))
    n = shape.numel()

    def per_param(m_spec, v_spec):
        return (C.make_codec(m_spec, "m", n, torch.float32).nbytes(shape)
                + C.make_codec(v_spec, "v", n, torch.float32).nbytes(shape)) / n

    assert per_param("fp32", "fp32") == 8.0
    assert per_param("bf16", "bf16") == 4.0
    assert per_param("int8", "int8") == 2 * (1 + 4 / 256)  # 2.03125
    assert per_param("int4", "int4") == 2 * (0.5 + 4 / 128)  # 1.0625
    assert per_param("ternary_sr", "factored") == pytest.approx(0.2 + 4 / 256 + 8 / 4096, abs=1e-6)  # 0.2176
    assert per_param("ternary_sr", "factored") < 0.3
    assert per_param("ternary_ef", "factored") == pytest.approx(0.4 + 4 / 256 + 8 / 4096, abs=1e-6)  # 0.4176
    assert per_param("int4", "factored") == pytest.approx(0.5 + 4 / 128 + 8 / 4096, abs=1e-6)  # 0.5332


# ------------------------------------------------------------------------------------ init / dtypes

@pytest.mark.parametrize("spec,role", ALL)
def test_init_is_a_zero_moment_with_narrow_dtypes(spec, role):
    shape = torch.Size((97, 131))
    codec = C.make_codec(spec, role, shape.numel(), torch.bfloat16)
    state = codec.init("exp_avg", shape, "cpu")
    assert "exp_avg" in state and all(k.startswith("exp_avg") for k in state)
    for k, t in state.items():
        if k == "exp_avg" and codec.name not in ("fp32", "bf16", "bf16_sr", "factored"):
            assert t.dtype == torch.uint8
        elif k.endswith(("_scale", "_col")):
            assert t.dtype == getattr(codec, "scale_dtype", torch.float32)
    y = codec.decode("exp_avg", state, shape)
    assert y.dtype == torch.float32 and y.shape == shape and bool((y == 0).all())


def test_state_key_names():
    shape = torch.Size((100, 100))
    n = shape.numel()
    assert set(C.make_codec("int8", "m", n, torch.float32).init("exp_avg", shape, "cpu")) == {
        "exp_avg", "exp_avg_scale"}
    assert set(C.make_codec("ternary_ef", "m", n, torch.float32).init("exp_avg", shape, "cpu")) == {
        "exp_avg", "exp_avg_scale", "exp_avg_err"}
    assert set(C.make_codec("factored", "v", n, torch.float32).init("exp_avg_sq", shape, "cpu")) == {
        "exp_avg_sq", "exp_avg_sq_col"}


# --------------------------------------------------------------------------------------- round trips

def _error_bound(name, role, x, shape):
    """Per-element bound of |decode(encode(x)) - x|."""
    if name == "fp32":
        return torch.zeros_like(x)
    if name == "bf16":
        return x.abs() * 2.0**-8
    if name == "bf16_sr":
        return x.abs() * 2.0**-7
    codec = C.make_codec(name, role, x.numel(), torch.float32)
    block = codec.block_size
    blocks = Q.to_blocks(x, block)
    scale = blocks.abs().amax(-1, keepdim=True)
    if name in C.TERNARY_SPECS:  # stochastic rounding moves at most one step; error feedback adds the carried
        # residual; a value beyond the scale (a mean or rms scale, or one rounded to bf16) clips to it
        unit = 1.5 if codec.feedback else 1.0
        scale = codec.block_scale(blocks, x.numel()).unsqueeze(-1) * unit
        bound = torch.maximum(scale.expand_as(blocks).reshape(-1)[: x.numel()].view(shape), x.abs())
        return bound * (1 + 1e-5) + 1e-30
    # int8 / int4: the largest half gap of the map (and the missing -1 of the signed dynamic map), times the scale
    qmap = Q.get_map(codec.map_name)
    ends = torch.stack([qmap.min() + 1 if float(qmap.min()) < 0 else qmap.min(), 1 - qmap.max()])
    unit = max(float(qmap.diff().max()) / 2, float(ends.max()))
    bound = (scale * unit).expand_as(blocks).reshape(-1)[: x.numel()].view(shape)
    return bound * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("spec,role", [(s, r) for s, r in ALL if s not in ("factored", "auto", "ternary")])
def test_round_trip_within_bound(spec, role):
    for shape in SHAPES[:-1]:
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)
        x = moment(shape, role, seed=1)
        state = codec.init("m", shape, "cpu")
        codec.encode("m", x, state, generator=gen(2))
        y = codec.decode("m", state, shape)
        assert y.shape == shape and y.dtype == torch.float32
        assert bool(((y - x).abs() <= _error_bound(codec.name, role, x, shape)).all()), (spec, role, shape)


def test_int_codecs_store_what_quant_computes():
    shape = torch.Size((97, 131))
    for spec, role, qname, block in (("int8", "m", "dynamic8_signed", 256), ("int8", "v", "dynamic8_unsigned", 256),
                                     ("int4", "m", "dynamic4_signed", 128), ("int4", "v", "linear4_nozero", 128)):
        x = moment(shape, role, seed=3)
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        codec.encode("m", x, state)
        codes, scale = Q.quantize_blockwise(x, Q.get_map(qname), block)
        stored = state["m"] if spec == "int8" else Q.unpack_bits(state["m"], 4).to(torch.uint8)
        assert torch.equal(stored, codes) and torch.equal(state["m_scale"], scale)
        assert torch.equal(codec.decode("m", state, shape),
                           Q.dequantize_blockwise(codes, scale, Q.get_map(qname), x.numel()).view(shape))


def test_ternary_decodes_to_three_levels_per_block():
    shape = torch.Size((40, 200))
    x = moment(shape, "m", seed=4)
    for spec in ("ternary_sr", "ternary_ef"):
        codec = C.make_codec(spec, "m", shape.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        codec.encode("m", x, state, generator=gen(5))
        y = Q.to_blocks(codec.decode("m", state, shape), 256)
        s = state["m_scale"].unsqueeze(-1)
        assert bool(((y == 0) | (y == s) | (y == -s)).all())


def test_fp32_and_bf16_are_exact_or_rounded():
    shape = torch.Size((100, 100))
    x = moment(shape, "m")
    c32 = C.make_codec("fp32", "m", x.numel(), torch.float32)
    st = c32.init("m", shape, "cpu")
    c32.encode("m", x, st)
    assert torch.equal(c32.decode("m", st, shape), x)
    c16 = C.make_codec("bf16", "m", x.numel(), torch.float32)
    st = c16.init("m", shape, "cpu")
    c16.encode("m", x, st)
    assert torch.equal(c16.decode("m", st, shape), x.to(torch.bfloat16).float())


def test_encode_is_in_place():
    shape = torch.Size((97, 131))
    for spec, role in ALL:
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        ptrs = {k: t.data_ptr() for k, t in state.items()}
        codec.encode("m", moment(shape, role), state, generator=gen())
        assert {k: t.data_ptr() for k, t in state.items()} == ptrs, spec


def test_decode_is_a_copy_except_for_full_precision():
    """The optimizer updates the decoded moment in place. For compressed codecs that must not touch the stored
    state; for fp32 the decoded tensor is the stored one, so the in-place update is the store (no extra pass)."""
    shape = torch.Size((100, 100))
    for spec, role in ALL:
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        codec.encode("m", moment(shape, role), state, generator=gen())
        before = {k: t.clone() for k, t in state.items()}
        decoded = codec.decode("m", state, shape).add_(1.0)
        if codec.name == "fp32":
            codec.encode("m", decoded, state)
            torch.testing.assert_close(state["m"], before["m"] + 1.0)
        else:
            assert all(torch.equal(before[k], state[k]) for k in state), spec


def test_encode_rejects_a_wrong_shape():
    codec = C.make_codec("int8", "m", 10000, torch.float32)
    state = codec.init("m", torch.Size((100, 100)), "cpu")
    with pytest.raises(ValueError, match="shape"):
        codec.encode("m", torch.ones(50, 50), state)
    codec = C.make_codec("fp32", "m", 10000, torch.float32)
    state = codec.init("m", torch.Size((100, 100)), "cpu")
    with pytest.raises(ValueError, match="shape"):
        codec.encode("m", torch.ones(100), state)


def test_padding_tail_is_quantized_on_its_own():
    shape = torch.Size((4100,))  # 16 full blocks of 256 and a tail of 4
    x = torch.randn(shape, generator=gen(6))
    x[4096:] = torch.tensor([1e-3, -2e-3, 3e-3, 4e-3])
    codec = C.make_codec("int8", "m", x.numel(), torch.float32)
    state = codec.init("m", shape, "cpu")
    codec.encode("m", x, state)
    assert state["m"].shape == (17 * 256,) and state["m_scale"].shape == (17,)
    assert float(state["m_scale"][16]) == float(x[4099])  # the tail's own absmax, not a neighbour's
    y = codec.decode("m", state, shape)
    assert float(y[4099]) == float(x[4099]) and (y[4096:] - x[4096:]).abs().max() < 4e-3 * 0.01


# -------------------------------------------------------------------------------- small / auto / cache

def test_small_tensors_fall_back_to_fp32():
    for spec, role in ALL:
        assert C.make_codec(spec, role, C.SMALL_NUMEL - 1, torch.bfloat16).name == "fp32"
        big = C.make_codec(spec, role, C.SMALL_NUMEL, torch.float32)
        if spec not in ("auto", "fp32"):
            assert big.name != "fp32", spec


def test_auto_follows_the_parameter_dtype():
    assert C.make_codec("auto", "m", 10**6, torch.bfloat16).name == "bf16"
    assert C.make_codec("auto", "v", 10**6, torch.float32).name == "fp32"
    assert C.make_codec("auto", "v", 10**6, torch.float16).name == "fp32"
    assert C.make_codec("ternary", "m", 10**6, torch.float32).name == C.TERNARY_DEFAULT


def test_needs_generator_flags():
    n = 10**5
    flags = {s: C.make_codec(s, "m", n, torch.float32).needs_generator for s in C.M_SPECS}
    assert flags == {"auto": False, "fp32": False, "bf16": False, "bf16_sr": True, "int8": False, "int4": False,
                     "ternary": True, **{s: True for s in C.TERNARY_SPECS}}
    assert not C.make_codec("factored", "v", n, torch.float32).needs_generator


def test_generator_makes_encode_reproducible():
    shape = torch.Size((100, 100))
    x = moment(shape, "m")
    for spec in ("bf16_sr", "ternary_sr", "ternary_ef"):
        codec = C.make_codec(spec, "m", x.numel(), torch.float32)
        a, b = codec.init("m", shape, "cpu"), codec.init("m", shape, "cpu")
        codec.encode("m", x, a, generator=gen(3))
        codec.encode("m", x, b, generator=gen(3))
        assert all(torch.equal(a[k], b[k]) for k in a)
        codec.encode("m", x, b)  # no generator: torch's default one, still valid
        assert codec.decode("m", b, shape).shape == shape


# ----------------------------------------------------------------------------- ternary: SR and EF

def test_ternary_sr_codec_is_unbiased():
    draws = 2000
    row = torch.rand(256, generator=gen(7)) * 2 - 1
    row[0] = 1.0  # every block's scale is 1
    x = row.repeat(draws, 1)  # one block per draw
    codec = C.make_codec("ternary_sr", "m", x.numel(), torch.float32)
    state = codec.init("m", x.shape, "cpu")
    codec.encode("m", x, state, generator=gen(8))
    mean = codec.decode("m", state, x.shape).mean(0)
    # a draw has std <= 1/2 (scale 1): 5 standard errors
    assert float((mean - row).abs().max()) <= 5 * 0.5 / math.sqrt(draws)


def _nearest_ternary_roundtrip(x):
    blocks = Q.to_blocks(x, 256)
    s = Q.block_absmax(blocks)
    t = Q.nearest_codes(blocks / s.unsqueeze(-1), Q.get_map("ternary"))
    return ((t - 1).float() * s.unsqueeze(-1)).view(-1)[: x.numel()].view(x.shape)


def test_estimate_and_clear_feedback():
    """estimate = decode + carried residual (error feedback only); after clear_feedback it equals decode, which
    is what transforming a stored moment (rotate estimate, clear, encode) needs."""
    shape = torch.Size((64, 256))
    x = moment(shape, "m", seed=22)
    for spec in ("int8", "ternary_sr", "ternary_ef"):
        codec = C.make_codec(spec, "m", x.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        assert bool((codec.estimate("m", state, shape) == 0).all())
        codec.encode("m", x, state, generator=gen(23))
        d, e = codec.decode("m", state, shape), codec.estimate("m", state, shape)
        if spec == "ternary_ef":
            scale = state["m_scale"].repeat_interleave(256).view(shape)
            r = e - d
            assert bool(((r == 0) | (r == scale / 2) | (r == -scale / 2)).all()) and bool((r != 0).any())
            # the residual trit is the rounded remainder: the estimate is within one residual step of x
            assert bool(((e - x).abs() <= scale / 2 * (1 + 1e-6)).all())
        else:
            assert torch.equal(d, e)
        codec.clear_feedback("m", state)
        assert torch.equal(codec.estimate("m", state, shape), d)
        assert torch.equal(codec.decode("m", state, shape), d)


def test_ternary_codecs_keep_exact_zeros_zero():
    """Entries whose moment is exactly zero (e.g. embedding rows of unseen tokens, whose v is zero too) must
    decode to exactly zero at every step, or AdamW divides the noise by eps. A 1-bit residual (+-s/2) would
    break this; the residual trit can hold zero."""
    shape = torch.Size((64, 256))
    dead = torch.zeros(shape, dtype=torch.bool)
    dead[::3] = True
    dead[:, ::5] = True
    for spec in ("ternary_sr", "ternary_ef"):
        codec = C.make_codec(spec, "m", shape.numel(), torch.float32)
        state = codec.init("m", shape, "cpu")
        g = gen(21)
        m = torch.zeros(shape)
        for t in range(20):
            x = 0.9 * m + 0.1 * torch.randn(shape, generator=g)
            x[dead] = 0.0
            codec.encode("m", x, state, generator=g)
            m = codec.decode("m", state, shape)
            assert bool((m[dead] == 0).all()), (spec, t)


def test_ternary_error_feedback_keeps_small_values_alive():
    """A constant input below half a step: nearest rounding drops it at every step, so its accumulated error
    grows linearly (0.1 per step here). Error feedback passes it on: the accumulated error sum_t (decode_t - x)
    = r_0 - r_T + (zero-mean residual rounding noise) has expectation bounded by the carried residual (half a
    step), and its mean over many entries stays within that bound at every step instead of drifting."""
    steps, rows = 100, 64
    row = torch.full((256,), 0.1)
    row[1::2] = -0.3
    row[0] = 1.0  # the block maximum; with its own residual the block scale s stays in [1, 1.5]
    x = row.repeat(rows, 1)
    codec = C.make_codec("ternary_ef", "m", x.numel(), torch.float32)
    state = codec.init("m", x.shape, "cpu")
    g = gen(9)
    acc = torch.zeros(x.shape)
    n = x.numel()
    step_sd = 0.75 / math.sqrt(n)  # the residual noise per step is at most s/2 <= 0.75 per entry
    for t in range(1, steps + 1):
        codec.encode("m", x, state, generator=g)
        acc += codec.decode("m", state, x.shape) - x
        assert abs(float(acc.mean())) <= 0.75 + 5 * step_sd * math.sqrt(t)
    nearest = _nearest_ternary_roundtrip(x) - x
    assert torch.equal(nearest[:, 2::2], torch.full_like(nearest[:, 2::2], -0.1))  # dropped every step
    # each input's average decoded value matches it (averaged over the rows that share it), to 5 sd
    per_column = acc.mean(0) / steps
    assert float(per_column.abs().max()) < 5 * 0.75 * math.sqrt(steps / rows) / steps  # 0.047, vs 0.1 dropped


def test_caller_drawn_noise_equals_generator_draws():
    """encode(noise=u) with u drawn from a generator equals encode(generator=that generator): a compiled step
    can draw the noise outside its graph."""
    shape = torch.Size((70, 130))
    x = moment(shape, "m", seed=10)
    for spec in ("bf16_sr", "ternary_sr", "ternary_ef"):
        codec = C.make_codec(spec, "m", x.numel(), torch.float32)
        k = codec.noise_numel(shape)
        assert k > 0
        a, b = codec.init("m", shape, "cpu"), codec.init("m", shape, "cpu")
        codec.encode("m", x, a, noise=torch.rand(k, generator=gen(11)))
        codec.encode("m", x, b, noise=torch.rand(k, generator=gen(11)))
        assert all(torch.equal(a[key], b[key]) for key in a)
        if spec != "bf16_sr":  # same uniform stream as the generator path
            c = codec.init("m", shape, "cpu")
            codec.encode("m", x, c, generator=gen(11))
            assert all(torch.equal(a[key], c[key]) for key in a)
    for spec, role in (("int8", "m"), ("int4", "v"), ("factored", "v"), ("fp32", "m")):
        assert C.make_codec(spec, role, x.numel(), torch.float32).noise_numel(shape) == 0


@pytest.mark.slow
def test_compiled_encode_decode_matches_eager():
    """The codecs trace into one torch.compile graph (no graph break) when stochastic codecs get their noise
    from the caller, and the compiled encode stores the same state (and decode returns the same moment) as the
    eager one."""
    shape = torch.Size((100, 130))
    for spec, role in (("int8", "m"), ("int4", "v"), ("ternary_sr", "m"), ("ternary_ef", "m"), ("bf16_sr", "m"),
                       ("factored", "v")):
        codec = C.make_codec(spec, role, shape.numel(), torch.float32)

        def step(state, x, noise):
            codec.encode("m", x, state, noise=noise)
            return codec.decode("m", state, shape)

        noise = torch.rand(max(codec.noise_numel(shape), 1), generator=gen(13))
        eager, compiled = codec.init("m", shape, "cpu"), codec.init("m", shape, "cpu")
        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True)
        for seed in (14, 15):  # the second encode reads the first's residual (ternary_ef)
            x = moment(shape, role, seed=seed)
            y_eager, y_compiled = step(eager, x, noise), fn(compiled, x, noise)
            if spec == "factored":  # fp32 means: a compiled reduction may differ in the last bit
                torch.testing.assert_close(y_compiled, y_eager, rtol=1e-6, atol=0)
                continue
            assert torch.equal(y_compiled, y_eager), spec
            for key in eager:
                assert torch.equal(compiled[key], eager[key]), (spec, key)


# --------------------------------------------------------------------------------- make_codec errors

def test_make_codec_rejects_unknown_and_misplaced_specs():
    with pytest.raises(ValueError, match=r"spec='int3'.*allowed: auto, fp32"):
        C.make_codec("int3", "m", 10**5, torch.float32)
    for spec in ("ternary", "ternary_sr", "ternary_ef"):
        with pytest.raises(ValueError, match=r"role 'v'.*non-negative.*allowed: .*factored"):
            C.make_codec(spec, "v", 10**5, torch.float32)
    with pytest.raises(ValueError, match=r"spec='factored'.*role 'm'.*allowed: .*ternary_ef"):
        C.make_codec("factored", "m", 10**5, torch.float32)
    with pytest.raises(ValueError, match="role must be 'm' or 'v'"):
        C.make_codec("int8", "w", 10**5, torch.float32)
    with pytest.raises(ValueError, match="int3"):  # validated even where the fp32 fallback applies
        C.make_codec("int3", "m", 10, torch.float32)


def test_factored_falls_back_to_fp32_for_non_matrices():
    codec = C.make_codec("factored", "v", 10**5, torch.float32)
    for shape in (torch.Size((100000,)), torch.Size((10, 100, 100))):
        state = codec.init("v", shape, "cpu")
        assert set(state) == {"v"} and state["v"].shape == shape and state["v"].dtype == torch.float32
        x = torch.rand(shape, generator=gen(16))
        codec.encode("v", x, state)
        assert torch.equal(codec.decode("v", state, shape), x)


# ----------------------------------------------------------------------------------------- factored

def test_factored_is_exact_for_rank_one_and_keeps_the_means():
    rows, cols = torch.rand(80, generator=gen(17)) + 0.1, torch.rand(120, generator=gen(18)) + 0.1
    v = torch.outer(rows, cols)
    codec = C.make_codec("factored", "v", v.numel(), torch.float32)
    state = codec.init("v", v.shape, "cpu")
    codec.encode("v", v, state)
    torch.testing.assert_close(codec.decode("v", state, v.shape), v, rtol=1e-5, atol=0)
    # any v: the decoded v has the stored row and column means, so re-encoding it changes nothing
    v = torch.rand(80, 120, generator=gen(19))
    codec.encode("v", v, state)
    y = codec.decode("v", state, v.shape)
    torch.testing.assert_close(y.mean(1), v.mean(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(y.mean(0), v.mean(0), rtol=1e-5, atol=0)


def test_factored_running_statistics_equal_adafactor():
    """Adafactor's running row/column statistics R_t = b R_{t-1} + (1-b) rowmean(g^2) (and C_t alike) are what
    the factored codec stores when the optimizer encodes b * decode(v) + (1-b) g^2."""
    beta = 0.9
    codec = C.make_codec("factored", "v", 80 * 120, torch.float32)
    state = codec.init("v", torch.Size((80, 120)), "cpu")
    r_ref, c_ref = torch.zeros(80), torch.zeros(120)
    for t in range(5):
        g2 = torch.randn(80, 120, generator=gen(20 + t)).square()
        v = codec.decode("v", state, g2.shape).mul_(beta).add_(g2, alpha=1 - beta)
        codec.encode("v", v, state)
        r_ref = beta * r_ref + (1 - beta) * g2.mean(1)
        c_ref = beta * c_ref + (1 - beta) * g2.mean(0)
    torch.testing.assert_close(state["v"], r_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(state["v_col"], c_ref, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------------- resolve_codecs

def test_resolve_codecs_defaults_and_shorthands():
    assert C.resolve_codecs(None, None, None, None) == ("auto", "auto")
    assert C.resolve_codecs(None, None, None, 32) == ("fp32", "fp32")
    assert C.resolve_codecs(None, None, None, 16) == ("bf16", "bf16")
    assert C.resolve_codecs(None, None, None, 8) == ("int8", "int8")
    assert C.resolve_codecs(None, None, None, 4) == ("int4", "int4")
    assert C.resolve_codecs(None, None, None, 2) == ("ternary", "factored")
    assert C.resolve_codecs("ternary", None, None, None) == ("ternary", "factored")
    assert C.resolve_codecs("ternary_ef", None, None, None) == ("ternary_ef", "factored")
    assert C.resolve_codecs("int8", None, None, 8) == ("int8", "int8")  # agreeing settings are fine
    assert C.resolve_codecs("bf16_sr", None, None, 16) == ("bf16_sr", "bf16_sr")
    assert C.resolve_codecs("int8", None, "int4", None) == ("int8", "int4")
    assert C.resolve_codecs("ternary", None, "int8", None) == ("ternary", "int8")
    assert C.resolve_codecs(None, "ternary_sr", None, None) == ("ternary_sr", "auto")
    assert C.resolve_codecs(None, None, "factored", 8) == ("int8", "factored")
    assert C.resolve_codecs(None, "int4", None, 8) == ("int4", "int8")


def test_resolve_codecs_errors():
    with pytest.raises(ValueError, match=r"codec='int8' conflicts with state_bits=4"):
        C.resolve_codecs("int8", None, None, 4)
    with pytest.raises(ValueError, match=r"state_bits=3 .*allowed: 32 \(fp32\), 16 \(bf16\)"):
        C.resolve_codecs(None, None, None, 3)
    with pytest.raises(ValueError, match="state_bits"):
        C.resolve_codecs(None, None, None, True)
    with pytest.raises(ValueError, match=r"codec='int3'.*allowed"):
        C.resolve_codecs("int3", None, None, None)
    with pytest.raises(ValueError, match=r"v_codec='ternary'.*allowed"):
        C.resolve_codecs(None, None, "ternary", None)
    with pytest.raises(ValueError, match=r"m_codec='factored'.*allowed"):
        C.resolve_codecs(None, "factored", None, None)
    with pytest.raises(ValueError, match=r"codec='factored'.*v_codec='factored'"):
        C.resolve_codecs("factored", None, None, None)
