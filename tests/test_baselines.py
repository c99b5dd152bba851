"""LoRA, ReLoRA and the low-rank factorisation on tiny randomly initialised transformers."""

import math

import pytest
import torch
from helpers import TINY_LLAMA, seeded_llama
from helpers import tiny_bert as seeded_bert
from transformers import LlamaConfig

from slimopt import baselines, catalog
from slimopt.baselines import (
    LLAMA_TARGETS,
    LowRankLinear,
    apply_lora,
    apply_low_rank,
    apply_relora,
    count_parameters,
    default_target_modules,
    relora_lr_lambda,
    relora_restart,
    relora_schedule,
)

H, I, LAYERS, VOCAB = 32, 64, 2, 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_llama(seed=0):
    return seeded_llama(seed, **{**TINY_LLAMA, "max_position_embeddings": 32}).eval()


def tiny_bert(num_labels=3, seed=0):
    return seeded_bert(VOCAB, seed, num_labels=num_labels, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0).eval()


def tokens(seed=1, batch=3, length=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def train_steps(model, optimizer, steps=3, seed=5):
    """A few real steps so the adapters' B is no longer zero (otherwise a merge is trivially exact)."""
    model.train()
    for s in range(steps):
        ids = tokens(seed + s)
        out = model(input_ids=ids, labels=ids) if isinstance(model.config, LlamaConfig) else model(
            input_ids=ids, labels=torch.tensor([0, 1, 2])
        )
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------------------------ counting


def test_count_parameters_counts_tied_weights_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model[0].weight.requires_grad_(False)
    assert count_parameters(model) == (0, 40)


def test_default_targets():
    assert default_target_modules(tiny_llama()) == LLAMA_TARGETS
    assert "query" in default_target_modules(tiny_bert())
    with pytest.raises(ValueError, match="pass target_modules"):
        default_target_modules(torch.nn.Sequential(torch.nn.Linear(3, 3)))


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_on_a_classifier_trains_adapters_and_head_only():
    model = apply_lora(tiny_bert(), rank=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or "classifier" in n for n in trainable)
    # per layer: q, k, v, attention output (H -> H) and the two MLP maps (H <-> I), r (in + out) each
    per_layer = 4 * 4 * (H + H) + 2 * 4 * (H + I)
    head = H * 3 + 3
    assert count_parameters(model).trainable == LAYERS * per_layer + head
    layer = model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert layer.scaling["default"] == 32 / 4  # alpha / r
    assert not any("pooler" in n for n in trainable)


def test_lora_merge_preserves_the_function():
    model = apply_lora(tiny_bert(), rank=4)
    train_steps(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    assert any(p.abs().sum() > 0 for n, p in lora_params(model).items() if "lora_B" in n)
    ids = tokens(9)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        after = merged(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def test_lora_bad_arguments():
    with pytest.raises(ValueError, match="rank must be a positive int"):
        apply_lora(tiny_bert(), rank=0)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        apply_lora(tiny_bert(), target_modules=["q_proj"])


# ------------------------------------------------------------------------------------------------ ReLoRA


def test_relora_trains_adapters_embeddings_norms_and_head():
    model = apply_relora(tiny_llama(), rank=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("embed_tokens" in n for n in trainable) and any("lm_head" in n for n in trainable)
    assert any(n.endswith("input_layernorm.weight") for n in trainable)
    assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    adapters = LAYERS * (4 * 4 * (H + H) + 3 * 4 * (H + I))  # rank 4; q, k, v, o: H x H; gate, up, down: H <-> I
    full = 2 * VOCAB * H + (2 * LAYERS + 1) * H
    assert count_parameters(model).trainable == adapters + full


def test_relora_restart_preserves_function_and_resets_only_adapter_state():
    model = apply_relora(tiny_llama(), rank=4)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    train_steps(model, optimizer)
    ids = tokens(11)
    names = {p: n for n, p in model.named_parameters()}
    snapshot = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    assert len(snapshot) == len(params)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    w_before = q.base_layer.weight.clone()
    expected_w = w_before + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A["default"].weight
    a_before = q.lora_A["default"].weight.clone()
    a_id = id(q.lora_A["default"].weight)
    with torch.no_grad():
        before = model(input_ids=ids).logits

    assert relora_restart(model, optimizer) == LAYERS * 7

    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.base_layer.weight, expected_w, atol=1e-6, rtol=0)
    assert id(q.lora_A["default"].weight) == a_id  # same Parameter: the optimizer still holds it
    assert not torch.equal(q.lora_A["default"].weight, a_before)
    assert torch.count_nonzero(q.lora_B["default"].weight) == 0
    for p in params:
        name = names[p]
        if "lora_" in name:
            assert p not in optimizer.state, name
        else:
            for k, v in snapshot[name].items():
                assert torch.equal(optimizer.state[p][k], v), (name, k)
    # training goes on: adapters get fresh state, step count starting again
    train_steps(model, optimizer, steps=1)
    assert optimizer.state[q.lora_A["default"].weight]["step"] == 1


def test_relora_partial_reset_prunes_by_magnitude():
    model = apply_relora(tiny_llama(), rank=4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_steps(model, optimizer)
    a = model.base_model.model.model.layers[1].mlp.up_proj.lora_A["default"].weight
    exp_avg = optimizer.state[a]["exp_avg"]
    kept_expected = exp_avg.abs().flatten().topk(int(round(exp_avg.numel() * 0.1))).values.min()
    relora_restart(model, optimizer, prune_ratio=0.9)
    state = optimizer.state[a]
    assert state["step"] == 3  # the step count survives a partial reset
    nonzero = torch.count_nonzero(state["exp_avg"]).item()
    assert nonzero == pytest.approx(0.1 * a.numel(), abs=1)
    assert state["exp_avg"].abs()[state["exp_avg"] != 0].min() >= kept_expected


def test_relora_seeded_restart_is_identical_across_replicas():
    replicas = [apply_relora(tiny_llama(), rank=4) for _ in range(2)]
    for global_seed, model in zip((1, 2), replicas):
        torch.manual_seed(global_seed)  # replicas whose global generators differ
        relora_restart(model, seed=7)
    a0, a1 = (dict(lora_params(m)) for m in replicas)
    assert all(torch.equal(a0[n], a1[n]) for n in a0)


def test_relora_restart_needs_lora():
    with pytest.raises(ValueError, match="no LoRA layers"):
        relora_restart(tiny_llama())
    with pytest.raises(ValueError, match="prune_ratio"):
        relora_restart(apply_relora(tiny_llama(), rank=2), prune_ratio=0.0)


def test_relora_schedule_by_hand():
    kw = dict(total_steps=1000, warmup_steps=100, restart_every=300, restart_warmup_steps=50, min_lr_ratio=0.1)

    def cosine(s):
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 100) / 900))

    assert relora_lr_lambda(0, **kw) == 0.0
    assert relora_lr_lambda(50, **kw) == 0.5
    assert relora_lr_lambda(200, **kw) == pytest.approx(cosine(200))
    assert relora_lr_lambda(300, **kw) == 0.0  # the restart step starts from zero
    assert relora_lr_lambda(325, **kw) == pytest.approx(0.5 * cosine(350))
    assert relora_lr_lambda(350, **kw) == pytest.approx(cosine(350))  # continuous where the re-warmup ends
    assert relora_lr_lambda(1000, **kw) == pytest.approx(0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = relora_schedule(opt, **{k: v for k, v in kw.items()})
    for _ in range(50):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="restart_warmup_steps < restart_every"):
        relora_schedule(opt, 1000, 100, restart_every=50, restart_warmup_steps=50)


# ------------------------------------------------------------------------------------------------ low rank


def test_low_rank_parameter_count():
    model = tiny_llama()
    before = count_parameters(model).total
    apply_low_rank(model, rank=8, init="random", seed=0)
    per_layer_dense = 4 * H * H + 3 * H * I
    per_layer_low = 4 * 8 * (H + H) + 3 * 8 * (H + I)
    assert count_parameters(model).total == before - LAYERS * (per_layer_dense - per_layer_low)
    lows = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    assert len(lows) == LAYERS * 7 and all(m.rank == 8 for m in lows)
    assert isinstance(model.lm_head, torch.nn.Linear)  # lm_head and embeddings keep their full weights
    # it trains: the loss has gradients for both factors
    ids = tokens(3)
    model(input_ids=ids, labels=ids).loss.backward()
    assert lows[0].down.weight.grad is not None and lows[0].up.weight.grad is not None


def test_low_rank_svd_at_full_rank_reproduces_the_model():
    model = tiny_llama()
    ids = tokens(4)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_low_rank(model, rank=H)  # min(in, out) = H for every attention and MLP map
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_low_rank_svd_is_the_best_rank_r_approximation():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 16, bias=True)
    low = LowRankLinear(24, 16, rank=4, bias=True)
    low.init_svd(linear.weight)
    product = low.up.weight @ low.down.weight  # (out, in)
    s = torch.linalg.svdvals(linear.weight)
    # Eckart-Young: the Frobenius error of the best rank-4 approximation is the norm of the dropped values
    error = torch.linalg.matrix_norm(linear.weight - product).item()
    assert error == pytest.approx(s[4:].norm().item(), rel=1e-5)


def test_low_rank_random_init_matches_the_requested_std():
    low = LowRankLinear(512, 512, rank=64)
    low.init_random(0.02, torch.Generator().manual_seed(0))
    product = low.up.weight @ low.down.weight
    assert product.std().item() == pytest.approx(0.02, rel=0.05)


def test_low_rank_bad_arguments():
    with pytest.raises(ValueError, match="exceeds min"):
        apply_low_rank(tiny_llama(), rank=H + 1)
    with pytest.raises(ValueError, match="init must be"):
        apply_low_rank(tiny_llama(), rank=4, init="zeros")
    with pytest.raises(ValueError, match="match no nn.Linear"):
        apply_low_rank(tiny_llama(), rank=4, target_modules=["query"])


def test_relora_restart_with_slimopt_galore_state():
    """Works with the project's own optimizer: its per-parameter state (moments, projection) is dropped and
    rebuilt lazily at the next step."""
    slimopt = pytest.importorskip("slimopt")
    if not hasattr(slimopt, "build"):
        pytest.skip("the optimizer core is not importable")
    model = apply_relora(tiny_llama(), rank=4)
    optimizer = slimopt.build(model, "galore", rank=2, lr=1e-3)
    train_steps(model, optimizer, steps=2)
    a = model.base_model.model.model.layers[0].self_attn.v_proj.lora_A["default"].weight
    others = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items() if p is not a}
    assert a in optimizer.state
    ids = tokens(2)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    relora_restart(model, optimizer)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-6, rtol=0)
    assert a not in optimizer.state
    kept = [p for p in others if p in optimizer.state]
    assert kept and all(torch.equal(optimizer.state[p][k], others[p][k]) for p in kept for k in others[p])
    train_steps(model, optimizer, steps=1)
    assert a in optimizer.state


# ------------------------------------------------------------------------------------------------ loop adaptor


def test_loop_adaptor_methods_and_errors():
    assert set(catalog.of_kind("baseline")) == {"lowrank", "lora", "relora", "frozen"}
    assert catalog.default_lr("relora") == 1e-3
    with pytest.raises(ValueError, match="unknown baseline 'dora'"):
        baselines.prepare(tiny_llama(), "dora")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['restart_every'\] for lora"):
        baselines.prepare(tiny_llama(), "lora", restart_every=10)
    with pytest.raises(ValueError, match="takes no hyperparameters"):
        baselines.build_optimizer(tiny_llama(), "lora", lr=1e-3, rank=4)


def test_loop_adaptor_lowrank_exports_a_plain_model():
    model, hook = baselines.prepare(tiny_llama(), "lowrank", seed=0)
    lows = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    assert len(lows) == LAYERS * 7 and lows[0].rank == H // 4  # default rank: hidden / 4
    ids = tokens(6)
    exported = hook.export(model)
    assert not any(isinstance(m, LowRankLinear) for m in exported.modules())
    assert any(isinstance(m, LowRankLinear) for m in model.modules())  # the trained model is left alone
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_loop_adaptor_relora_restarts_rewarms_and_resumes():
    model, hook = baselines.prepare(tiny_llama(), "relora", seed=3, rank=4, restart_every=3, restart_warmup=2)
    optimizer = baselines.build_optimizer(model, "relora", lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # the loop uses a LambdaLR too
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    lrs, ids = [], tokens(8)
    for step in range(1, 7):
        lrs.append(optimizer.param_groups[0]["lr"])
        train_steps(model, optimizer, steps=1, seed=step)
        scheduler.step()
        if step == 3:
            with torch.no_grad():
                before = model(input_ids=ids).logits
        hook.after_step(step, optimizer)
        if step == 3:
            assert hook.restarts == 1 and a not in optimizer.state
            with torch.no_grad():
                torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-6, rtol=0)
    # restart after step 3 -> steps 4 and 5 re-warm (1/3, 2/3 of the lr), step 6 at full lr, then a restart
    assert lrs == pytest.approx([1e-2, 1e-2, 1e-2, 1e-2 / 3, 2e-2 / 3, 1e-2])
    assert hook.state_dict() == {"restarts": 2, "last_restart": 6}
    resumed = baselines.BaselineHook("relora", model, seed=3, restart_every=3, restart_warmup=2)
    resumed.load_state_dict(hook.state_dict())
    assert resumed.state_dict() == hook.state_dict()
    exported = hook.export(model)
    assert type(exported).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
