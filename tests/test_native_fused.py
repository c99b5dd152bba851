"""The C kernel's fused AVX-512 AdamW path (kernels/adamw_avx512.h) against the same
kernel built without AVX-512 (its tile-by-tile loops) and without any vector extension: weights and state the same
bytes after three steps, on gradients that reach every branch of the fused path (blocks whose smallest element is
far below their scale and take the checked or the divider's quotient, zeros, a NaN and an inf, a window whose end is
not a whole register), for fp32 and bf16 weights, with and without decay, both placements of eps, and the moments'
codecs it reads (8-bit codes from byte planes and by a gather): 8-bit and 4-bit alone and mixed, ternary (stochastic and with a carried residual) with factored,
8-bit or its own kind, fp32 and bf16. On a machine without AVX-512 the builds are the same code and the test still holds.
"""

import pytest
import torch
from helpers import assert_same_state

import slimopt
from slimopt.optim.routes.cpu import native

# without VBMI the 8-bit codes are decoded by a gather, with it from byte planes (map256_decode)
LEVELS = {"no-vbmi": ["-march=native", "-mno-avx512vbmi"], "no-avx512": ["-march=native", "-mno-avx512f"],
          "portable": []}
# a ragged end (4099); a last run of codes not a multiple of 64 (4192); whole blocks; rows of whole registers
SHAPES = [(48, 300), (4099,), (4192,), (9, 512), (96, 1024)]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        gs = []
        for shape in SHAPES:
            g = torch.randn(shape, generator=gen) * 0.1
            flat = g.view(-1)
            flat[5:9] = 1e-30 * torch.randn(4, generator=gen)  # far below the block's scale: the checked quotient
            flat[300:556] *= 1e-36  # a whole block of tiny values: the scale below the reciprocal's range
            flat[600:620] = 0.0
            if step == 1 and shape == (9, 512):
                flat[1000] = float("nan")
                flat[2000] = float("inf")
            gs.append(g)
        out.append(gs)
    return out


def _run(lib, monkeypatch, dtype, **kw):
    monkeypatch.setitem(native._state, "lib", lib)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype)) for s in SHAPES]
    opt = slimopt.SlimOptimizer(params, lr=1e-2, **kw)
    for gs in _grads(3):
        for p, g in zip(params, gs):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("m,v", [("int8", "int8"), ("int4", "int4"), ("int8", "int4"), ("ternary", "factored"),
                                 ("ternary_ef", "int8"), ("ternary_ef_mean64", "factored"), ("fp32", "fp32"),
                                 ("bf16", "int4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("extra", [{"weight_decay": 0.1}, {"weight_decay": 0.0, "eps_placement": "galore"}],
                         ids=["decay", "galore-eps"])
def test_the_fused_path_gives_the_bits_of_every_other_build(monkeypatch, m, v, dtype, extra):
    if native.library() is None:
        pytest.skip("the kernel cannot be built here (no C compiler)")
    kw = dict(m_codec=m, v_codec=v, **extra)
    fused_params, fused = _run(native.library(), monkeypatch, dtype, **kw)
    for level, flags in LEVELS.items():
        lib, why = native._build(flags)
        assert lib is not None and (not why or native._state["why"]), why  # as asked, unless the default was not
        params, opt = _run(lib, monkeypatch, dtype, **kw)
        for pa, pb in zip(fused_params, params):
            assert torch.equal(pa.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               pb.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), level
            assert_same_state(fused.state[pa], opt.state[pb], level, bitwise=True)
