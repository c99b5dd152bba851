"""Staggered refreshes (``stagger_refresh=True``): each matrix of a subspace projector refreshes at its own phase of
the update gap, phases balanced by the refresh's cost (``routes/subspace.refresh_phase``), so that no step after
the first pays every decomposition; the synchronized schedule stays the default."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_continues_identically, backward, batches, save_and_load, twins

import slimopt
from slimopt.optim.algorithm import projectors
from slimopt.optim.routes.subspace import refresh_cost, refresh_phase

pytestmark = pytest.mark.usefixtures("one_thread")

GAP = 4


def _decompositions_per_step(stagger: bool, steps: int = 9, method: str = "galore") -> list[int]:
    model, _ = twins(hidden=64)
    opt = slimopt.build(model, method, rank=8, update_gap=GAP, stagger_refresh=stagger)
    counts = []
    orig_svd, orig_rsvd = projectors.svd_basis, projectors.randomized_basis
    calls = []
    try:
        projectors.svd_basis = lambda *a, **k: calls.append(1) or orig_svd(*a, **k)
        projectors.randomized_basis = lambda *a, **k: calls.append(1) or orig_rsvd(*a, **k)
        for ids in batches(steps, vocab=64):
            calls.clear()
            backward(model, ids)
            opt.step()
            counts.append(len(calls))
    finally:
        projectors.svd_basis, projectors.randomized_basis = orig_svd, orig_rsvd
    return counts


@pytest.mark.parametrize("method", ["galore", "galore_rsvd"])
def test_staggered_refreshes_spread_the_decompositions_over_the_gap(method):
    synced = _decompositions_per_step(False, method=method)
    staggered = _decompositions_per_step(True, method=method)
    n = synced[0]  # every projected matrix, at the first step
    assert n == 14 and synced == [n, 0, 0, 0, n, 0, 0, 0, n]
    assert staggered[0] == n  # every matrix needs a basis to start with
    # afterwards each matrix once per gap, at its phase: no step pays them all, every window of GAP steps pays each
    assert max(staggered[1:]) <= -(-n // GAP) + 1 and sum(staggered[1:GAP + 1]) == n and sum(staggered[5:9]) == n


def test_phases_are_balanced_by_the_refresh_cost():
    model, _ = twins(hidden=64)
    opt = slimopt.build(model, "galore", rank=8, update_gap=GAP, stagger_refresh=True)
    group = next(g for g in opt.param_groups if g["projector"] == "svd")
    phases = [refresh_phase(opt, p, group) for p in group["params"]]
    assert set(phases) == set(range(GAP))
    loads = [sum(refresh_cost(group, p.shape) for p, ph in zip(group["params"], phases) if ph == k) for k in range(GAP)]
    largest = max(refresh_cost(group, p.shape) for p in group["params"])
    assert max(loads) <= sum(loads) / GAP + largest
    other = next(g for g in opt.param_groups if g["projector"] == "none")
    assert refresh_phase(opt, other["params"][0], other) == 0


def test_a_checkpoint_resumes_the_staggered_schedule():
    a, b = twins(hidden=64)
    opt_a = slimopt.build(a, "galore", rank=8, update_gap=GAP, stagger_refresh=True)
    data = batches(10, vocab=64)
    for ids in data[:3]:
        backward(a, ids)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = slimopt.build(b, "galore", rank=8, update_gap=GAP, stagger_refresh=True)
    opt_b.load_state_dict(save_and_load(opt_a.state_dict()))
    assert_continues_identically(a, opt_a, b, opt_b, data[3:])


def test_the_setting_is_refused_where_nothing_refreshes():
    model, _ = twins()
    with pytest.raises(ValueError, match="stagger_refresh"):
        slimopt.build(model, "adamw", stagger_refresh=True)
    with pytest.raises(ValueError, match="stagger_refresh must be True or False"):
        slimopt.SlimOptimizer([torch.nn.Parameter(torch.zeros(4, 4))], projector="svd", rank=2, stagger_refresh=1)
