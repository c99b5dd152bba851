"""The C kernel's 8-bit nearest-code search without a gather (kernels/nearest8_avx512.h) against the range table
(quant._CountTable) it replaces where gathers are slow: the same count for every float of a sweep of all fp32
patterns, around every decision point of both 8-bit maps and at the special values; the same weights and state
bytes after three steps with the search and with the gather (AdamW's fused step, Lion's and SGD momentum's tiles);
maps the fit cannot prove keep the gather.
The full sweep of all 2^32 patterns (4 minutes): SLIMOPT_EXHAUSTIVE=1 pytest tests/test_native_nearest8.py.
"""

import ctypes
import os

import pytest
import torch
from helpers import assert_same_state

import slimopt
from slimopt.optim.algorithm import quant
from slimopt.optim.routes.cpu import native

MAPS = ["dynamic8_signed", "dynamic8_unsigned"]


def _search():
    lib = native.library()
    fn = getattr(lib, "slimopt_nearest8_codes", None) if lib is not None else None
    if fn is None:
        pytest.skip("the kernel has no AVX-512 VBMI build here: the 8-bit codes come from the gather only")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _codes(points: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The search's codes of x (padded to 64), or None where the fit does not prove the map"""
    pad = -x.numel() % 64
    x = torch.cat([x.float(), x.new_zeros(pad, dtype=torch.float32)]).contiguous()
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    rc = _search()(points.data_ptr(), x.data_ptr(), x.numel(), codes.data_ptr())
    return codes[: x.numel() - pad] if rc == 0 else None


def _from_keys(keys: torch.Tensor) -> torch.Tensor:
    """int64 patterns in [0, 2^32) -> fp32"""
    return (keys - (keys >= 2**31).long() * 2**32).int().view(torch.float32)


def _check(name: str, x: torch.Tensor) -> None:
    qmap = quant.get_map(name)
    points = quant._nearest_points(qmap).contiguous()
    codes = _codes(points, x)
    assert codes is not None, f"the fit did not prove {name}"
    expected = quant._tables(qmap).nearest.count_le(x)
    wrong = (codes.int() != expected).nonzero()[:5, 0]
    assert wrong.numel() == 0, (name, x[wrong].tolist(), codes[wrong].tolist(), expected[wrong].tolist())


@pytest.mark.parametrize("name", MAPS)
def test_the_search_counts_as_the_table(name):
    sweep = torch.arange(0, 2**32, 2039, dtype=torch.int64)  # every exponent and sign, a prime stride
    points = quant._nearest_points(quant.get_map(name))
    keys = points.view(torch.int32).long() % 2**32  # each point, its neighbours and its mirror's
    near = (keys[:, None] + torch.arange(-64, 65)).reshape(-1)
    mirror = (keys ^ 2**31)[:, None] + torch.arange(-64, 65)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.99999994, -0.99999994, 1.0000001, float("inf"), -float("inf"),
                            3.4e38, -3.4e38, 1e-45, -1e-45, 1.2e-38, -1.2e-38, 1e-7, -1e-7])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00000, 0xFF800001], dtype=torch.int64)
    x = torch.cat([_from_keys(sweep), _from_keys(near % 2**32), _from_keys(mirror.reshape(-1) % 2**32), special,
                   _from_keys(nans)])
    _check(name, x)


@pytest.mark.skipif(os.environ.get("SLIMOPT_EXHAUSTIVE") != "1", reason="4 minutes: SLIMOPT_EXHAUSTIVE=1")
@pytest.mark.parametrize("name", MAPS)
def test_the_search_counts_as_the_table_for_every_float(name):
    for start in range(0, 2**32, 2**26):
        _check(name, _from_keys(torch.arange(start, start + 2**26, dtype=torch.int64)))


def test_maps_the_fit_cannot_prove_keep_the_gather():
    _search()
    good = quant._nearest_points(quant.get_map("dynamic8_signed")).contiguous()
    with_zero = good.clone()
    with_zero[127] = 0.0  # a point at zero: its sign cannot choose the side
    wide = good.clone()
    wide[128] = 1e-30  # more binades than a register's lanes
    wide = wide.sort().values
    random = torch.rand(255, generator=torch.Generator().manual_seed(0)).sort().values  # no line fits its spacing
    for points in (with_zero, wide, random):
        assert _codes(points.contiguous(), torch.zeros(64)) is None


def _steps(monkeypatch, mode: int, **kw):
    lib = native.library()
    monkeypatch.setattr(ctypes.c_int.in_dll(lib, "slimopt_nearest8_mode"), "value", mode)
    gen = torch.Generator().manual_seed(3)
    shapes = [(48, 300), (4099,), (96, 1024)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.05) for s in shapes]
    opt = slimopt.SlimOptimizer(params, lr=1e-2, **kw)
    for step in range(3):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 0.1
            flat = g.view(-1)
            flat[5:9] = 1e-30  # far below the block's scale
            flat[600:620] = 0.0
            if step == 1:
                flat[1000] = float("nan")
            p.grad = g
        opt.step()
    return params, opt


# AdamW's fused step (encode_blocks16) and the tile path's encode (Lion, SGD momentum)
STEPS = [{"m_codec": "int8", "v_codec": "int8"}, {"m_codec": "int8", "v_codec": "int4"},
         {"m_codec": "ternary", "v_codec": "int8"}, {"rule": "lion", "m_codec": "int8"},
         {"rule": "sgdm", "momentum": 0.9, "m_codec": "int8"}]


@pytest.mark.parametrize("kw", STEPS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_the_step_with_the_search_is_the_step_with_the_gather(monkeypatch, kw):
    _search()
    searched, a = _steps(monkeypatch, 1, weight_decay=0.1, **kw)
    gathered, b = _steps(monkeypatch, 2, weight_decay=0.1, **kw)
    for pa, pb in zip(searched, gathered):
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32))
        assert_same_state(a.state[pa], b.state[pb], "search vs gather", bitwise=True)
