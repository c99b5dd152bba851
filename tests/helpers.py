"""What the tests share: small models, seeded tensors and training loops, and the comparisons of weights and
optimizer states that the fast routes are held to (docs/design.md, section 5). Processes a test starts are
tests/launch.py's."""

from __future__ import annotations

import copy
import io

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# the tiny LLaMA: steps in milliseconds, non-square Linear weights
TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
# the planner's LLaMA: tensors above and below the codecs' 4096-element threshold, blocks that do not divide them,
# grouped-query attention (k/v smaller than q) and non-square MLP weights
ODD_LLAMA = {**TINY_LLAMA, "vocab_size": 203, "hidden_size": 64, "intermediate_size": 90, "num_key_value_heads": 2}
WORDS = ["good", "great", "fine", "bad", "awful", "poor", "film", "plot", "actor", "scene"]


def seeded_llama(seed: int = 0, dtype=torch.float32, **config) -> LlamaForCausalLM:
    """A LlamaForCausalLM of `config`, initialised after torch.manual_seed(seed), in `dtype`."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).to(dtype)


def odd_llama(dtype=torch.float32, seed: int = 0, **over) -> LlamaForCausalLM:
    """The planner's LLaMA (ODD_LLAMA, `over` changed)."""
    return seeded_llama(seed, dtype, **{**ODD_LLAMA, **over})


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 32, layers: int = 2, dtype=torch.float32):
    """The tiny LLaMA (TINY_LLAMA), its MLP twice its width."""
    return seeded_llama(seed, dtype, **{**TINY_LLAMA, "vocab_size": vocab, "hidden_size": hidden,
                                        "intermediate_size": 2 * hidden, "num_hidden_layers": layers})


def tiny_bert(vocab: int, seed: int = 0, **over):
    """A 2-layer BertForSequenceClassification of width 32 and 3 labels (`over` changes its config), seeded."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(BertConfig(**{**config, **over}))


def save_tiny_bert(path) -> None:
    """A local model folder for the fine-tuning commands: a randomly initialised tiny BERT with the offline MiniLM's
    tokenizer."""
    from transformers import AutoTokenizer

    from slimopt.models.minilm import offline_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(offline_model_path()))
    tiny_bert(len(tokenizer), max_position_embeddings=64, num_labels=2).save_pretrained(path)
    tokenizer.save_pretrained(path)


def sentences(n: int, seed: int) -> list[str]:
    """`n` five-word sentences of WORDS, seeded: text for the fine-tuning data sets."""
    idx = torch.randint(0, len(WORDS), (n, 5), generator=torch.Generator().manual_seed(seed))
    return [" ".join(WORDS[i] for i in row) for row in idx.tolist()]


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


def random_params(shapes, dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    """A parameter of each shape: normal numbers from one generator seeded `seed`, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def random_grads(shapes, dtype, steps: int, seed: int = 1, scale: float | None = None) -> list[list[torch.Tensor]]:
    """`steps` steps of gradients, one of each shape a step: normal numbers from one generator seeded `seed`, times
    `scale` if given, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return [[(g if scale is None else g * scale).to(dtype) for g in step] for step in grads]


def fill_grads(params, seed: int, scale: float | None = None, dtype=None) -> None:
    """Give each parameter (of a list or a model) a gradient from one generator seeded `seed` (random_grads' numbers),
    in `dtype`, or the parameter's own when None."""
    params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    for p, g in zip(params, random_grads([p.shape for p in params], torch.float32, 1, seed, scale)[0]):
        p.grad = g.to(dtype or p.dtype)


def run_steps(params, opt, grads, lrs=None) -> None:
    """One optimizer step per entry of `grads` (a gradient for each parameter, copied in), every group's learning
    rate first set from the schedule `lrs` (cycled) when given."""
    for i, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        if lrs:
            for group in opt.param_groups:
                group["lr"] = lrs[i % len(lrs)]
        opt.step()


def seeded_steps(params, opt, first: int, last: int, lrs) -> None:
    """Optimizer steps first..last-1: step t's gradients drawn from seed 100 + t (0.1 N(0, 1), in each parameter's
    dtype), every group's learning rate set from `lrs` (cycled by t) first. A run split in two (first..k, then
    k..last) draws what one run draws."""
    for t in range(first, last):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)
        for group in opt.param_groups:
            group["lr"] = lrs[t % len(lrs)]
        opt.step()


def assert_same_state(sa: dict, sb: dict, what="", bitwise: bool = False, codes: float | None = None, **tol) -> None:
    """Two states of a weight (or any two dicts of tensors): the same keys, and under each the same dtype and shape
    and values that are

    - equal (torch.equal), the default; the same bytes with `bitwise` (-0.0 is not 0.0, a NaN equals itself);
    - within `tol` (torch.testing.assert_close's rtol and atol) as fp32 numbers; with `codes`, integer tensors
      (quantized codes) instead differ in at most that share of their entries.
    """
    assert sorted(sa) == sorted(sb), (what, sorted(set(sa) ^ set(sb)))
    for key in sa:
        x, y = sa[key], sb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, (what, key)
        if codes is not None and not x.is_floating_point():
            assert (x != y).float().mean().item() <= codes, (what, key)
        elif tol:
            torch.testing.assert_close(x.float(), y.float(), **tol, msg=f"{what} {key}")
        elif bitwise:
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (what, key)
        else:
            assert torch.equal(x, y), (what, key)


def assert_state_close(opt_a, opt_b, pa, pb) -> None:
    """Two optimizers' states of a weight as the fast paths are held to them: the same keys, dtypes and shapes,
    floats within 1e-6 relative, codes equal but for at most 1e-3 of them (another processor's torch may round a
    few moments the other way)."""
    assert_same_state(opt_a.state[pa], opt_b.state[pb], rtol=1e-6, atol=1e-12, codes=1e-3)


def assert_same_models(a, opt_a, b, opt_b) -> None:
    """Two models and their optimizers bit for bit: every parameter and every state tensor of it."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert_same_state(opt_a.state[p], opt_b.state[q], name)


def planned(model, method, step=None, **hp) -> int:
    """The memory planner's optimizer state bytes for `model` under `method` after `step` steps."""
    from slimopt.bench import planner

    return sum(s.total for s in planner.state_plan(model, method, step=step, **hp))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`slimopt argv` in this process: its exit status (argparse's too) and what it printed (out, err)."""
    from slimopt.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err
