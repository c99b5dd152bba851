"""The fast path equals the plain reference loop (tests/reference.py) on parameters and every state tensor."""


import pytest
import torch
from helpers import backward, batches, twins
from reference import ReferenceOptimizer

import slimopt

CASES = [
    dict(projector="none"),
    dict(projector="none", eps_placement="galore", eps=1e-3),  # eps large enough to matter
    dict(projector="none", rule="lion", betas=(0.9, 0.99)),
    dict(projector="none", rule="sgdm", momentum=0.8),
    dict(projector="svd", rank=3, on_refresh="keep", free_rule="none", scale=0.25),
    dict(projector="svd", rank=3, on_refresh="reset", free_rule="sign", proj_side="reverse_std"),
    dict(projector="svd", density=0.25, on_refresh="project", free_rule="sgd", free_scale=0.5),
    dict(projector="svd", rank=4, proj_side="left", rule="lion", betas=(0.9, 0.99), free_rule="sign"),
    dict(projector="randomized_svd", rank=3, on_refresh="project", free_rule="sign", proj_side="right"),
    dict(projector="random", rank=5, on_refresh="reset", free_rule="sign"),
    dict(projector="random", density=0.5, on_refresh="project", rule="sgdm", free_rule="sgd"),
    dict(projector="columns", density=0.3, on_refresh="project", free_rule="sign"),
    dict(projector="rows", rank=7, on_refresh="reset", free_rule="sgd"),
    dict(projector="block", density=0.25, on_refresh="reset", free_rule="sign"),
    dict(projector="block", rank=1, on_refresh="keep", free_rule="none", block_order="descending"),
    dict(projector="block", density=0.5, on_refresh="keep", free_rule="sign", block_order="random", seed=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fast_path_equals_reference(case):
    a, b = twins(dtype=torch.float64)  # fp64: sign() of a near-zero residual must not flip on rounding noise
    settings = dict(lr=2e-3, weight_decay=0.05, update_gap=3, **case)
    fast = slimopt.SlimOptimizer(a.parameters(), **settings)
    ref = ReferenceOptimizer(b.parameters(), **settings)
    for ids in batches(8):
        backward(a, ids)
        backward(b, ids)
        fast.step()
        ref.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        sa, sb = fast.state[pa], ref.state[pb]
        assert set(sa) == set(sb), name
        for key in sa:
            va, vb = sa[key], sb[key]
            if key == "proj" and case["projector"] != "random":  # singular vectors: compare the subspace
                va, vb = va @ va.T, vb @ vb.T
            torch.testing.assert_close(va.float(), vb.float(), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name}/{key}: {m}")
