"""Small models and training loops shared by the optimizer tests."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(nproc: int | None, *args: str, timeout: int = 900) -> str:
    """Run `args` (a script and its options, or ``-m module ...``) under ``torch.distributed.run`` with nproc ranks
    (None: one plain process), one thread a process; fail the test with the errors and the output's tail unless it
    exits 0. Returns its stdout and stderr."""
    import pytest
    head = [sys.executable]
    if nproc is not None:
        head += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                 "--master_port", str(free_port())]
    res = subprocess.run([*head, *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = res.stdout + res.stderr
    if res.returncode != 0:
        errors = [line for line in text.splitlines() if "Error" in line or "assert" in line.lower()]
        pytest.fail(f"{' '.join(args[:3])} at {nproc or 1} ranks failed ({res.returncode}):\n"
                    + "\n".join(errors[-20:]) + "\n--- tail ---\n" + text[-4000:])
    return text


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 32, layers: int = 2, dtype=torch.float32):
    """A LLaMA-shaped model small enough to step in milliseconds (non-square Linear weights included)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def batches(n: int, seed: int = 1, vocab: int = 64, batch: int = 4, seq: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(n)]


def backward(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach())


def twins(seed: int = 0, **kw):
    a = tiny_llama(seed, **kw)
    return a, copy.deepcopy(a)


def run(model, opt, data):
    losses = []
    for ids in data:
        losses.append(backward(model, ids))
        opt.step()
    return losses


def save_and_load(obj):
    """`obj` after torch.save and torch.load(weights_only=True) through memory, as a checkpoint file returns it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_continues_identically(model, opt, twin, twin_opt, data):
    """Step both models on the same batches, each with its optimizer; their parameters must stay bit-identical."""
    for ids in data:
        backward(model, ids)
        opt.step()
        backward(twin, ids)
        twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def interpreted_worker(script: str) -> dict:
    """Run tests/`script` in a process of its own with Triton's interpreter on and CPU tensors routed as CUDA ones
    (both chosen when triton is imported) and return the JSON object it prints last; skips where triton is not
    installed."""
    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "SLIMOPT_TRITON_CPU": "1", "OMP_NUM_THREADS": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    res = subprocess.run([sys.executable, os.path.join(here, script)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def assert_state_close(opt_a, opt_b, pa, pb) -> None:
    """Two optimizers' states of a weight as the fast paths are held to them: the same keys, dtypes and shapes,
    floats within 1e-6 relative, codes equal but for at most 1e-3 of them (another processor's torch may round a
    few moments the other way)."""
    sa, sb = opt_a.state[pa], opt_b.state[pb]
    assert sorted(sa) == sorted(sb)
    for key in sa:
        x, y = sa[key], sb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        if x.is_floating_point():
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-6, atol=1e-12, msg=key)
        else:
            assert (x != y).float().mean().item() <= 1e-3, key
