"""The multi-tensor path (multi_tensor.py) against the eager per-parameter step, the reference: same state tensors,
parameters equal to rounding (AdamW through torch's fused kernel) or bit for bit (an inactive block's residual);
mixed paths in one group, a path switch across a checkpoint, and layer-wise stepping."""

from functools import partial

import pytest
import torch
from helpers import assert_same_state, random_grads, random_params, save_and_load
from helpers import run_steps as _run

import slimopt
from slimopt.optim.routes.torch import multi_tensor

SHAPES = [(64, 80), (96, 64), (80,), (48, 48)]  # 5120, 6144, 80 (fp32 moments: below 4096), 2304 elements


_params = partial(random_params, SHAPES)
_grads = partial(random_grads, SHAPES)


def _twins(dtype, **settings):
    a, b = _params(dtype), _params(dtype)
    return a, b, slimopt.SlimOptimizer(a, **settings), slimopt.SlimOptimizer(b, fused=False, **settings)


def _assert_state_equal(opt_a, opt_b, a, b, **tol):
    for pa, pb in zip(a, b):
        assert_same_state(opt_a.state[pa], opt_b.state[pb], **tol)


LRS = [1e-2, 8e-3, 6e-3, 4e-3, 2e-3]  # a schedule
ADAMW_CASES = [
    (torch.float32, dict(lr=1e-2, weight_decay=0.1)),
    (torch.float32, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6)),
    (torch.bfloat16, dict(lr=1e-2, weight_decay=0.1)),
    (torch.float32, dict(lr=1e-2, rule="taco")),  # 2-D weights take TACO's own step; the 1-D one AdamW, fused
]


@pytest.mark.parametrize("dtype,settings", ADAMW_CASES, ids=["fp32-decay", "fp32-betas", "bf16", "taco-fallback"])
def test_adamw_equals_the_eager_step(dtype, settings):
    a, b, fused, eager = _twins(dtype, **settings)
    _run(a, fused, _grads(dtype, 5), lrs=LRS)
    _run(b, eager, _grads(dtype, 5), lrs=LRS)
    if dtype == torch.float32:
        for pa, pb in zip(a, b):  # the same arithmetic in another order: rounding apart
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        _assert_state_equal(fused, eager, a, b, rtol=1e-6, atol=1e-9)
    else:
        # bf16 weights: the fused kernel rounds the weight once per step, the eager step twice (after the decay
        # and after the update), so each step may leave an element one bf16 step (ulp) further apart, an ulp of
        # where the element was then (it moved by at most 2 lr a step): at most 5 such ulps after 5 steps. The
        # moments are the same fp32 arithmetic rounded to bf16 (bit for bit here); a processor whose kernels
        # contract multiply-adds differently may round one the other way, so one bf16 step is allowed.
        reach = 2 * sum(LRS)
        for pa, pb in zip(a, b):
            ulp = torch.finfo(torch.bfloat16).eps * (torch.maximum(pa.float().abs(), pb.float().abs()) + reach)
            assert bool(((pa.float() - pb.float()).abs() <= 5 * ulp).all())
        _assert_state_equal(fused, eager, a, b, rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("free_rule,free_scale", [("sign", 1.0), ("sign", 0.5), ("sgd", 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inactive_block_residual_is_bit_identical(monkeypatch, dtype, free_rule, free_scale, path):
    """Density 0 (FRUGAL's state-free extreme): every block is inactive, every step is the residual's, through the
    one-pass C kernel or torch's foreach and per-tensor ops."""
    from slimopt.optim.routes.cpu import native

    if path == "torch" or native.library() is None:
        monkeypatch.setitem(native._state, "lib", None)
    a, b, fused, eager = _twins(dtype, lr=1e-2, weight_decay=0.1, projector="block", density=0.0,
                                free_rule=free_rule, free_scale=free_scale)
    _run(a, fused, _grads(dtype, 4))
    _run(b, eager, _grads(dtype, 4))
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
    _assert_state_equal(fused, eager, a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frugal_blocks_turn_through_both_kinds(dtype):
    """Blocks switch every step: each parameter alternates between the fused AdamW and the residual, and its moments
    are reset when it turns active again, exactly as in the eager step."""
    settings = dict(lr=1e-2, projector="block", density=0.5, update_gap=1, free_rule="sign", on_refresh="reset")
    a, b, fused, eager = _twins(dtype, **settings)
    _run(a, fused, _grads(dtype, 6))
    _run(b, eager, _grads(dtype, 6))
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, **tol)
    _assert_state_equal(fused, eager, a, b, **tol)


def test_which_parameters_take_the_kernels():
    """The batch is what the optimizer queues: count what reaches the kernels."""
    calls = {"adamw": 0, "residual": 0}
    params = _params(torch.bfloat16)
    opt = slimopt.SlimOptimizer(params, lr=1e-2)

    class Counting(multi_tensor.Batch):
        def adamw(self, *a, **k):
            calls["adamw"] += 1
            super().adamw(*a, **k)

        def residual(self, *a, **k):
            calls["residual"] += 1
            super().residual(*a, **k)

    opt._batch = Counting()
    for p, g in zip(params, _grads(torch.bfloat16, 1)[0]):
        p.grad = g
    opt.step()
    # bf16 weights of >= 4096 elements keep bf16 moments (the fused kernel's); the two smaller ones keep fp32
    # moments (the peers' small-tensor rule), which the kernel cannot take: they step eagerly in the same step
    assert calls == {"adamw": 2, "residual": 0}
    assert all(opt.state[p]["exp_avg"].dtype == (torch.bfloat16 if p.numel() >= 4096 else torch.float32)
               for p in params)


@pytest.mark.parametrize("settings", [dict(codec="int8"), dict(codec="bf16_sr"), dict(eps_placement="galore"),
                                      dict(rule="lion"), dict(compile=True)], ids=lambda s: next(iter(s.items()))[1])
def test_other_settings_stay_on_their_own_paths(settings):
    p = torch.nn.Parameter(torch.randn(64, 80))
    opt = slimopt.SlimOptimizer([p], **settings)
    group = opt.param_groups[0]
    codecs = opt._moment_codecs(group, p.shape, p.dtype)
    assert not multi_tensor.adamw_applies(group, p, torch.zeros_like(p), codecs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_path_switch_across_a_checkpoint(dtype):
    """Three steps on one path, a weights_only checkpoint, three more on the other path: as if on the eager path
    all along (to rounding), and the checkpoint's tensors are the eager path's (names, dtypes, shapes)."""
    grads = _grads(dtype, 6)
    a, ref, fused, eager = _twins(dtype, lr=1e-2, projector="block", density=0.5, update_gap=2, free_rule="sign")
    _run(a, fused, grads[:3])
    _run(ref, eager, grads)
    saved = save_and_load(fused.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = slimopt.SlimOptimizer(b, fused=False, lr=1e-2, projector="block", density=0.5, update_gap=2,
                                    free_rule="sign")
    resumed.load_state_dict(saved)
    resumed.param_groups[0]["fused"] = False  # the saved group said True: this run asks for the eager step
    _run(b, resumed, grads[3:])
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for pb, pr in zip(b, ref):
        torch.testing.assert_close(pb, pr, **tol)
    _assert_state_equal(resumed, eager, b, ref, **tol)


def test_step_param_equals_step():
    """Layer-wise updates step one parameter at a time through the same queue."""
    a, b = _params(torch.float32), _params(torch.float32)
    opt_a, opt_b = slimopt.SlimOptimizer(a, lr=1e-2), slimopt.SlimOptimizer(b, lr=1e-2)
    for gs in _grads(torch.float32, 3):
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        for q in b:
            opt_b.step_param(q)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_fused_setting_is_checked():
    with pytest.raises(ValueError, match="fused must be True or False"):
        slimopt.SlimOptimizer([torch.nn.Parameter(torch.zeros(3))], fused="yes")


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_taco_sparse_step_is_bit_identical(dtype, k):
    """TACO writes one entry a column (taco.apply_sparse) instead of a dense pass: the same arithmetic exactly."""
    a, b, fused, eager = _twins(dtype, lr=1e-2, weight_decay=0.1, rule="taco", taco_k=k)
    _run(a, fused, _grads(dtype, 4), lrs=LRS[:4])
    _run(b, eager, _grads(dtype, 4), lrs=LRS[:4])
    for pa, pb in zip(a[:2] + a[3:], b[:2] + b[3:]):  # the 2-D weights (the 1-D one takes fused AdamW)
        assert torch.equal(pa, pb)
    for key in ("taco_rows", "taco_values", "taco_absmax"):
        if k:
            assert torch.equal(fused.state[a[0]][key], eager.state[b[0]][key])
