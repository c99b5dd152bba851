"""A toy rule added through the kernel contract (docs/design.md, section 2): SGD with Nesterov momentum
(``rule="nesterov"``), from its registry entry, its C kernel case and its Triton kernel case alone, on every route
this machine has against the eager reference: the C kernel, torch's eager windows, the Triton kernel under its
interpreter (this file run as a worker, as tests/triton_worker.py is). Nesterov's arithmetic has no square root
and no lerp, so every route is asserted bit for bit. And the kernels' ids are routes/abi.py's."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from helpers import seeded_steps
from launch import interpreted_worker

import slimopt
from slimopt.optim.algorithm import rules
from slimopt.optim.routes import abi
from slimopt.optim.routes.cpu import native

SHAPES = [(40, 300), (5000,), (30,)]  # 2-D (partial last blocks), 1-D, small (always fp32 state)
LRS = [1e-2, 8e-3, 6e-3]
CODECS = ["fp32", "bf16", "int8", "int4", "ternary_sr", "ternary_ef"]


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _run(ps, opt, steps=3):
    seeded_steps(ps, opt, 0, steps, LRS)


def _pair(dtype, **kw):
    """(weights and optimizer of the route under test, of the eager reference), `kw` the group's settings."""
    kw = dict(lr=1e-2, weight_decay=0.1, rule="nesterov", momentum=0.9, **kw)
    a, b = _params(dtype), _params(dtype)
    return a, slimopt.SlimOptimizer(a, **kw), b, slimopt.SlimOptimizer(b, fused=False, **kw)


def _differences(a, oa, b, ob) -> list[str]:
    """What differs, bit for bit, between two runs' weights and states (nothing: [])."""
    out = []
    for i, (pa, pb) in enumerate(zip(a, b)):
        if not torch.equal(pa, pb):
            out.append(f"weight {i}: max diff {(pa.float() - pb.float()).abs().max().item()}")
        sa, sb = oa.state[pa], ob.state[pb]
        if sorted(sa) != sorted(sb):
            out.append(f"state keys {i}: {sorted(sa)} vs {sorted(sb)}")
        out += [f"state {i} {k}" for k in sa if k in sb and not torch.equal(sa[k], sb[k])]
    return out


def _routes(opt, ps) -> set[str]:
    return {opt.explain(p)[0] for p in ps}


# ----------------------------------------------------------------------------------------------------------------
# the rule in the registry


def test_nesterov_is_a_rule_the_settings_take():
    assert "nesterov" in rules.RULES and "nesterov" in rules.ELEMENTWISE_RULES
    assert abi.MOMENT_KEYS["nesterov"] == ["momentum_buffer"]
    p = torch.nn.Parameter(torch.ones(3))
    slimopt.SlimOptimizer([p], rule="nesterov")
    with pytest.raises(ValueError, match="nesterov"):
        slimopt.SlimOptimizer([p], rule="nesterof")


# ----------------------------------------------------------------------------------------------------------------
# the routes


def test_the_eager_rule_is_torch_sgd_with_nesterov_momentum():
    a = _params(torch.float32)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = slimopt.SlimOptimizer(a, lr=1e-2, rule="nesterov", momentum=0.9, fused=False)
    theirs = torch.optim.SGD(b, lr=1e-2, momentum=0.9, nesterov=True)
    _run(a, ours)
    _run(b, theirs)
    for pa, pb in zip(a, b):  # torch may fuse g + momentum * buf into one rounding: within an ulp or two
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.state[pa]["momentum_buffer"], theirs.state[pb]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("codec", CODECS)
def test_the_c_kernel_route(dtype, codec):
    if native.library() is None:
        pytest.skip("the C kernel cannot be built here (no C compiler)")
    a, fast, b, eager = _pair(dtype, m_codec=codec)
    _run(a, fast)
    _run(b, eager)
    assert _routes(fast, a) == {"c_kernel"}, {p.shape: fast.explain(p) for p in a}
    assert _routes(eager, b) == {"eager_windows"}  # the eager reference's arithmetic, in windows
    assert not _differences(a, fast, b, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["fp32", "int8", "ternary_sr"])
def test_the_torch_routes(dtype, codec, monkeypatch):
    """torch's ops in windows (no C kernel) and the plain reference step (``routes/reference``: weights that are
    not contiguous, which no window takes) give the eager reference's bits."""
    monkeypatch.setitem(native._state, "lib", None)  # no C kernel: torch's ops in windows
    monkeypatch.setitem(native._state, "why", "turned off by the test")
    a, fast, b, eager = _pair(dtype, m_codec=codec)
    _run(a, fast)
    _run(b, eager)
    assert _routes(fast, a) == {"eager_windows"}, {p.shape: fast.explain(p) for p in a}
    assert not _differences(a, fast, b, eager)
    strided = [torch.nn.Parameter(p.detach().t().contiguous().t()) if p.dim() == 2 else p for p in _params(dtype)]
    plain = slimopt.SlimOptimizer(strided, lr=1e-2, weight_decay=0.1, rule="nesterov", momentum=0.9, m_codec=codec)
    _run(strided, plain)
    assert plain.explain(strided[0])[0] == "eager"
    assert not _differences(strided, plain, b, eager)


def test_the_eager_rule_by_hand():
    """The eager reference against the rule written out (fp32 weights and moments)."""
    a = _params(torch.float32)
    opt = slimopt.SlimOptimizer(a, lr=1e-2, weight_decay=0.1, rule="nesterov", momentum=0.9, m_codec="fp32",
                                fused=False)
    ws = [p.detach().clone() for p in a]
    bufs = [torch.zeros_like(w) for w in ws]
    for t in range(3):
        gen = torch.Generator().manual_seed(100 + t)
        grads = [torch.randn(w.shape, generator=gen) * 0.1 for w in ws]
        for w, buf, g in zip(ws, bufs, grads):
            buf.mul_(0.9).add_(g)
            w.mul_(1 - LRS[t] * 0.1).add_(buf * 0.9 + g, alpha=-LRS[t])
    _run(a, opt)
    for p, w, buf in zip(a, ws, bufs):
        assert torch.equal(p, w) and torch.equal(opt.state[p]["momentum_buffer"], buf)


def test_a_projected_step_runs_the_rule_in_the_kernel():
    """GaLore's projection with Nesterov momentum in the subspace: the subspace rule's direction from the C
    kernel (and the replayed plan), the eager reference's within rounding of the projections."""
    if native.library() is None:
        pytest.skip("the C kernel cannot be built here (no C compiler)")
    a, fast, b, eager = _pair(torch.float32, projector="svd", rank=4, update_gap=2)
    _run(a, fast, steps=4)
    _run(b, eager, steps=4)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_the_triton_route_under_the_interpreter():
    report = interpreted_worker("test_toy_rule.py")  # skips where triton is not installed
    assert len(report) == 2 * len(CODECS)
    for case, r in report.items():
        assert r["routes"] == ["triton"], (case, r)
        assert not r["differences"], (case, r)


def _triton_main() -> None:
    """Under TRITON_INTERPRET=1 and SLIMOPT_TRITON_CPU=1 (set by the test before triton is imported): every codec
    and weight dtype through the Triton kernel against the eager reference; prints a JSON report."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SLIMOPT_TRITON_CPU") == "1"
    torch.set_num_threads(1)
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        for codec in CODECS:
            a, fast, b, eager = _pair(dtype, m_codec=codec)
            _run(a, fast)
            _run(b, eager)
            report[f"{dtype}/{codec}"] = {"routes": sorted(_routes(fast, a)),
                                          "differences": _differences(a, fast, b, eager)}
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(_triton_main())
