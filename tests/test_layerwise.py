"""Optimizer-in-backward ("layer-wise") updates: same parameters as the ordinary step, gradients freed at once."""

import math
import warnings

import pytest
import torch
from helpers import assert_same_models, batches, twins

import slimopt
from slimopt.optim.layerwise import LayerwiseUpdates, enable_layerwise

# Methods whose update is per parameter, with settings that exercise their machinery in a few steps (GaLore and
# FRUGAL refresh their subspace / active blocks every 2 steps).
METHODS = {
    "adamw": dict(lr=2e-3, weight_decay=0.1),
    "galore": dict(lr=1e-2, rank=4, update_gap=2),
    "frugal": dict(lr=2e-3, density=0.5, update_gap=2),
    "taco": dict(lr=1e-2, taco_alpha=2.0, weight_decay=0.01),
}


def _loss(model, ids, scale=1.0):
    return model(input_ids=ids, labels=ids).loss * scale


def _ordinary(model, opt, data, accum, clip=None, clip_each=None, sched=None):
    for w in range(0, len(data), accum):
        opt.zero_grad(set_to_none=True)
        for ids in data[w:w + accum]:
            _loss(model, ids, 1.0 / accum).backward()
        if clip_each is not None:
            for p in model.parameters():
                if p.grad is not None:
                    torch.nn.utils.clip_grad_norm_([p], clip_each)
        opt.step()
        if sched is not None:
            sched.step()


def _layerwise(model, opt, data, accum, check_grads=True, sched=None, **kw):
    lw = enable_layerwise(model, opt, accumulation_steps=accum, **kw)
    for i, ids in enumerate(data):
        _loss(model, ids, 1.0 / accum).backward()
        boundary = (i + 1) % accum == 0
        assert lw.stepped == boundary and lw.micro_steps == i + 1 and lw.steps == (i + 1) // accum
        if check_grads:
            grads = [p.grad is None for p in model.parameters()]
            assert all(grads) if boundary else not any(grads)  # freed at boundaries, accumulating in between
        if boundary and sched is not None:
            sched.step()
    return lw


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("method", list(METHODS))
def test_layerwise_equals_the_ordinary_step(method, accum):
    a, b = twins(seed=1)
    data = batches(6, seed=2)
    opt_a, opt_b = slimopt.build(a, method, **METHODS[method]), slimopt.build(b, method, **METHODS[method])
    _ordinary(a, opt_a, data, accum)
    _layerwise(b, opt_b, data, accum)
    assert_same_models(a, opt_a, b, opt_b)


@pytest.mark.parametrize("mode", ["per_param", "per_param_scaled"])
def test_per_parameter_clipping_equals_clipping_each_gradient_by_hand(mode):
    a, b = twins(seed=3)
    data = batches(4, seed=5)
    opt_a, opt_b = slimopt.build(a, "adamw", lr=1e-3), slimopt.build(b, "adamw", lr=1e-3)
    n = len(list(a.parameters()))
    limit = 0.05 if mode == "per_param" else 0.05 * math.sqrt(n)
    each = 0.05
    # the global norm of the unclipped gradient of the first window, for last_grad_norm
    _loss(b, data[0], 0.5).backward()
    _loss(b, data[1], 0.5).backward()
    global_norm = float(torch.nn.utils.get_total_norm([p.grad for p in b.parameters()]))
    clipped = sum(float(p.grad.norm()) > each for p in b.parameters())
    assert clipped >= 3  # the limit bites on several tensors, not all
    b.zero_grad(set_to_none=True)
    _ordinary(a, opt_a, data, 2, clip_each=each)
    lw = enable_layerwise(b, opt_b, accumulation_steps=2, clip=limit, clip_mode=mode)
    assert lw.clip_limit == pytest.approx(each)
    for i, ids in enumerate(data):
        _loss(b, ids, 0.5).backward()
        if i == 1:
            assert lw.last_grad_norm == pytest.approx(global_norm, rel=1e-5)
    assert_same_models(a, opt_a, b, opt_b)


def test_scheduler_lr_is_read_at_each_boundary_and_no_warning():
    a, b = twins(seed=4)
    data = batches(6, seed=6)
    lam = lambda s: [1.0, 0.5, 0.1, 2.0][s % 4]  # noqa: E731 - a schedule that changes every step
    opt_a, opt_b = slimopt.build(a, "taco", lr=1e-2), slimopt.build(b, "taco", lr=1e-2)
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lam)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lam)
    _ordinary(a, opt_a, data, 2, sched=sched_a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if scheduler.step() seems to precede optimizer.step()
        _layerwise(b, opt_b, data, 2, sched=sched_b)
    assert_same_models(a, opt_a, b, opt_b)
    assert opt_b.param_groups[0]["lr"] == pytest.approx(1e-2 * lam(3))
    # a different schedule gives different parameters: the lr really is read
    c, _ = twins(seed=4)
    opt_c = slimopt.build(c, "taco", lr=1e-2)
    _layerwise(c, opt_c, data, 2)
    assert not torch.equal(next(iter(c.parameters())), next(iter(b.parameters())))


def test_at_a_boundary_at_most_one_gradient_is_alive():
    model, _ = twins(seed=5)
    opt = slimopt.build(model, "taco", lr=1e-3)
    params = list(model.parameters())
    alive = []
    for p in params:  # registered first, so it runs before the layer-wise hook of the same parameter
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    enable_layerwise(model, opt)
    _loss(model, batches(1)[0]).backward()
    assert len(alive) == len(params) and max(alive) == 1


def test_parameters_missing_from_the_last_backward_of_a_window_are_still_stepped():
    torch.manual_seed(0)
    net = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    twin = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    twin.load_state_dict(net.state_dict())
    xs = torch.randn(4, 3, 4)

    def loss(m, i):  # the second layer only takes part in even micro-steps
        h = m[0](xs[i])
        return (m[1](h) if i % 2 == 0 else h).square().mean()

    opt_a, opt_b = slimopt.build(net, "adamw", lr=1e-2), slimopt.build(twin, "adamw", lr=1e-2)
    for w in (0, 2):
        opt_a.zero_grad(set_to_none=True)
        loss(net, w).backward()
        loss(net, w + 1).backward()
        opt_a.step()
    enable_layerwise(twin, opt_b, accumulation_steps=2)
    for i in range(4):
        loss(twin, i).backward()
    assert all(p.grad is None for p in twin.parameters())
    for pa, pb in zip(net.parameters(), twin.parameters()):
        assert torch.equal(pa, pb)


def test_paused_and_removed_hooks_only_accumulate():
    model, twin = twins(seed=6)
    opt = slimopt.build(model, "adamw", lr=1e-3)
    lw = enable_layerwise(model, opt)
    ids = batches(1)[0]
    with lw.paused():
        _loss(model, ids).backward()
    assert lw.micro_steps == 0 and lw.steps == 0 and lw.enabled
    assert all(p.grad is not None for p in model.parameters())
    for pa, pb in zip(model.parameters(), twin.parameters()):
        assert torch.equal(pa, pb)
    model.zero_grad(set_to_none=True)
    lw.remove()
    _loss(model, ids).backward()
    assert all(p.grad is not None for p in model.parameters()) and lw.micro_steps == 0


def test_bad_input():
    model, _ = twins()
    with pytest.raises(TypeError, match="step_param"):
        enable_layerwise(model, torch.optim.AdamW(model.parameters()))
    opt = slimopt.build(model, "adamw")
    for kw, match in ((dict(accumulation_steps=0), "accumulation_steps"), (dict(clip=0.0), "clip"),
                      (dict(clip=1.0, clip_mode="global"), "clip_mode")):
        with pytest.raises(ValueError, match=match):
            enable_layerwise(model, opt, **kw)
    extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not in the optimizer"):
        LayerwiseUpdates(list(model.parameters()) + list(extra.parameters()), opt)
