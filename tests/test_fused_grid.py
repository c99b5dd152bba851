"""The issue's conformance table: for every rule x moment codec x projector, the fused step (``fused=True``: the
one-pass C kernel, torch's fused AdamW, the planned replays) against the eager reference (``fused=False``), on the
weight and on every state tensor, over steps that cross a subspace refresh and a block turn.

Criteria (test_native's): bf16 weights within one bf16 step a step (an update one fp32 ulp apart may round the
weight the other way: the kernel's square root is correctly rounded, torch's CPU one is not always, and a projection
spreads such an ulp over the weight) and in at most 1% of the elements; fp32 weights and fp32 state within 1e-6
relative; codes equal but for at most 1e-3 of them.
"""

import itertools

import pytest
import torch
from helpers import assert_state_close, random_grads, random_params, run_steps

import slimopt

RULES = ["adamw", "lion", "sgdm"]
CODECS = ["fp32", "bf16", "bf16_sr", "int8", "int4", "ternary", "factored"]  # factored: AdamW's v
PROJECTORS = [dict(), dict(projector="svd", rank=8), dict(projector="randomized_svd", rank=8),
              dict(projector="random", rank=8, free_rule="sign"), dict(projector="columns", density=0.25,
                                                                       free_rule="sgd"),
              dict(projector="rows", density=0.25, free_rule="sign"), dict(projector="block", density=0.5,
                                                                           free_rule="sign")]
GRID = [(r, c, p) for r, c, p in itertools.product(RULES, CODECS, range(len(PROJECTORS)))
        if not (c == "factored" and r != "adamw")]
STEPS, LRS = 4, [1e-2, 8e-3, 6e-3, 4e-3]
SHARES: list[float] = []


def _settings(rule: str, codec: str, projector: int) -> dict:
    kw = dict(lr=1e-2, weight_decay=0.1, rule=rule, update_gap=2, **PROJECTORS[projector])
    if codec == "factored":
        kw.update(m_codec="int8", v_codec="factored")
    else:
        kw["codec"] = codec
    if rule == "sgdm":
        kw["momentum"] = 0.9
    return kw


def _run(params, opt):  # step t's gradients drawn from seed 100 + t
    shapes, dtype = [p.shape for p in params], params[0].dtype
    run_steps(params, opt, [random_grads(shapes, dtype, 1, seed=100 + t, scale=0.1)[0] for t in range(STEPS)], LRS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rule,codec,projector", GRID,
                         ids=[f"{r}-{c}-{PROJECTORS[p].get('projector', 'none')}" for r, c, p in GRID])
def test_the_fused_step_equals_the_eager_reference(rule, codec, projector, dtype):
    kw = _settings(rule, codec, projector)
    # a 2-D weight of 12,000 elements (projected, partial codec blocks), a 1-D one of 5,000 and two of one shape,
    # so that blocks turn between them
    shapes = [(40, 300), (5000,), (64, 80), (64, 80)]
    a = random_params(shapes, dtype)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    _run(a, fused)
    _run(b, eager)
    for pa, pb in zip(a, b):
        if dtype == torch.float32:  # the kernel's square root against torch's: an ulp apart in some elements
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        ulp = torch.finfo(torch.bfloat16).eps * (pb.float().abs() + 2 * sum(LRS))
        assert bool(((pa.float() - pb.float()).abs() <= STEPS * ulp).all())
        SHARES.append((pa != pb).float().mean().item())
        # rounding apart in a few elements, not a different step; but AdamW on moments in the weight's dtype runs
        # torch's fused AdamW, which rounds a bf16 weight once a step where the eager step rounds it twice
        # (after the decay and after the update: test_multi_tensor), so many elements sit a bf16 step apart
        if dtype == torch.bfloat16 and not (rule == "adamw" and codec == "bf16"):
            assert SHARES[-1] <= 0.01
        assert_state_close(fused, eager, pa, pb)
