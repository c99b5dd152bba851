"""build(): the partition, recipes' defaults, overrides, frozen and tied parameters, methods()."""

import torch
from helpers import backward, batches, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

import slimopt
from slimopt.optim.algorithm.partition import classify, module_matches


def _groups(opt):
    return {g["name"]: g for g in opt.param_groups}


def test_llama_partition():
    model = tiny_llama()
    kinds = {n: k for n, (_, k) in classify(model).items()}
    assert kinds["model.embed_tokens.weight"] == "embedding"
    assert kinds["lm_head.weight"] == "head"
    assert kinds["model.norm.weight"] == "other"
    assert kinds["model.layers.1.input_layernorm.weight"] == "other"
    for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert kinds[f"model.layers.0.{proj}.weight"] == "projectable"
    assert sum(k == "projectable" for k in kinds.values()) == 14


def test_recipes_apply_papers_defaults():
    g = _groups(slimopt.build(tiny_llama(), "galore"))
    assert (g["projectable"]["projector"], g["projectable"]["rank"], g["projectable"]["scale"],
            g["projectable"]["update_gap"], g["projectable"]["lr"]) == ("svd", 128, 0.25, 200, 0.01)
    assert g["embedding"]["projector"] == "none" and g["head"]["lr"] == 0.01
    g = _groups(slimopt.build(tiny_llama(), "frugal"))
    assert (g["projectable"]["projector"], g["projectable"]["density"], g["projectable"]["free_rule"],
            g["projectable"]["on_refresh"]) == ("block", 0.25, "sign", "reset")
    g = _groups(slimopt.build(tiny_llama(), "frugal", projector="columns", rank=4))
    assert g["projectable"]["rank"] == 4 and g["projectable"]["density"] is None
    assert slimopt.default_lr("frugal") == 1e-3 and slimopt.default_lr("galore") == 1e-2


def test_state_full_head_moves_embeddings_and_norms_to_signsgd():
    g = _groups(slimopt.build(tiny_llama(), "frugal_rho0", state_full="head"))
    assert g["head"]["projector"] == "none"
    for name in ("embedding", "other", "projectable"):
        assert g[name]["free_rule"] == "sign" and g[name]["density"] == 0.0


def test_overrides_and_target_modules():
    model = tiny_llama()
    opt = slimopt.build(model, "galore", rank=2, overrides={r"mlp\.down_proj": {"projector": "none"}})
    g = _groups(opt)
    down = g[r"projectable:mlp\.down_proj"]
    assert down["projector"] == "none" and len(down["params"]) == 2
    assert len(g["projectable"]["params"]) == 12
    opt = slimopt.build(model, "galore", rank=2, target_modules=["q_proj", "v_proj"])
    assert sorted(n.split(".")[-2] for n in _groups(opt)["projectable"]["names"]) == ["q_proj"] * 2 + ["v_proj"] * 2
    assert module_matches("model.layers.0.self_attn.q_proj", r".*attn.*")
    assert not module_matches("model.layers.0.mlp.up_proj", ["q_proj"])


def test_frozen_parameters_are_left_out_and_tied_weights_counted_once():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.model.layers[0].mlp.requires_grad_(False)
    opt = slimopt.build(model, "galore", rank=2)
    owned = [p for g in opt.param_groups for p in g["params"]]
    assert len(owned) == len({id(p) for p in owned}) == sum(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in owned)
    assert _groups(opt)["head"]["names"] == ["model.embed_tokens.weight"]  # the tied output layer is the head
    backward(model, batches(1)[0])
    opt.step()


def test_one_catalogue_names_every_method_once():
    """slimopt.catalog is the one table of names, descriptions and default rates; the tables of how each kind is
    built (the recipes' settings, the baselines' options, the peers' packages) hold exactly its names, in its order."""
    from slimopt import baselines, catalog, peers
    from slimopt.optim.algorithm.specs import METHODS

    assert list(METHODS) == list(catalog.of_kind("slimopt")) == list(slimopt.methods())
    assert set(baselines._OPTIONS) == set(catalog.of_kind("baseline"))
    assert list(peers.PEERS) == list(catalog.of_kind("peer"))
    assert {e.kind for e in catalog.CATALOG.values()} == set(catalog.KINDS)
    assert slimopt.default_lr("taco") == catalog.TACO_LR == slimopt.TACO([torch.nn.Parameter(torch.ones(2))]
                                                                            ).defaults["lr"]


def test_methods_table_and_every_method_trains():
    table = slimopt.methods()
    for name in ("adamw", "galore", "frugal", "frugal_rho0", "badam", "signsgd"):
        assert name in table and table[name]
    for name in table:
        model = tiny_llama()
        opt = slimopt.build(model, name, rank=4, update_gap=5) if name.startswith("galore") else \
            slimopt.build(model, name)
        data = batches(1) * 12
        losses = []
        for ids in data:
            losses.append(backward(model, ids))
            opt.step()
        assert losses[-1] < losses[0] - 0.05, (name, losses[0], losses[-1])
