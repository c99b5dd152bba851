"""The counter-based stream of stochastic rounding (noise.py): its hash, its views, its numbers."""

import pytest
import torch

from slimopt.optim.algorithm import quant as Q
from slimopt.optim.algorithm.noise import CounterStream, mix32_int, mix_seed

M32 = 0xFFFFFFFF


def _reference_hash(key: int, j: int) -> int:
    """The hash as CounterStream.bits states it, on Python integers: one mix32 of the counter's low word, its high
    word times 0x9E3779B9 and the key's two words mixed."""
    key32 = mix32_int(mix32_int((key >> 32) & M32) ^ (key & M32))
    return mix32_int((j & M32) ^ (((j >> 32) * 0x9E3779B9) & M32) ^ key32)


def test_mix32_known_values():
    # lowbias32 of 0 is 0 and of 1 is a fixed odd pattern: the constants are the published ones
    assert mix32_int(0) == 0
    x = 1
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    assert mix32_int(1) == x ^ (x >> 16)


@pytest.mark.parametrize("key,offset", [(0, 0), (12345, 7), ((1 << 63) - 1, (1 << 32) - 5), (mix_seed(3, 4), 3 << 32)])
def test_bits_are_the_hash_of_key_and_counter_across_the_high_word(key, offset):
    got = [b & M32 for b in CounterStream(key, offset).bits(11, "cpu").tolist()]
    assert got == [_reference_hash(key, j) for j in range(offset, offset + 11)]


@pytest.mark.parametrize("offset", [0, 1, 6, (1 << 33) - 3])
def test_an_element_takes_half_of_the_hash_of_its_pair(offset):
    key = mix_seed(9)
    got = CounterStream(key, offset).int16((7,), "cpu").tolist()
    halves = [(_reference_hash(key, c // 2) >> (0 if c % 2 else 16)) & 0xFFFF for c in range(offset, offset + 7)]
    assert got == halves
    assert torch.equal(CounterStream(key, offset).uniform((7,), "cpu"), torch.tensor(halves) / 65536.0)


def test_a_view_reads_the_same_numbers_as_the_whole():
    s = CounterStream(mix_seed(1, 2, 3))
    whole = s.uniform((1000,), "cpu")
    assert torch.equal(s.at(300).uniform((200,), "cpu"), whole[300:500])
    assert torch.equal(s.at(100).at(200).uniform((5, 40), "cpu").view(-1), whole[300:500])
    assert torch.equal(s.at(301).uniform((3, 33), "cpu").view(-1), whole[301:400])  # from the second of a pair
    assert not torch.equal(s.fork(1).uniform((1000,), "cpu"), whole)


def test_uniform_and_int16_are_uniform_and_agree():
    s = CounterStream(mix_seed(7))
    u = s.uniform((1 << 20,), "cpu")
    assert u.dtype == torch.float32 and 0.0 <= u.min().item() and u.max().item() < 1.0
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    hist = torch.histc(u, bins=64, min=0.0, max=1.0)
    assert (hist - n / 64).abs().max().item() < 6 * (n / 64) ** 0.5
    lag1 = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(lag1) < 5 / n ** 0.5
    other = CounterStream(mix_seed(8)).uniform((1 << 20,), "cpu")
    assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1].item()) < 5 / n ** 0.5
    assert torch.equal(s.int16((1 << 20,), "cpu"), (u * 65536).to(torch.int32))


def test_one_round_streams_of_nearby_keys_are_unrelated():
    # one mix32 round a counter: the keys of consecutive steps (mix_seed's), keys one bit apart in either 32-bit word,
    # and the two halves of a hash must still give unrelated numbers, every bit of them fair
    n = 1 << 18
    keys = [mix_seed(0, 3, step, 0) for step in range(1, 4)] + [1 << 40, (1 << 40) ^ 1, (1 << 40) ^ (1 << 33)]
    streams = [CounterStream(k).int16((n,), "cpu") for k in keys]
    bound = 5 / n ** 0.5
    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            r = torch.corrcoef(torch.stack([streams[i], streams[j]]).double())[0, 1].item()
            assert abs(r) < bound, (keys[i], keys[j], r)
    for x in streams:
        bits = torch.stack([(x >> b) & 1 for b in range(16)]).double().mean(dim=1)
        assert (bits - 0.5).abs().max().item() < 5 * (0.25 / n) ** 0.5
        pairs = x.view(-1, 2).double()  # the high and the low half of one hash
        assert abs(torch.corrcoef(pairs.T)[0, 1].item()) < 5 / (n / 2) ** 0.5


def test_quant_draws_from_a_stream_or_a_generator():
    s = CounterStream(5, 10)
    assert torch.equal(Q.uniform((3, 4), "cpu", s), s.uniform((3, 4), "cpu"))
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(Q.uniform((6,), "cpu", g1), torch.rand(6, generator=g2))
    x = torch.randn(1000) * 1e-3 + 1.0
    # bf16 stochastic rounding from a stream: its integers are the stream's int16
    assert torch.equal(Q.to_bf16(x, stochastic=True, generator=s),
                       Q.to_bf16(x, stochastic=True, noise=s.uniform((1000,), "cpu")))
