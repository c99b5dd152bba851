"""Tests of slimopt.optim.algorithm.quant: maps equal the peers', nearest rounding equals a brute-force argmin exactly,
error bounds, stochastic rounding is unbiased, padding, packing, and CPU parity with torchao / bitsandbytes."""

import math

import pytest
import torch

from slimopt.optim.algorithm import quant as Q

MAP_NAMES = ("dynamic8_signed", "dynamic8_unsigned", "dynamic4_signed", "linear4_nozero", "ternary")


def brute_force_codes(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Nearest map value by exhaustive fp32 distance; ties to the higher code (last index of the minimum)."""
    dist = (x.unsqueeze(-1) - qmap).abs()
    return qmap.numel() - 1 - dist.flip(-1).argmin(dim=-1)


def probe_inputs(qmap: torch.Tensor, n_random: int = 20000, seed: int = 0) -> torch.Tensor:
    """Inputs that stress nearest rounding: random values over (and beyond) the map's range, every map value,
    every fp32 midpoint between neighbours and the float just below and above it, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = float(qmap.min()), float(qmap.max())
    span = hi - lo
    rand = torch.rand(n_random, generator=g) * (span * 1.1) + (lo - 0.05 * span)
    # dense near zero as well, where the dynamic maps are finest
    tiny = (torch.rand(n_random, generator=g) - 0.5) * 2e-4
    mids = (qmap[:-1] + qmap[1:]) / 2
    inf = torch.tensor(float("inf"))
    neighbours = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                            torch.nextafter(torch.nextafter(mids, inf), inf)])
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, lo, hi, 1e-30, -1e-30])
    return torch.cat([rand, tiny, qmap, neighbours, special])


# ----------------------------------------------------------------------------------------------- maps

def test_dynamic_maps_equal_bitsandbytes():
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        assert torch.equal(Q.dynamic_map(signed, 8), bnb_f.create_dynamic_map(signed))


def test_maps_equal_torchao():
    pytest.importorskip("torchao")
    from torchao.optim import subclass_4bit, subclass_8bit

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.float32)

    assert torch.equal(Q.get_map("dynamic8_signed"), as_tensor(subclass_8bit.get_qmap_signed()))
    assert torch.equal(Q.get_map("dynamic8_unsigned"), as_tensor(subclass_8bit.get_qmap_unsigned()))
    assert torch.equal(Q.get_map("dynamic4_signed"), as_tensor(subclass_4bit.get_qmap_signed()))
    assert torch.equal(Q.get_map("linear4_nozero"), as_tensor(subclass_4bit.get_qmap_unsigned()))


def test_map_shapes_and_properties():
    for name, n in (("dynamic8_signed", 256), ("dynamic8_unsigned", 256), ("dynamic4_signed", 16),
                    ("linear4_nozero", 16), ("ternary", 3)):
        qmap = Q.get_map(name)
        assert qmap.dtype == torch.float32 and qmap.numel() == n
        assert bool((qmap.diff() > 0).all()), name  # strictly increasing: bucketize needs it
        assert float(qmap.max()) == 1.0  # absmax scaling hits the top code exactly
    assert float(Q.get_map("linear4_nozero").min()) == 1 / 16  # no zero for v
    assert 0.0 in Q.get_map("dynamic8_unsigned").tolist() and 0.0 in Q.get_map("dynamic4_signed").tolist()
    assert float(Q.get_map("dynamic8_signed").min()) == pytest.approx(-0.99296875)  # no -1 in the signed map


def test_map_errors():
    with pytest.raises(ValueError, match="bits"):
        Q.dynamic_map(True, 9)
    with pytest.raises(ValueError, match="allowed"):
        Q.get_map("int3")


# ------------------------------------------------------------------------------------- nearest rounding

@pytest.mark.parametrize("name", MAP_NAMES)
def test_nearest_equals_brute_force_argmin(name):
    qmap = Q.get_map(name)
    x = probe_inputs(qmap)
    assert torch.equal(Q.nearest_codes(x, qmap), brute_force_codes(x, qmap))


@pytest.mark.parametrize("name", MAP_NAMES + ("crowded",))
def test_bucket_table_equals_torch_bucketize(name):
    # the CPU look-up must give torch.bucketize's indices exactly; "crowded" puts 40 map values in one range of
    # the table (the same top 16 bits), so that several comparisons per element are needed
    if name == "crowded":
        qmap = torch.sort(torch.cat([torch.tensor([-1.0, -0.5, 0.0, 2.0]), 1.0 + torch.arange(40) * 2.0 ** -20]))[0]
    else:
        qmap = Q.get_map(name)
    x = torch.cat([probe_inputs(qmap), torch.nextafter(qmap, torch.tensor(9.0)), torch.nextafter(qmap, -qmap - 9),
                   torch.tensor([float("nan"), 1e-45, -1e-45, 3e38, -3e38])])
    table = Q._CountTable(qmap)
    assert table.extra == (40 if name == "crowded" else 1)
    assert torch.equal(table.count_le(x).long(), torch.bucketize(x, qmap, right=True))


@pytest.mark.parametrize("name", MAP_NAMES)
def test_nearest_without_tables_equals_brute_force_argmin(name, monkeypatch):
    # the path taken off CPU and under torch.compile: bucketize, then one distance comparison
    monkeypatch.setattr(Q, "_tables", lambda qmap: None)
    qmap = Q.get_map(name)
    x = probe_inputs(qmap)
    assert torch.equal(Q.nearest_codes(x, qmap), brute_force_codes(x, qmap))
    lo, hi = Q._bracket(x, qmap)
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip((lo, hi), Q._bracket(x, qmap)))


def test_nearest_ties_go_to_the_higher_code():
    tern = Q.get_map("ternary")
    # -0.5, 0.5 are exact midpoints of (-1, 0) and (0, 1)
    assert Q.nearest_codes(torch.tensor([-0.5, 0.5]), tern).tolist() == [1, 2]
    lin = Q.get_map("linear4_nozero")
    mids = (2 * torch.arange(1, 16) + 1) / 32.0  # exact midpoints between k/16 and (k+1)/16
    assert Q.nearest_codes(mids, lin).tolist() == list(range(1, 16))
    assert torch.equal(Q.nearest_codes(mids, lin), brute_force_codes(mids, lin))


def test_nearest_out_of_range_clamps_to_end_codes():
    qmap = Q.get_map("dynamic8_signed")
    assert Q.nearest_codes(torch.tensor([-5.0, 5.0]), qmap).tolist() == [0, 255]
    lin = Q.get_map("linear4_nozero")
    assert Q.nearest_codes(torch.tensor([0.0, -1.0, 0.03]), lin).tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------------- stochastic rounding

@pytest.mark.parametrize("name", MAP_NAMES)
def test_stochastic_rounding_is_unbiased(name):
    qmap = Q.get_map(name)
    g = torch.Generator().manual_seed(1)
    lo, hi = float(qmap.min()), float(qmap.max())
    x = torch.rand(64, generator=g) * (hi - lo) + lo
    draws = 4000
    xs = x.repeat(draws, 1)
    codes = Q.stochastic_codes(xs, qmap, torch.rand(xs.shape, generator=g))
    # always one of the two bracketing codes
    lo_i, hi_i = Q._bracket(xs, qmap)
    assert bool(((codes == lo_i) | (codes == hi_i)).all())
    values = qmap[codes]
    mean = values.mean(0)
    # tolerance: 5 standard errors of a two-point draw over the bracketing gap
    gap = (qmap[hi_i[0]] - qmap[lo_i[0]])
    tol = 5 * (gap / 2) / math.sqrt(draws) + 1e-7
    assert bool(((mean - x).abs() <= tol).all())


def test_stochastic_rounding_exact_values_stay():
    qmap = Q.get_map("dynamic8_unsigned")
    u = torch.rand(qmap.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Q.stochastic_codes(qmap, qmap, u), torch.arange(256))


# ------------------------------------------------------------------------------------------- blockwise

def halfgap_bound(normed: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Per-element bound of nearest rounding in map units: half the bracketing gap, or the distance to the
    end of the map outside its range."""
    lo, hi = Q._bracket(normed, qmap)
    inside = (normed >= qmap[0]) & (normed <= qmap[-1])
    outside = torch.maximum(qmap[0] - normed, normed - qmap[-1]).clamp_min(0)
    return torch.where(inside, (qmap[hi] - qmap[lo]) / 2, outside)


@pytest.mark.parametrize("name,block,signed", [("dynamic8_signed", 256, True), ("dynamic8_unsigned", 256, False),
                                               ("dynamic4_signed", 128, True), ("linear4_nozero", 128, False),
                                               ("ternary", 256, True)])
def test_blockwise_round_trip_within_map_bound(name, block, signed):
    qmap = Q.get_map(name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 111, generator=g) * torch.logspace(-3, 1, 111)  # 4107 values, mixed magnitudes
    if not signed:
        x = x.abs()
    codes, scale = Q.quantize_blockwise(x, qmap, block)
    n = x.numel()
    nb = math.ceil(n / block)
    assert codes.dtype == torch.uint8 and codes.shape == (nb * block,)
    assert scale.dtype == torch.float32 and scale.shape == (nb,)
    y = Q.dequantize_blockwise(codes, scale, qmap, n)
    blocks = Q.to_blocks(x, block)
    assert torch.equal(scale, blocks.abs().amax(-1))
    normed = blocks / scale.unsqueeze(-1)
    bound = (halfgap_bound(normed, qmap) * scale.unsqueeze(-1)).view(-1)[:n]
    err = (y - x.reshape(-1)).abs()
    slack = 4 * torch.finfo(torch.float32).eps * (x.reshape(-1).abs() + y.abs())  # fp32 rounding of x/s, q*s
    assert bool((err <= bound + slack).all())


def test_blockwise_nearest_equals_brute_force_on_scaled_input():
    qmap = Q.get_map("dynamic8_signed")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    codes, scale = Q.quantize_blockwise(x, qmap, 256)
    normed = Q.to_blocks(x, 256) / scale.unsqueeze(-1)
    assert torch.equal(codes.long().view(-1), brute_force_codes(normed.view(-1), qmap))


@pytest.mark.parametrize("name", MAP_NAMES)
def test_all_zero_and_constant_blocks(name):
    qmap = Q.get_map(name)
    block = 128
    zero = torch.zeros(3 * block)
    codes, scale = Q.quantize_blockwise(zero, qmap, block)
    assert scale.tolist() == [0.0, 0.0, 0.0]
    assert bool((Q.dequantize_blockwise(codes, scale, qmap) == 0).all())  # any code times scale 0
    for c in (3.5, 1e-20, 7e20):
        const = torch.full((2 * block,), c)
        codes, scale = Q.quantize_blockwise(const, qmap, block)
        assert torch.equal(Q.dequantize_blockwise(codes, scale, qmap), const)  # 1.0 is in every map
    if float(qmap.min()) < 0:
        const = torch.full((block,), -2.0)
        codes, scale = Q.quantize_blockwise(const, qmap, block)
        y = Q.dequantize_blockwise(codes, scale, qmap)
        assert torch.equal(y, torch.full_like(y, 2.0 * float(qmap.min())))  # the most negative code


def test_padding_when_block_does_not_divide():
    qmap = Q.get_map("dynamic8_signed")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, generator=g)
    x[768:] *= 1e-3  # a small tail block: its scale must be its own absmax, not the padded block's
    codes, scale = Q.quantize_blockwise(x, qmap, 256)
    assert codes.shape == (1024,) and scale.shape == (4,)
    assert float(scale[3]) == float(x[768:].abs().max())
    # the tail quantizes exactly as a block of its own values followed by zeros
    tail = torch.cat([x[768:], torch.zeros(24)])
    codes_tail, scale_tail = Q.quantize_blockwise(tail, qmap, 256)
    assert torch.equal(codes[768:], codes_tail) and torch.equal(scale[3:], scale_tail)
    zero_code = int((qmap == 0).nonzero())
    assert bool((codes[1000:] == zero_code).all())
    y = Q.dequantize_blockwise(codes, scale, qmap, 1000)
    assert y.shape == (1000,)
    assert torch.equal(Q.dequantize_blockwise(codes, scale, qmap)[:1000], y)


def test_stochastic_blockwise_is_unbiased_and_seeded():
    qmap = Q.get_map("ternary")
    draws = 2000
    x = torch.linspace(-1, 1, 256) * 0.7
    x[0] = -1.0  # every block's scale is 1
    xs = x.repeat(draws)  # one block per draw
    codes, scale = Q.quantize_blockwise(xs, qmap, 256, stochastic=True, generator=torch.Generator().manual_seed(0))
    assert bool((scale == 1).all())
    mean = Q.dequantize_blockwise(codes, scale, qmap).view(draws, 256).mean(0)
    # a ternary draw has std <= scale / 2; 5 standard errors over 2000 draws
    assert float((mean - x).abs().max()) <= 5 * 0.5 / math.sqrt(draws)
    assert float((mean - x).abs().max()) > 0  # really random
    a = Q.quantize_blockwise(x, qmap, 256, stochastic=True, generator=torch.Generator().manual_seed(9))
    b = Q.quantize_blockwise(x, qmap, 256, stochastic=True, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0])


# --------------------------------------------------------------------------------------------- packing

@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_bits_round_trip(bits):
    codes = torch.randint(0, 2**bits, (8 * 37,), generator=torch.Generator().manual_seed(bits))
    packed = Q.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() * bits // 8
    assert torch.equal(Q.unpack_bits(packed, bits).long(), codes)


def test_pack_4bit_matches_torchao_order():
    codes = torch.randint(0, 16, (256,), generator=torch.Generator().manual_seed(5)).to(torch.uint8)
    assert torch.equal(Q.pack_bits(codes, 4), (codes[::2] << 4) | codes[1::2])


def test_ternary_two_bit_packing_four_per_byte():
    trits = torch.randint(0, 3, (400,), generator=torch.Generator().manual_seed(6))
    packed = Q.pack_bits(trits, 2)
    assert packed.numel() == 100
    assert torch.equal(Q.unpack_bits(packed, 2).long(), trits)


def test_base3_round_trip_every_byte_value():
    digits = torch.cartesian_prod(*[torch.arange(3)] * 5).flip(-1)  # all 243 five-digit combinations
    packed = Q.pack_base3(digits.reshape(-1))
    assert packed.numel() == 243 and sorted(packed.tolist()) == list(range(243))
    assert torch.equal(Q.unpack_base3(packed).long(), digits.reshape(-1))


def test_base3_padding():
    trits = torch.randint(0, 3, (1003,), generator=torch.Generator().manual_seed(7))
    packed = Q.pack_base3(trits)
    assert packed.numel() == Q.base3_nbytes(1003) == 201
    assert torch.equal(Q.unpack_base3(packed, 1003).long(), trits)


def test_pack_bits_rejects_other_widths():
    with pytest.raises(ValueError, match="bits"):
        Q.pack_bits(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits"):
        Q.unpack_bits(torch.zeros(8, dtype=torch.uint8), 8)


# ------------------------------------------------------------------------------------------------ bf16

def test_bf16_nearest_equals_torch_cast():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(8)) * 1e3
    assert torch.equal(Q.to_bf16(x), x.to(torch.bfloat16))


def test_bf16_stochastic_is_unbiased_and_brackets():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(256, generator=g)
    down = x.to(torch.bfloat16)
    draws = 4000
    ys = Q.to_bf16(x.repeat(draws, 1), stochastic=True, generator=g).float()
    # every draw is one of the two bf16 values around x (toward or away from zero)
    toward = (x.view(torch.int32) & -65536).view(torch.float32)
    away = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    assert bool(((ys == toward) | (ys == away)).all())
    gap = (away - toward).abs()
    tol = 5 * (gap / 2) / math.sqrt(draws)
    assert bool(((ys.mean(0) - x).abs() <= tol).all())
    assert not torch.equal(ys.mean(0), down.float())  # really random


def test_bf16_stochastic_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -2.0])
    y = Q.to_bf16(x, stochastic=True, generator=torch.Generator().manual_seed(0)).float()
    assert y[:4].tolist() == [0.0, -0.0, float("inf"), float("-inf")]
    assert math.isnan(float(y[4])) and y[5:].tolist() == [1.0, -2.0]


# ------------------------------------------------------------------------------------ parity with peers

def _near_tie(normed: torch.Tensor, qmap: torch.Tensor, codes_a: torch.Tensor, codes_b: torch.Tensor):
    """Where two quantizers disagree, they must pick neighbouring codes for an input within a few ulps of
    their midpoint (the peers compare x - lo with (hi - lo) / 2 or multiply by 1/absmax, a different fp32
    rounding of the same rule)."""
    diff = codes_a != codes_b
    if not bool(diff.any()):
        return True
    a, b, x = codes_a[diff].long(), codes_b[diff].long(), normed[diff]
    if not bool(((a - b).abs() == 1).all()):
        return False
    mid = (qmap[a] + qmap[b]) / 2
    return bool(((x - mid).abs() <= 4 * torch.finfo(torch.float32).eps * x.abs().clamp_min(1e-6)).all())


def test_int8_blockwise_parity_with_torchao():
    pytest.importorskip("torchao")
    from torchao.optim import quant_utils as TQ

    qmap = Q.get_map("dynamic8_signed")
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(10))
    ours, our_scale = Q.quantize_blockwise(x, qmap, 256)
    normed, scale = TQ.scale_tensor(x.reshape(-1), 256)
    theirs = TQ.quantize_8bit_with_qmap(normed, qmap)
    assert torch.equal(our_scale, scale)
    assert _near_tie(normed, qmap, ours, theirs)
    assert (ours != theirs).float().mean() < 1e-3
    same = ours == theirs
    ref = TQ.dequant_with_qmap(theirs, qmap, scale)
    assert torch.equal(Q.dequantize_blockwise(ours, our_scale, qmap)[same], ref[same])


def test_int4_blockwise_parity_with_torchao():
    pytest.importorskip("torchao")
    from torchao.optim import quant_utils as TQ

    x = torch.randn(128 * 64, generator=torch.Generator().manual_seed(11))
    for name, vals in (("dynamic4_signed", x), ("linear4_nozero", x.square())):
        qmap = Q.get_map(name)
        ours, our_scale = Q.quantize_blockwise(vals, qmap, 128)
        normed, scale = TQ.scale_tensor(vals, 128)
        theirs = TQ.quantize_4bit_with_qmap(normed, qmap)
        assert torch.equal(our_scale, scale)
        assert _near_tie(normed, qmap, ours, theirs)
        packed_theirs = (theirs[::2] << 4) | theirs[1::2]
        if torch.equal(ours, theirs):
            assert torch.equal(Q.pack_bits(ours, 4), packed_theirs)


def test_int8_blockwise_parity_with_bitsandbytes_cpu():
    """bitsandbytes' CPU kernel has the same scales, and the same codes except for ~0.1% of values where it
    picks the neighbouring code; there ours is the nearer one (it equals the brute-force argmin)."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    qmap = bnb_f.create_dynamic_map(True)
    x = torch.randn(1000, 77, generator=torch.Generator().manual_seed(12))  # 77000: a partial last block
    try:
        theirs, st = bnb_f.quantize_blockwise(x, code=qmap, blocksize=256)
    except (RuntimeError, NotImplementedError) as exc:  # no CPU kernel in this build
        pytest.skip(f"bitsandbytes blockwise quantize unavailable on CPU: {exc}")
    padded, our_scale = Q.quantize_blockwise(x, qmap, 256)
    n = x.numel()
    assert torch.equal(our_scale, st.absmax)
    ours, theirs = padded[:n].long(), theirs.view(-1).long()
    normed = (Q.to_blocks(x, 256) / our_scale.unsqueeze(-1)).view(-1)[:n]
    diff = ours != theirs
    assert diff.float().mean() < 5e-3
    assert bool(((ours - theirs)[diff].abs() == 1).all())
    x_d = normed[diff]
    assert bool(((qmap[ours[diff]] - x_d).abs() <= (qmap[theirs[diff]] - x_d).abs()).all())
    ref = bnb_f.dequantize_blockwise(theirs.to(torch.uint8).view(x.shape), st).view(-1)
    mine = Q.dequantize_blockwise(padded, our_scale, qmap, n)
    torch.testing.assert_close(mine[~diff], ref[~diff], rtol=1e-6, atol=0)
