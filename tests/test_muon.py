"""Muon as a slimopt rule (``rule="muon"``, ``slimopt.optim.algorithm.muon``): torch.optim.Muon's step exactly, composed with
codecs, projectors, layer-wise updates, checkpoints and the planner.

Why the identity test can ask for bit equality and stay independent of the processor (docs/design.md, section 5): both
optimizers step on the same gradients (model ``a``'s backward, copied to ``b``), and on each tensor both run the
same operations in the same order (a lerp for the momentum, a lerp for Nesterov's look-ahead, the bf16 Newton-Schulz
iteration as X X^T and two addmm's, decay by 1 - lr wd, then an add with alpha -lr s), and AdamW's part is torch's
fused AdamW kernel on both sides. Whatever a processor rounds, it rounds the same way twice; a difference would be
an arithmetic difference, which is what the test is for.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_continues_identically, backward, batches, save_and_load, tiny_llama, twins

import slimopt
from slimopt.optim.algorithm import muon
from slimopt.optim.algorithm.partition import classify
from slimopt.optim.routes.torch import multi_tensor

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

LR, WD = 1e-3, 0.1  # the recipe's lr; torch.optim.Muon's default weight decay


def _torch_pair(model, adjust_lr_fn, **muon_kw):
    """torch.optim.Muon on the projectable weights, torch's fused AdamW on the rest: the muon recipe's partition."""
    kinds = classify(model)
    matrices = [p for p, k in kinds.values() if k == "projectable"]
    rest = [p for p, k in kinds.values() if k != "projectable"]
    return (torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=0.95, adjust_lr_fn=adjust_lr_fn, **muon_kw),
            torch.optim.AdamW(rest, lr=LR, weight_decay=WD, fused=True))


def _shared_steps(a, b, ours, theirs, steps=10):
    for ids in batches(steps):
        backward(a, ids)
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = None if pa.grad is None else pa.grad.clone()
        ours.step()
        for opt in theirs:
            opt.step()


@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "original"])
def test_build_muon_equals_torch_muon_plus_adamw(adjust_lr_fn):
    # 10 steps of a small LLaMA (14 matrices, 32 x 32 and 32 x 64 / 64 x 32, tall and wide), weight decay 0.1:
    # every parameter, every momentum buffer and every Adam moment bit-identical (tolerance 0, see the docstring)
    a, b = twins()
    init = {n: p.detach().clone() for n, p in a.named_parameters()}
    ours = slimopt.build(a, "muon", weight_decay=WD, ns_dtype="bf16", adjust_lr_fn=adjust_lr_fn)
    theirs = _torch_pair(b, adjust_lr_fn)
    _shared_steps(a, b, ours, theirs)
    kinds = classify(a)
    states = {**theirs[0].state, **theirs[1].state}
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert not torch.equal(pa, init[name]), name  # it moved
        assert torch.equal(pa, pb), name
        keys = ("momentum_buffer",) if kinds[name][1] == "projectable" else ("exp_avg", "exp_avg_sq")
        for key in keys:
            assert torch.equal(ours.state[pa][key], states[pb][key]), (name, key)
    groups = {g["name"]: g for g in ours.param_groups}
    assert groups["projectable"]["rule"] == "muon" and groups["projectable"]["momentum"] == 0.95
    assert {g["rule"] for n, g in groups.items() if n != "projectable"} == {"adamw"}


def test_nesterov_off_and_other_coefficients_equal_torch():
    a, b = twins(seed=2)
    kw = dict(nesterov=False, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5))
    ours = slimopt.build(a, "muon", weight_decay=WD, ns_dtype="bf16", **kw)
    theirs = _torch_pair(b, "match_rms_adamw", ns_coefficients=kw["ns_coefficients"], ns_steps=3, nesterov=False)
    _shared_steps(a, b, ours, theirs, steps=4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_the_fp32_iteration_stays_near_torchs_bf16_one():
    # ns_dtype="auto" iterates in fp32 on a CPU (bf16 matmuls are ~80x slower on the benchmark machine): the same
    # iteration without bf16's rounding (8 significant bits), so the runs part by a few percent of the movement
    # (measured 2.7% after 10 steps), not more; bf16 in slimopt is torch's exactly (above)
    a, b = twins()
    init = {n: p.detach().clone() for n, p in a.named_parameters()}
    ours = slimopt.build(a, "muon", weight_decay=WD)
    assert ours.param_groups[0]["ns_dtype"] == "auto"
    _shared_steps(a, b, ours, _torch_pair(b, "match_rms_adamw"))
    worst = 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        move = float((pb - init[name]).detach().abs().max())
        worst = max(worst, float((pa - pb).detach().abs().max()) / move)
    assert 0 < worst < 0.1


# ----------------------------------------------------------------------------------------------------------------
# the iteration


def test_orthogonalize_gives_the_polar_factor_and_torchs_band():
    gen = torch.Generator().manual_seed(0)
    for shape in ((48, 20), (20, 48), (32, 32)):
        u = torch.randn(shape, generator=gen)
        U, _, Vh = torch.linalg.svd(u, full_matrices=False)
        # torch's quintic: singular values in a band around 1, not 1 (Jordan: about [0.7, 1.2] after 5 steps) for
        # those not far below the largest; a square Gaussian matrix has some that 5 steps (x a^5 ~ 490) do not lift
        s = torch.linalg.svdvals(muon.orthogonalize(u, dtype=torch.float32))
        if shape[0] != shape[1]:
            assert 0.6 < float(s.min()) and float(s.max()) < 1.25
        # the classical quintic converges to the polar factor U V^T
        o = muon.orthogonalize(u, (1.875, -1.25, 0.375), 40, dtype=torch.float32)
        torch.testing.assert_close(o, U @ Vh, atol=1e-4, rtol=0)
        assert torch.equal(u, u.clone())  # untouched
    assert torch.equal(muon.orthogonalize(torch.zeros(4, 6), dtype=torch.float32), torch.zeros(4, 6))


def test_lr_ratio_is_torchs():
    assert muon.lr_ratio("original", (64, 16)) == math.sqrt(4) and muon.lr_ratio(None, (16, 64)) == 1.0
    assert muon.lr_ratio("match_rms_adamw", (64, 16)) == 0.2 * 8


# ----------------------------------------------------------------------------------------------------------------
# composition


def _weight_run(steps=10, shape=(96, 128), seed=0, **kw):
    """A single (96, 128) weight (12,288 elements, past the 4096 under which moments stay fp32) stepped on fixed
    gradients that share a direction (so the momentum carries signal): its trajectory."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1)
    start = w.detach().clone()
    opt = slimopt.SlimOptimizer([w], rule="muon", lr=1e-2, momentum=0.95, **kw)
    signal = torch.randn(shape, generator=gen)
    for _ in range(steps):
        w.grad = signal + 0.5 * torch.randn(shape, generator=gen)
        opt.step()
    return start, w.detach().clone(), opt


@pytest.mark.parametrize("codec,bound", [("bf16", 0.02), ("int8", 0.05), ("int4", 0.3), ("ternary_ef", 0.6)])
def test_every_m_codec_composes(codec, bound):
    # the momentum through a codec: the run stays near the fp32 momentum's, closer the more bits (measured distance
    # over the movement after 10 steps: bf16 0.15%, int8 1.1%, int4 15%, ternary with error feedback 39%), and
    # holds fewer bytes
    start, ref, ref_opt = _weight_run()
    _, got, opt = _weight_run(m_codec=codec)
    share = float((got - ref).norm() / (ref - start).norm())
    assert share < bound, share
    assert slimopt.state_nbytes(opt) < slimopt.state_nbytes(ref_opt)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert "momentum_buffer" in state and "exp_avg_sq" not in state


def test_int8_muon_is_about_one_byte_per_parameter():
    model = tiny_llama(hidden=64, vocab=128)  # 64 x 64 and larger: every matrix past the 4096-element threshold
    opt = slimopt.build(model, "muon8bit")
    backward(model, batches(1, vocab=128)[0])
    opt.step()
    group = next(g for g in opt.param_groups if g["name"] == "projectable")
    n = sum(p.numel() for p in group["params"])
    held = sum(t.numel() * t.element_size() for p in group["params"] for k, t in opt.state[p].items()
               if k not in ("step", "moment_step"))
    assert held / n == pytest.approx(1.0, abs=0.05)
    assert opt.state[group["params"][0]]["momentum_buffer"].dtype == torch.uint8


def _lifted_update(projector, free_rule="none", shape=(40, 24), rank=6, **kw):
    """One step of lr 1 from zero momentum (weight decay 0): the update the weight took, over the lr factor."""
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen))
    start = w.detach().clone()
    opt = slimopt.SlimOptimizer([w], rule="muon", lr=1.0, projector=projector, rank=rank, free_rule=free_rule,
                                ns_dtype="fp32", **kw)
    w.grad = torch.randn(shape, generator=gen)
    opt.step()
    return (start - w.detach()) / muon.lr_ratio("original", shape), opt.state[w], w.grad


@pytest.mark.parametrize("side", ["left", "right"])
def test_under_an_orthonormal_projector_the_update_is_orthogonal_on_the_subspace(side):
    # GaLore-style: the momentum of Q^T G (r x n) or G Q (m x r) orthogonalized and lifted by Q. Q O has the r
    # singular values of O (torch's band around 1) with its column / row space inside span(Q), and nothing outside
    u, state, g = _lifted_update("svd", proj_side=side)
    q = state["proj"]
    assert q.shape[1] == 6 and torch.allclose(q.T @ q, torch.eye(6), atol=1e-5)
    s = torch.linalg.svdvals(u)
    assert 0.6 < float(s[:6].min()) and float(s[:6].max()) < 1.25 and float(s[6:].max()) < 1e-5
    outside = u - q @ (q.T @ u) if side == "left" else u - (u @ q) @ q.T
    assert float(outside.abs().max()) < 1e-5
    # with the convergent coefficients, exactly the polar factor of the projected momentum, lifted
    u, state, g = _lifted_update("svd", proj_side=side, ns_coefficients=(1.875, -1.25, 0.375), ns_steps=40)
    q = state["proj"]
    low = q.T @ g if side == "left" else g @ q
    uu, _, vh = torch.linalg.svd(low, full_matrices=False)
    polar = uu @ vh
    torch.testing.assert_close(u, q @ polar if side == "left" else polar @ q.T, atol=1e-4, rtol=0)


def test_frugal_columns_muon_with_a_sign_residual():
    # FRUGAL's coordinate subspace: Muon on the chosen columns (as one m x r matrix), sign on every other column
    shape = (40, 24)
    u, state, g = _lifted_update("columns", free_rule="sign", shape=shape)
    cols = state["proj_index"]
    ratio = muon.lr_ratio("original", shape)
    rest = [j for j in range(shape[1]) if j not in set(cols.tolist())]
    torch.testing.assert_close(u[:, rest] * ratio, g[:, rest].sign())  # the residual: lr * sign, unadjusted
    s = torch.linalg.svdvals(u[:, cols])
    assert 0.6 < float(s.min()) and float(s.max()) < 1.25


def test_frugal_muon_recipe_steps_blocks_with_muon_and_the_rest_with_sign():
    model = tiny_llama()
    opt = slimopt.build(model, "frugal_muon", update_gap=2)
    group = next(g for g in opt.param_groups if g["name"] == "projectable")
    assert (group["rule"], group["projector"], group["free_rule"], group["on_refresh"]) == ("muon", "block", "sign",
                                                                                           "reset")
    for ids in batches(3):
        backward(model, ids)
        opt.step()
    holding = [p for p in group["params"] if "momentum_buffer" in opt.state[p]]
    assert 0 < len(holding) < len(group["params"])  # the active quarter holds a momentum, the others nothing


def test_layerwise_updates_equal_the_ordinary_step():
    from slimopt.optim.layerwise import enable_layerwise

    a, b = twins(seed=1)
    opt_a, opt_b = slimopt.build(a, "muon"), slimopt.build(b, "muon")
    hooks = enable_layerwise(b, opt_b)
    for ids in batches(3, seed=2):
        backward(a, ids)
        opt_a.step()
        b(input_ids=ids, labels=ids).loss.backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    del hooks


def test_the_fused_adamw_kernel_does_not_take_muon():
    model = tiny_llama()
    opt = slimopt.build(model, "muon")
    group = next(g for g in opt.param_groups if g["name"] == "projectable")
    p = group["params"][0]
    codecs = opt._moment_codecs(group, p.shape, p.dtype)
    assert not multi_tensor.adamw_kernel_applies(group, p.dtype, "cpu", codecs)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("method", ["muon", "muon8bit", "frugal_muon"])
def test_state_dict_round_trip_continues_bit_identically(method):
    hp = {"update_gap": 2} if method == "frugal_muon" else {}
    a, b = twins(hidden=64, vocab=128)
    opt_a = slimopt.build(a, method, **hp)
    data = batches(6, vocab=128)
    for ids in data[:3]:
        backward(a, ids)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = slimopt.build(b, method, **hp)
    opt_b.load_state_dict(save_and_load(opt_a.state_dict()))  # torch.load(weights_only=True)
    for pa, pb in zip(a.parameters(), b.parameters()):
        for key, t in opt_a.state[pa].items():
            assert opt_b.state[pb][key].dtype == t.dtype and torch.equal(opt_b.state[pb][key], t), key
    assert_continues_identically(a, opt_a, b, opt_b, data[3:])


# ----------------------------------------------------------------------------------------------------------------
# bad settings


@pytest.mark.parametrize("setting,message", [
    ({"nesterov": "yes"}, "nesterov must be True or False"),
    ({"ns_steps": 100}, r"ns_steps .* integer in \[0, 99\]"),
    ({"ns_steps": 2.5}, r"ns_steps .* integer"),
    ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients must be three finite numbers"),
    ({"ns_coefficients": (1.0, float("nan"), 2.0)}, "ns_coefficients must be three finite numbers"),
    ({"ns_eps": 0.0}, "ns_eps must be a finite number > 0"),
    ({"ns_dtype": "fp16"}, "ns_dtype must be one of auto, bf16, fp32"),
    ({"adjust_lr_fn": "adamw"}, "adjust_lr_fn must be one of original, match_rms_adamw"),
    ({"momentum": 1.5}, r"momentum must be in \[0, 1\]"),
])
def test_bad_settings_raise_naming_the_setting(setting, message):
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=message):
        slimopt.SlimOptimizer([w], rule="muon", **setting)


def test_muon_refuses_tensors_that_are_not_2d():
    with pytest.raises(ValueError, match=r"rule 'muon' orthogonalizes 2-D weights; a parameter of shape \(4,\)"):
        slimopt.SlimOptimizer([torch.nn.Parameter(torch.zeros(4))], rule="muon")
    with pytest.raises(ValueError, match="rule 'muon' orthogonalizes 2-D weights"):
        slimopt.build(tiny_llama(), "adamw", rule="muon")  # rule reaches the norms too: use the muon recipe


@pytest.mark.parametrize("method,setting,why", [
    ("adamw", {"ns_steps": 3}, "only rule 'muon' reads it"),
    ("galore", {"adjust_lr_fn": "match_rms_adamw"}, "only rule 'muon' reads it"),
    ("adamw", {"momentum": 0.5}, "only rules 'sgdm', 'muon', 'nesterov' read it"),
])
def test_muon_settings_are_refused_where_nothing_reads_them(method, setting, why):
    key = next(iter(setting))
    with pytest.raises(ValueError, match=f"{key}=.* has no effect with method '{method}'.*{why}"):
        slimopt.build(tiny_llama(), method, **setting)


def test_muon_settings_reach_the_muon_group():
    opt = slimopt.build(tiny_llama(), "muon", ns_steps=3, momentum=0.9, nesterov=False, betas=(0.9, 0.95))
    groups = {g["name"]: g for g in opt.param_groups}
    g = groups["projectable"]
    assert (g["ns_steps"], g["momentum"], g["nesterov"]) == (3, 0.9, False)
    assert groups["head"]["betas"] == (0.9, 0.95)  # betas reach the AdamW groups that read them


# ----------------------------------------------------------------------------------------------------------------
# the planner


@pytest.mark.parametrize("method,hp", [("muon", {}), ("muon8bit", {}), ("frugal_muon", {"update_gap": 2}),
                                       ("muon", {"projector": "svd", "rank": 8, "update_gap": 1}),
                                       ("muon", {"projector": "columns", "density": 0.3, "free_rule": "sign"}),
                                       ("muon", {"m_codec": "ternary_ef"}), ("muon", {"m_codec": "int4"})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_planner_state_is_exact(method, hp, dtype):
    from helpers import fill_grads, planned
    from helpers import odd_llama as llama

    from slimopt.factory import make_optimizer

    model = llama(dtype)
    opt = make_optimizer(model, method, **hp)
    for s in range(1, 4):
        fill_grads(model, s)
        opt.step()
        assert planned(model, method, step=s, **hp) == slimopt.state_nbytes(opt), (method, hp, s)


@pytest.mark.parametrize("shape", [(256, 256), (128, 384), (512, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("codec", [None, "int8", "ternary_ef"])
def test_scratch_estimate_bounds_what_the_step_allocates(shape, dtype, ns_dtype, codec):
    # muon.scratch_bytes against torch's MemTracker count of one weight's step: an upper bound within 5%
    from torch.distributed._tools.mem_tracker import MemTracker

    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
    opt = slimopt.SlimOptimizer([w], rule="muon", ns_dtype=ns_dtype, **({"m_codec": codec} if codec else {}))
    for _ in range(2):
        w.grad = torch.randn(shape, generator=gen).to(dtype)
        if not opt.state:
            opt.step()
    base = 2 * w.numel() * w.element_size() + slimopt.state_nbytes(opt)
    tracker = MemTracker()
    tracker.track_external(w, opt)
    with tracker:
        opt.step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base
    group = opt.param_groups[0]
    name = opt._moment_codecs(group, w.shape, w.dtype)[0][1].name
    est = muon.scratch_bytes(shape, dtype, muon.iteration_dtype(ns_dtype, w.device), name)
    assert measured <= est <= 1.05 * measured


# ----------------------------------------------------------------------------------------------------------------
# the queued step (routes/torch/muon_batch.py): same-shape matrices stacked, a step's matrices iterated together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_stack_of_one_shape_iterates_as_each_matrix_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 64), (176, 64), (64, 64), (64, 176), (32, 64), (176, 64), (64, 64), (32, 64), (9, 5)]
    us = [torch.randn(s, generator=gen) for s in shapes]
    # stacked as on a GPU: a batched product need not round as mm does on every processor (it did, bit for bit, on
    # the AMD EPYC this was written on, but for a 3 x 3 Gram matrix in fp32): equal to rounding
    atol = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
    every = us + [torch.randn(3, 64, generator=gen) for _ in range(2)]
    stacked = list(muon.orthogonalize_many(every, dtype=dtype, stack=True))
    assert len(stacked) == len(every)
    for u, o in zip(every, stacked):
        assert o.dtype == dtype and o.shape == u.shape
        torch.testing.assert_close(o.float(), muon.orthogonalize(u, dtype=dtype).float(), rtol=0, atol=atol)
    # unstacked (a CPU's default): each matrix's own iteration, the same bits
    for u, o in zip(us, muon.orthogonalize_many(us, dtype=dtype)):
        assert torch.equal(o, muon.orthogonalize(u, dtype=dtype))
    with pytest.raises(ValueError, match="2-D"):
        muon.orthogonalize_many([torch.randn(4)])


def _steps(model, opt, n=3, seed=3):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("method,hp", [("muon", {}), ("muon8bit", {}), ("muon", {"nesterov": False}),
                                       ("frugal_muon", {"update_gap": 2}), ("muon", {"m_codec": "bf16_sr"})])
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_queued_step_equals_the_eager_reference(method, hp, ns_dtype, dtype):
    a, b = twins(hidden=64, dtype=dtype)
    fast = slimopt.build(a, method, ns_dtype=ns_dtype, **hp)
    eager = slimopt.build(b, method, ns_dtype=ns_dtype, **hp)
    next(g for g in eager.param_groups if g["rule"] == "muon")["fused"] = False  # the rest: the same AdamW
    _steps(a, fast)
    _steps(b, eager)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        for key, value in eager.state[pb].items():
            assert torch.equal(fast.state[pa][key], value), (name, key)
    routes = [(fast.explain(pa), eager.explain(pb)) for pa, pb in zip(a.parameters(), b.parameters()) if pa.dim() == 2]
    assert any(f[0] == "muon" and e[0] == "eager" and e[1]["muon"] == "fused=False" for f, e in routes)


def test_a_full_queue_runs_early_alike(monkeypatch):
    from slimopt.optim.routes import whole_queue
    from slimopt.optim.routes.torch import muon_batch

    a, b = twins(hidden=64)
    whole, early = slimopt.build(a, "muon"), slimopt.build(b, "muon")
    _steps(a, whole, 2)
    calls = []
    orig = muon.orthogonalize_many
    monkeypatch.setattr(muon, "orthogonalize_many", lambda us, *r, **k: calls.append(len(us)) or orig(us, *r, **k))
    monkeypatch.setattr(whole_queue, "QUEUE_BYTES", 40_000)  # a queue of two 64 x 64 fp32 matrices and a bit
    _steps(b, early, 2)
    runs = whole_queue.runs(muon_batch.queued_matrices(early, 2), 1)
    assert calls == 2 * [len(r) for r in runs] and len(runs) > 4 and max(calls) >= 2
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["muon", "muon8bit"])
def test_the_planned_step_scratch_bounds_the_queued_step(method, ns_dtype):
    # what a step of a small LLaMA allocates (MemTracker) against the planner's temporaries of the optimizer step:
    # the waiting iterates and, on a CPU (no stacks), the largest matrix's iteration or momentum store: measured
    # 0.97-1.05 of the count (a few hundred bytes of norms and counters, and int8's encode, above the estimate)
    from helpers import odd_llama as llama
    from torch.distributed._tools.mem_tracker import MemTracker

    from slimopt.bench import planner
    from slimopt.factory import make_optimizer

    model = llama(torch.float32, vocab_size=256, hidden_size=256, intermediate_size=704)
    opt = make_optimizer(model, method, ns_dtype=ns_dtype)
    _steps(model, opt, 1)
    base = sum(2 * p.numel() * p.element_size() for p in model.parameters()) + slimopt.state_nbytes(opt)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        opt.step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base
    planned = planner._scratch(method, planner._slim_state(model, method, 2, dict(ns_dtype=ns_dtype)))
    assert 0.95 * measured <= planned <= 1.12 * measured
