"""Projectors: orthonormal bases, frozen between refreshes, block order, rotation, randomized SVD accuracy."""

import pytest
import torch
from helpers import assert_same_state

import slimopt
from slimopt.optim.algorithm import projectors as P


def _step(opt, w, seed):
    w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
    opt.step()


@pytest.mark.parametrize("projector", ["svd", "randomized_svd", "random"])
@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])
def test_basis_is_orthonormal_frozen_and_refreshed(projector, shape):
    w = torch.nn.Parameter(torch.randn(shape))
    opt = slimopt.SlimOptimizer([w], projector=projector, rank=6, update_gap=3)
    bases = []
    for i in range(7):
        _step(opt, w, i)
        bases.append(opt.state[w]["proj"].clone())
    q = bases[0]
    assert q.shape == (min(shape), 6)  # std projects the shorter side
    torch.testing.assert_close(q.T @ q, torch.eye(6), atol=1e-5, rtol=0)
    assert torch.equal(bases[0], bases[1]) and torch.equal(bases[1], bases[2])  # frozen between refreshes
    assert not torch.allclose(bases[2], bases[3])  # refreshed at step 4
    assert torch.equal(bases[3], bases[5]) and not torch.allclose(bases[5], bases[6])


def test_coordinates_are_sorted_distinct_and_refreshed():
    w = torch.nn.Parameter(torch.randn(10, 40))
    opt = slimopt.SlimOptimizer([w], projector="columns", density=0.25, update_gap=2)
    _step(opt, w, 0)
    idx = opt.state[w]["proj_index"].clone()
    assert idx.numel() == 10 and torch.equal(idx, idx.unique())
    _step(opt, w, 1)
    assert torch.equal(idx, opt.state[w]["proj_index"])
    _step(opt, w, 2)
    assert not torch.equal(idx, opt.state[w]["proj_index"])
    assert opt.state[w]["exp_avg"].shape == (10, 10)


def test_block_cycling_order():
    assert [P.active_blocks(5, 0.4, i, "ascending", 0) for i in range(4)] == [[0, 1], [2, 3], [0, 4], [1, 2]]
    assert [P.active_blocks(4, 0.25, i, "descending", 0) for i in range(5)] == [[3], [2], [1], [0], [3]]
    rnd = [P.active_blocks(8, 0.25, i, "random", 7) for i in range(20)]
    assert all(len(r) == 2 for r in rnd) and len({tuple(r) for r in rnd}) > 5
    assert rnd == [P.active_blocks(8, 0.25, i, "random", 7) for i in range(20)]  # a pure function
    assert P.active_blocks(6, 0.0, 3, "ascending", 0) == []


def test_block_states_follow_the_schedule():
    ws = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(4)]
    opt = slimopt.FRUGAL(ws, density=0.5, update_gap=2)
    for step in range(1, 7):
        for i, w in enumerate(ws):
            w.grad = torch.randn(8, 8)
        opt.step()
        active = P.active_blocks(4, 0.5, (step - 1) // 2, "ascending", 0)
        for i, w in enumerate(ws):
            assert ("exp_avg" in opt.state[w]) == (i in active)
            if i in active:  # reset on refresh: the moments' age restarts
                assert int(opt.state[w]["moment_step"]) == (step - 1) % 2 + 1


def test_project_rotates_moments_into_the_new_basis():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(30, 12))
    opt = slimopt.SlimOptimizer([w], projector="random", rank=4, update_gap=2, on_refresh="project", rule="sgdm",
                                momentum=0.5, lr=0.0)
    _step(opt, w, 0)
    _step(opt, w, 1)
    old_q = opt.state[w]["proj"].clone()
    m_old = opt.state[w]["momentum_buffer"].clone()  # (30, 4): right projection
    full_old = m_old @ old_q.T
    w.grad = torch.zeros(30, 12)
    opt.step()  # refresh at step 3 with a zero gradient: the buffer is only rotated (then scaled by momentum)
    new_q = opt.state[w]["proj"]
    expected = 0.5 * (full_old @ new_q)  # the old momentum, seen in the new coordinates
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], expected, rtol=1e-5, atol=1e-6)


def test_randomized_svd_finds_the_top_subspace_of_a_low_rank_plus_noise_matrix():
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(300, 8, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(200, 8, generator=gen)).Q
    s = torch.linspace(10, 3, 8)
    g = u @ torch.diag(s) @ v.T + 0.01 * torch.randn(300, 200, generator=gen)
    for side, truth in (("left", u), ("right", v)):
        approx = P.randomized_basis(g, 8, side, torch.Generator().manual_seed(1))
        exact = P.svd_basis(g, 8, side)
        # distance between subspaces: the projectors agree
        torch.testing.assert_close(approx @ approx.T, exact @ exact.T, atol=1e-4, rtol=0)
        assert torch.linalg.matrix_norm(truth @ truth.T - approx @ approx.T, ord=2) < 0.1


def test_rank_is_clamped_and_density_zero_is_state_free():
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = slimopt.SlimOptimizer([w], projector="svd", rank=50)
    _step(opt, w, 0)
    assert opt.state[w]["proj"].shape == (4, 4)
    v = torch.nn.Parameter(torch.randn(6, 4))
    opt = slimopt.SlimOptimizer([v], projector="svd", density=0.0, free_rule="sign", lr=0.1)
    before = v.detach().clone()
    _step(opt, v, 0)
    assert set(opt.state[v]) == {"step"}
    torch.testing.assert_close(v.detach(), before - 0.1 * v.grad.sign())


def test_nonfinite_gradient_and_failed_svd_keep_the_previous_basis(monkeypatch):
    w = torch.nn.Parameter(torch.randn(20, 10))
    opt = slimopt.SlimOptimizer([w], projector="svd", rank=3, update_gap=1, lr=0.0)
    _step(opt, w, 0)
    q = opt.state[w]["proj"].clone()
    w.grad = torch.full((20, 10), float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(opt.state[w]["proj"], q)

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    with pytest.warns(RuntimeWarning, match="decomposition failed"):
        _step(opt, w, 5)
    assert torch.equal(opt.state[w]["proj"], q)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(opt, w, 6)  # warned once only
    assert torch.equal(opt.state[w]["proj"], q)


def test_grad_none_is_skipped():
    a, b = torch.nn.Parameter(torch.randn(5, 5)), torch.nn.Parameter(torch.randn(5, 5))
    opt = slimopt.SlimOptimizer([a, b])
    a.grad = torch.randn(5, 5)
    before = b.detach().clone()
    opt.step()
    assert b not in opt.state and torch.equal(b.detach(), before)


@pytest.mark.parametrize("on_refresh", ["reset", "project"])
def test_rank_above_the_smaller_side_is_clamped_for_decompositions(on_refresh):
    w = torch.nn.Parameter(torch.randn(40, 6))
    opt = slimopt.SlimOptimizer([w], projector="svd", rank=20, proj_side="left", update_gap=2,
                                on_refresh=on_refresh)
    for i in range(4):  # crosses a refresh
        _step(opt, w, i)
    assert opt.state[w]["proj"].shape == (40, 6) and opt.state[w]["exp_avg"].shape == (6, 6)


@pytest.mark.parametrize("shape", [(48, 20), (20, 48)])  # a right and a left projection under proj_side="std"
def test_proj_dtype_grad_projects_a_bf16_gradient_in_bf16_products(shape):
    # the first step's first moment is (1 - beta1) times the subspace gradient: with proj_dtype="grad" that is the
    # bf16 product of the bf16 gradient and the bf16-stored basis (galore-torch's arithmetic), with "fp32" the fp32
    # product of the same values; the two differ (the bf16 one rounds every entry to 8 bits of mantissa)
    lows = {}
    for proj_dtype in ("grad", "fp32"):
        w = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        opt = slimopt.SlimOptimizer([w], lr=1e-2, projector="svd", rank=4, codec="fp32", proj_dtype=proj_dtype)
        w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        opt.step()
        st = opt.state[w]
        q = st["proj"]
        assert q.dtype == torch.bfloat16
        side = P.side_for(w.shape, "std")
        mm = torch.bfloat16 if proj_dtype == "grad" else torch.float32
        low = P.down("svd", side, w.grad.to(mm), q.to(mm)).float()
        assert torch.equal(st["exp_avg"], low * (1 - 0.9))
        lows[proj_dtype] = low
    assert not torch.equal(lows["grad"], lows["fp32"])
    assert torch.allclose(lows["grad"], lows["fp32"], rtol=2 ** -7, atol=1e-6)


def test_proj_dtype_grad_leaves_fp32_weights_in_fp32():
    runs = []
    for proj_dtype in ("grad", "fp32"):
        w = torch.nn.Parameter(torch.randn(40, 24, generator=torch.Generator().manual_seed(0)))
        opt = slimopt.SlimOptimizer([w], lr=1e-2, projector="svd", rank=4, update_gap=2, proj_dtype=proj_dtype)
        for s in range(3):
            _step(opt, w, s)
        runs.append((w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_state(runs[0][1], runs[1][1])


@pytest.mark.parametrize("free_rule", ["none", "sign"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_proj_dtype_grad_fused_step_equals_the_eager_step(free_rule, rounding, monkeypatch):
    # the fused path writes the lifted bf16 update through the one-pass kernel, the eager one upcasts it and runs
    # rules.apply_update: the same fp32 values, so the same weights and states bit for bit. SGD momentum in the
    # subspace (no square root, no lerp): the two paths' directions then agree on every processor, so what is
    # compared is the write (with Adam, torch's CPU square root may round otherwise than the kernel's elsewhere)
    from slimopt.optim.routes.cpu import native
    lifted = []
    add_update = native.add_update
    monkeypatch.setattr(native, "add_update", lambda p, d, *a, **k: (lifted.append(d.dtype), add_update(p, d, *a, **k)))
    out = []
    for fused in (True, False):
        gen = torch.Generator().manual_seed(3)
        ws = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16))
              for shape in ((64, 48), (48, 64))]
        opt = slimopt.SlimOptimizer(ws, lr=1e-2, weight_decay=0.1, projector="svd", rank=8, update_gap=2,
                                    scale=0.25, rule="sgdm", momentum=0.9, free_rule=free_rule, param_rounding=rounding, proj_dtype="grad",
                                    fused=fused)
        for s in range(4):
            for i, w in enumerate(ws):
                w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(10 * s + i)).to(torch.bfloat16)
            opt.step()
        out.append(([w.detach().clone() for w in ws], [dict(opt.state[w]) for w in ws]))
    # without a residual the fused step lifts in bf16 straight into the kernel (when the C kernel is built)
    assert set(lifted) == ({torch.bfloat16} if free_rule == "none" and native.library() is not None else set())
    (w_f, st_f), (w_e, st_e) = out
    for a, b in zip(w_f, w_e):
        assert torch.equal(a, b)
    for a, b in zip(st_f, st_e):
        assert_same_state(a, b)


def test_proj_dtype_auto_takes_16_bit_products_only_where_the_device_has_the_units(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert P.matmul_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert P.matmul_dtype("auto", torch.float32, cuda) == torch.float32
    assert P.matmul_dtype("fp32", torch.bfloat16, cuda) == torch.float32
    assert P.matmul_dtype("grad", torch.float16, cpu) == torch.float16
    assert P.matmul_dtype("auto", torch.float16, cpu) == torch.float32  # no CPU multiplies fp16 fast here
    assert P.matmul_dtype("grad", torch.float64, cpu) == torch.float64
    for bf16_units in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert P.matmul_dtype("auto", torch.bfloat16, cpu) == (torch.bfloat16 if bf16_units else torch.float32)
        assert P.matmul_dtype("grad", torch.bfloat16, cpu) == torch.bfloat16


def test_the_galore_recipe_projects_bf16_weights_by_the_devices_units(monkeypatch):
    from helpers import tiny_llama
    for bf16_units in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        model = tiny_llama().to(torch.bfloat16)
        opt = slimopt.build(model, "galore", rank=4)
        w = model.model.layers[0].mlp.up_proj.weight
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        opt.step()
        st = opt.state[w]
        mm = torch.bfloat16 if bf16_units else torch.float32
        low = P.down("svd", P.side_for(w.shape, "std"), w.grad.to(mm), st["proj"].to(mm)).float()
        assert torch.equal(st["exp_avg"], low * (1 - 0.9))
