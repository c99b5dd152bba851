"""The ternary codecs with a mean or rms block scale, blocks of 64 and bf16 scales (issue 15; codecs.TERNARY_SPECS):
exact bytes on the LLaMA-1B shapes, what encode stores, a window's ``part`` equal to the whole-tensor encode,
state_dict round trips with weights_only=True, and the windowed optimizer step against the whole-tensor one."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_state, save_and_load

from slimopt import SlimOptimizer
from slimopt.optim.algorithm import budget
from slimopt.optim.algorithm import codecs as C
from slimopt.optim.algorithm import quant as Q
from slimopt.optim.routes import windowed

NEW = [s for s in C.TERNARY_SPECS if s not in ("ternary_sr", "ternary_ef")]
SHAPE = torch.Size((96, 1280))  # whole blocks of 64 and of 5 trits (a byte) in every row


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def moment(shape, seed=0):
    return torch.randn(shape, generator=gen(seed)) * torch.logspace(-3, 0, shape[-1])


def test_bytes_on_4096_squared_and_llama_1b_projectable_weights():
    # m with factored v, per parameter: trits 0.2 + the scale (bf16 every 64 values: 2/64) + v (4 (R + C) / RC)
    def per_param(spec, shapes):
        total = sum(C.make_codec(spec, "m", s.numel(), torch.float32).nbytes(s)
                    + C.make_codec("factored", "v", s.numel(), torch.float32).nbytes(s) for s in shapes)
        return total / sum(s.numel() for s in shapes)

    square = [torch.Size((4096, 4096))]
    # one LLaMA-1B layer's projectable weights (q, k, v, o 2048 x 2048; gate, up 5461 x 2048; down 2048 x 5461)
    llama = [torch.Size((2048, 2048))] * 4 + [torch.Size((5461, 2048))] * 2 + [torch.Size((2048, 5461))]
    assert per_param("ternary_sr_mean64", square) == pytest.approx(0.2 + 2 / 64 + 8 / 4096, abs=1e-6)  # 0.2332
    assert per_param("ternary_sr_rms64", square) == pytest.approx(0.2 + 2 / 64 + 8 / 4096, abs=1e-6)
    assert per_param("ternary_ef_mean64", square) == pytest.approx(0.4 + 2 / 64 + 8 / 4096, abs=1e-6)  # 0.4332
    assert per_param("ternary_sr_rms64", llama) == pytest.approx(0.2343, abs=1e-4)  # under 0.3
    assert per_param("ternary_ef_mean64", llama) == pytest.approx(0.4343, abs=1e-4)


@pytest.mark.parametrize("spec", NEW)
def test_encode_stores_trits_times_the_rounded_block_scale(spec):
    _, scale_kind, block, scale_dtype = C.TERNARY_SPECS[spec]
    shape = torch.Size((70, 130))  # a padded last block
    x = moment(shape, seed=1)
    codec = C.make_codec(spec, "m", x.numel(), torch.float32)
    state = codec.init("m", shape, "cpu")
    codec.encode("m", x, state, generator=gen(2))
    blocks = Q.to_blocks(x, block)
    tail = blocks[-1:, : x.numel() % block or block]  # the last block's own values
    d_blocks, d_tail = blocks.double(), tail.double()  # averaged in fp64, rounded once to fp32
    if scale_kind == "mean":  # BitNet b1.58's absmean over the block's own values (the tail's too)
        want = torch.cat([d_blocks[:-1].abs().mean(-1), d_tail.abs().mean(-1)]).float()
    elif scale_kind == "rms":  # the squares rounded to fp32 first, as the codec squares
        want = torch.cat([blocks[:-1].square().double().mean(-1), tail.square().double().mean(-1)]).sqrt().float()
    else:
        want = blocks.abs().amax(-1)
    assert state["m_scale"].dtype == scale_dtype
    assert torch.equal(state["m_scale"], want.to(scale_dtype))
    y = Q.to_blocks(codec.decode("m", state, shape), block)
    s = state["m_scale"].float().unsqueeze(-1)
    assert bool(((y == 0) | (y == s) | (y == -s)).all())


def test_mean_scale_is_unbiased_inside_the_scale_and_clips_beyond():
    draws = 4000
    row = torch.linspace(-2.0, 2.0, 64)  # mean |x| = 1.02: values beyond +-1.02 clip
    x = row.repeat(draws, 1)
    codec = C.make_codec("ternary_sr_mean64", "m", x.numel(), torch.float32)
    state = codec.init("m", x.shape, "cpu")
    codec.encode("m", x, state, generator=gen(3))
    s = float(state["m_scale"][0])
    mean = codec.decode("m", state, x.shape).mean(0)
    inside = row.abs() <= s
    assert float((mean[inside] - row[inside]).abs().max()) <= 5 * 0.5 * s / math.sqrt(draws)
    assert torch.equal(mean[~inside], row[~inside].sign() * s)


@pytest.mark.parametrize("spec", ["ternary_sr", "ternary_ef"] + NEW)
def test_window_parts_equal_the_whole_tensor_encode(spec):
    codec = C.make_codec(spec, "m", SHAPE.numel(), torch.float32)
    n = SHAPE.numel()
    x, prev = moment(SHAPE, seed=4), moment(SHAPE, seed=5)
    noise = torch.rand(codec.noise_numel(SHAPE), generator=gen(6))
    whole = codec.init("m", SHAPE, "cpu")
    codec.encode("m", prev, whole, noise=noise)  # a carried residual for error feedback
    parted = {k: v.clone() for k, v in whole.items()}
    before = codec.decode("m", whole, SHAPE).view(-1)
    codec.encode("m", x, whole, noise=noise)
    step = 7 * codec.align(SHAPE)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = codec.part("m", parted, start, stop)
        assert torch.equal(codec.decode("m", part, torch.Size((stop - start,))), before[start:stop])
        u = noise[start:start + part["m_scale"].shape[0] * codec.block_size]
        codec.encode("m", x.view(-1)[start:stop], part, noise=u)
    for k in whole:
        assert torch.equal(parted[k], whole[k]), (spec, k)
    assert torch.equal(codec.decode("m", parted, SHAPE), codec.decode("m", whole, SHAPE))


def _steps(settings, steps=3, seed=0):
    g = gen(seed)
    w = torch.nn.Parameter(torch.randn(SHAPE, generator=g))
    opt = SlimOptimizer([w], lr=1e-2, weight_decay=0.1, fused=False, **settings)
    for _ in range(steps):
        w.grad = torch.randn(SHAPE, generator=g)
        opt.step()
    return w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}, opt


@pytest.mark.parametrize("spec", NEW)
def test_windowed_step_equals_the_whole_tensor_step(spec, monkeypatch):
    settings = {"m_codec": spec}  # fp32 v: the factored v's column sums come in another order in windows
    whole_w, whole_state, _ = _steps(settings)
    codec = C.make_codec(spec, "m", SHAPE.numel(), torch.float32)
    codecs = [("exp_avg", codec), ("exp_avg_sq", C.make_codec("fp32", "v", SHAPE.numel(), torch.float32))]
    monkeypatch.setattr(budget, "WINDOW_BYTES", 1 << 18)
    win_w, win_state, _ = _steps(settings)
    per = windowed.scratch_per_element(windowed.kind(codecs), torch.float32)
    n = windowed.window_elems(SHAPE.numel(), codec.align(SHAPE), per)
    assert n < SHAPE.numel() // 2  # several windows
    # the counter-based stream gives every element the number it draws in the whole-tensor step: equal throughout
    assert torch.equal(win_w, whole_w)
    assert_same_state(win_state, whole_state)


@pytest.mark.parametrize("spec", NEW)
def test_state_dict_round_trip_with_weights_only_continues_bit_identically(spec):
    settings = {"codec": spec}  # ternary m with factored v
    _, _, opt = _steps(settings, steps=2)
    sd = save_and_load(opt.state_dict())
    p = opt.param_groups[0]["params"][0]
    assert sd["state"][0]["exp_avg_scale"].dtype == C.TERNARY_SPECS[spec][3]  # not cast to the weight's dtype
    w2 = torch.nn.Parameter(p.detach().clone())
    opt2 = SlimOptimizer([w2], lr=1e-2, weight_decay=0.1, fused=False, **settings)
    opt2.load_state_dict(sd)
    for k, v in opt.state[p].items():
        assert opt2.state[w2][k].dtype == v.dtype and torch.equal(opt2.state[w2][k], v), k
    g = gen(9)
    for _ in range(2):
        grad = torch.randn(SHAPE, generator=g)
        p.grad, w2.grad = grad.clone(), grad.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, w2)
    for k, v in opt.state[p].items():
        assert torch.equal(opt2.state[w2][k], v), k
