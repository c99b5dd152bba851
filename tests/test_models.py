"""LLaMA model sizes, analytic parameter counts and model building, offline."""

import math

import pytest
import torch
import transformers

from slimopt.models import hub
from slimopt.models import llama as M

# Analytic counts at vocab 32000, untied embeddings (GaLore's / FRUGAL's nominal sizes in the comments).
EXPECTED = {
    "60m": 58_073_600,       # "60M"
    "130m": 134_105_856,     # "130M"
    "350m": 367_969_280,     # "350M"
    "1b": 1_339_082_752,     # "1B"
    "7b": 6_738_415_616,     # "7B": LLaMA-7B's 6.74B
}


def by_hand(h, inter, layers, vocab):
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h


def test_named_sizes_match_the_papers():
    for name, n in EXPECTED.items():
        cfg = M.llama_config(name)
        s = M.LLAMA_SIZES[name]
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (
            s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_hidden_layers"])
        assert cfg.vocab_size == 32000 and not cfg.tie_word_embeddings
        assert M.llama_param_count(cfg) == n == by_hand(cfg.hidden_size, cfg.intermediate_size,
                                                         cfg.num_hidden_layers, 32000)
    assert M.LLAMA_SIZES["60m"] == dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                                        num_hidden_layers=8)
    assert M.LLAMA_SIZES["1b"]["intermediate_size"] == 5461 and M.LLAMA_SIZES["7b"]["hidden_size"] == 4096
    assert 55e6 < EXPECTED["60m"] < 62e6 and 6.5e9 < EXPECTED["7b"] < 7e9


def test_cpu_sizes_are_small():
    assert 1.0e6 < M.llama_param_count(M.llama_config("tiny", vocab_size=4096)) < 3e6
    assert 5e6 < M.llama_param_count(M.llama_config("small", vocab_size=8192)) < 10e6
    assert 18e6 < M.llama_param_count(M.llama_config("small")) < 22e6  # at vocab 32000


@pytest.mark.parametrize("name,vocab", [("tiny", 4096), ("small", 8192), ("60m", None)])
def test_analytic_count_equals_built_model(name, vocab):
    model = M.build_model(name, vocab, seq_len=128)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert M.count_params(model) == M.llama_param_count(model.config)
    assert model.config.vocab_size == (vocab or 32000) and model.config.max_position_embeddings == 128
    assert model.training


def test_analytic_count_handles_gqa_bias_and_tied_embeddings():
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=96, intermediate_size=200, num_attention_heads=6,
                                   num_key_value_heads=2, num_hidden_layers=3, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=True, head_dim=24)
    model = transformers.LlamaForCausalLM(cfg)
    assert M.count_params(model) == M.llama_param_count(cfg)


def test_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = M.build_model("tiny", 512, 64, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = M.build_model("tiny", 512, 64, seed=7)
    c = M.build_model("tiny", 512, 64, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    std = sa["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.002  # initializer_range


def test_dtype_and_initial_loss():
    model = M.build_model("tiny", 1024, 32, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model = M.build_model("tiny", 1024, 32)
    batch = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.item()
    assert abs(loss - math.log(1024)) < 0.1  # a freshly initialised LM is near uniform


def test_local_directory_config_or_weights(tmp_path):
    src = M.build_model("tiny", 300, 64, seed=3)
    cfg_dir = tmp_path / "cfg"
    src.config.save_pretrained(cfg_dir)
    fresh = M.build_model(str(cfg_dir), None, 64, seed=3)
    assert M.count_params(fresh) == M.count_params(src)
    assert all(torch.equal(x, y) for x, y in zip(fresh.parameters(), src.parameters()))  # same seed, same init
    wider = M.build_model(str(cfg_dir), 400, 64)
    assert wider.config.vocab_size == 400

    with torch.no_grad():
        src.model.norm.weight.fill_(1.5)  # something an init never produces
    w_dir = tmp_path / "weights"
    src.save_pretrained(w_dir)
    loaded = M.build_model(str(w_dir), 300, 64, seed=99)
    assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), src.state_dict().values()))
    assert loaded.training


def test_bad_names_raise_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tiny, small, 60m, 130m, 350m, 1b, 7b"):
        M.llama_config("70b")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        M.build_model("./nowhere/model", None, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        M.build_model(str(tmp_path / "empty"), None, 64)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_offline.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"'llama-70m'.*built-in size.*tiny, small, 60m"):
            M.build_model("llama-70m", None, 64)
    finally:
        hub.hub_offline.cache_clear()
    with pytest.raises(ValueError, match="seq_len"):
        M.build_model("tiny", 100, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        M.llama_config("tiny", vocab_size=0)
