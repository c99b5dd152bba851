"""slimopt in transformers.Trainer: exact resume from a Trainer checkpoint, the optim_target_modules selection the
Trainer's GaLore makes, optim_args parsing, weight-decay groups, and bad input."""

import shutil

import pytest
import torch
from helpers import tiny_bert as seeded_bert
from helpers import tiny_llama
from transformers import Trainer, TrainerCallback, TrainingArguments

from slimopt.finetune import hf
from slimopt.optim.recipes import METHODS

VOCAB, SEQ, N = 128, 12, 48


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_bert(seed=0):
    # intermediate 128 x hidden 32 = 4096 elements: the MLP weights are large enough for the 8-bit codec.
    return seeded_bert(VOCAB, seed, intermediate_size=128)


@pytest.fixture(scope="module")
def dataset():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (N, SEQ), generator=gen)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 0] % 3).tolist()})


def training_args(out, **kw):
    # Accumulation, clipping, warmup + linear decay and weight decay on: they must all work unchanged.
    base = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                weight_decay=0.01, warmup_steps=1, max_grad_norm=0.5, save_strategy="steps", save_steps=2,
                report_to="none", use_cpu=True, logging_steps=1000, disable_tqdm=True, seed=0)
    base.update(kw)
    return TrainingArguments(str(out), **base)


# Subspace refreshes (update_gap 2) and block switches fall after the checkpoint at step 2, so the resumed run
# must have restored projection bases, active blocks and moments to match.
RESUME_CASES = [
    ("galore", {"rank": 4, "update_gap": 2, "scale": 2.0}),
    ("frugal", {"density": 0.5, "update_gap": 2}),
    ("adamw8bit", {}),
    ("taco", {}),
]


def _pair(model, method, hp):
    return hf.optimizer_cls_and_kwargs(model, method, lr=1e-3, weight_decay=0.01, **hp)


@pytest.mark.parametrize("method,hp", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_trainer_resume_continues_identically(tmp_path, dataset, method, hp):
    if method not in METHODS:
        pytest.skip(f"method {method!r} is not in slimopt.optim.recipes.METHODS yet")
    full = tiny_bert()
    trainer = Trainer(model=full, args=training_args(tmp_path / "a"), train_dataset=dataset,
                      optimizer_cls_and_kwargs=_pair(full, method, hp))
    trainer.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").is_file()
    # The checkpoint loads under weights_only=True (what the Trainer does) and holds tensors only.
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert all(torch.is_tensor(v) for s in saved["state"].values() for v in s.values())

    resumed = tiny_bert()
    trainer2 = Trainer(model=resumed, args=training_args(tmp_path / "b"), train_dataset=dataset,
                       optimizer_cls_and_kwargs=_pair(resumed, method, hp))
    trainer2.train(resume_from_checkpoint=str(checkpoint))

    assert trainer2.state.global_step == trainer.state.global_step == 4
    start = tiny_bert()
    moved = max((p - q).abs().max().item() for p, q in zip(full.parameters(), start.parameters()))
    assert moved > 1e-4  # it trained
    for (name, p), (_, q) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), f"{method}: {name} differs after resume"
    # Codec dtypes survive the Trainer's load (uint8 codes stay uint8).
    dtypes = {v.dtype for s in trainer2.optimizer.state.values() for v in s.values()}
    expected = {v.dtype for s in trainer.optimizer.state.values() for v in s.values()}
    assert dtypes == expected
    if method == "adamw8bit":
        assert torch.uint8 in dtypes
    shutil.rmtree(tmp_path)


def test_make_optimizer_equals_optimizer_cls_and_kwargs(tmp_path, dataset):
    """optimizers=(make_optimizer(args), None) and optimizer_cls_and_kwargs train the same model identically, in
    bf16 autocast; make_optimizer reads lr, weight decay, betas and eps from the TrainingArguments."""
    args = training_args(tmp_path / "a", save_strategy="no", bf16=True, adam_beta1=0.8, adam_beta2=0.99,
                         adam_epsilon=1e-7)
    a = tiny_bert()
    opt = hf.make_optimizer(a, args, "galore", optim_args="rank=4,update_proj_gap=2,scale=2")
    group = next(g for g in opt.param_groups if g["name"] == "projectable")
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (1e-3, 0.01, (0.8, 0.99), 1e-7)
    assert (group["rank"], group["update_gap"], group["scale"]) == (4, 2, 2)
    Trainer(model=a, args=args, train_dataset=dataset, optimizers=(opt, None)).train()

    b = tiny_bert()
    pair = hf.optimizer_cls_and_kwargs(b, "galore", lr=1e-3, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-7,
                                       rank=4, update_gap=2, scale=2)
    Trainer(model=b, args=training_args(tmp_path / "b", save_strategy="no", bf16=True), train_dataset=dataset,
            optimizer_cls_and_kwargs=pair).train()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.classifier.weight, tiny_bert().classifier.weight)


def test_make_optimizer_reads_optim_fields_of_training_arguments(tmp_path):
    args = TrainingArguments(str(tmp_path), optim_target_modules=["query", "value"], report_to="none",
                             optim_args="rank=4,update_proj_gap=7,proj_type=right", use_cpu=True)
    opt = hf.make_optimizer(tiny_bert(), args, "galore")
    (group,) = [g for g in opt.param_groups if g["name"] == "projectable"]
    assert sorted(n.split(".")[-2] for n in group["names"]) == ["query"] * 2 + ["value"] * 2
    assert (group["rank"], group["update_gap"], group["proj_side"]) == (4, 7, "right")
    assert group["lr"] == args.learning_rate
    # Explicit arguments win over the TrainingArguments fields.
    opt = hf.make_optimizer(tiny_bert(), args, "galore", optim_target_modules=None, optim_args="rank=2")
    (group,) = [g for g in opt.param_groups if g["name"] == "projectable"]
    assert len(group["names"]) == 12 and group["rank"] == 2 and group["update_gap"] == 200


def test_consumed_pair_is_refused(tmp_path, dataset):
    model = tiny_bert()
    pair = hf.optimizer_cls_and_kwargs(model, "galore", rank=4)
    Trainer(model=model, args=training_args(tmp_path, max_steps=1, save_strategy="no"), train_dataset=dataset,
            optimizer_cls_and_kwargs=pair).create_optimizer()
    assert "params" not in pair[1]  # the Trainer popped it
    again = Trainer(model=model, args=training_args(tmp_path, max_steps=1, save_strategy="no"),
                    train_dataset=dataset, optimizer_cls_and_kwargs=pair)
    with pytest.raises(ValueError, match="already consumed"):
        again.create_optimizer()


# ---------------------------------------------------------------------------------------------- selection


def _trainer_galore_targets(model, target, tmp_path):
    """The parameters transformers' own GaLore integration projects (needs galore-torch to build its args)."""
    pytest.importorskip("galore_torch")
    args = TrainingArguments(str(tmp_path), optim="galore_adamw", optim_target_modules=target, report_to="none",
                             use_cpu=True)
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    projected = [g for g in kwargs["params"] if "rank" in g]
    assert len(projected) == 1
    return {id(p) for p in projected[0]["params"]}


def _slimopt_targets(model, target):
    groups = hf.optimizer_cls_and_kwargs(model, "galore", optim_target_modules=target, rank=4)[1]["params"]
    projectable = [g for g in groups if g["name"].startswith("projectable")]
    assert len(projectable) == 1
    return {id(p) for p in projectable[0]["params"]}


BERT_TARGETS = [
    ["attention", "intermediate"],  # substrings
    ["query", "value"],
    ["output.dense"],  # attention output and MLP output, not the classifier
    "all-linear",  # every nn.Linear, pooler and classifier included
    r".*\.(query|key)",  # one regex, full match
    [r".*layer\.1\..*", "intermediate"],  # regex and substring entries mixed
    ["bert.encoder.layer.0.attention.self.query"],  # an exact name
]


@pytest.mark.parametrize("target", BERT_TARGETS, ids=[str(t) for t in BERT_TARGETS])
def test_target_modules_match_trainer_galore_bert(tmp_path, target):
    model = tiny_bert()
    assert _slimopt_targets(model, target) == _trainer_galore_targets(model, target, tmp_path)


@pytest.mark.parametrize("target", [["attn", "mlp"], "all-linear", ["q_proj", "v_proj"]], ids=str)
def test_target_modules_match_trainer_galore_llama(tmp_path, target):
    model = tiny_llama()
    assert _slimopt_targets(model, target) == _trainer_galore_targets(model, target, tmp_path)


def test_default_selection_is_slimopt_policy():
    """Without optim_target_modules: every Linear weight outside the head (BERT: 6 per layer), pooler and
    classifier in AdamW."""
    model = tiny_bert()
    groups = hf.optimizer_cls_and_kwargs(model, "galore", rank=4)[1]["params"]
    names = {g["name"]: g["names"] for g in groups}
    assert len(names["projectable"]) == 12
    assert all(n.endswith("weight") and ".encoder." in n for n in names["projectable"])
    assert {"classifier.weight", "bert.pooler.dense.weight"} <= set(names["head"])


def test_weight_decay_groups_follow_trainer():
    model = tiny_bert()
    groups = hf.optimizer_cls_and_kwargs(model, "frugal", weight_decay=0.1)[1]["params"]
    decay = set(Trainer.get_decay_parameter_names(None, model))
    for g in groups:
        for n in g["names"]:
            assert g["weight_decay"] == (0.1 if n in decay else 0.0), n
    # every trainable parameter exactly once
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert any(n.endswith("LayerNorm.weight") for g in groups if g["weight_decay"] == 0.0 for n in g["names"])
    # no decay: no extra groups
    plain = hf.optimizer_cls_and_kwargs(model, "frugal")[1]["params"]
    assert not any(g["name"].endswith(":no_decay") for g in plain)


def test_lora_model_adapter_params_only(tmp_path, dataset):
    """LoRA + an 8-bit slimopt state on the adapters (QLoRA-style): only adapters and the head train."""
    from slimopt.baselines import apply_lora

    model = apply_lora(tiny_bert(), rank=4, alpha=16)
    opt = hf.make_optimizer(model, training_args(tmp_path, save_strategy="no"), "adamw8bit")
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert owned == trainable and len(trainable) < len(list(model.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model=model, args=training_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=dataset,
            optimizers=(opt, None)).train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert not changed & frozen
    assert any("lora_B" in n for n in changed) and any("classifier" in n for n in changed)


# ---------------------------------------------------------------------------------------------- optim_args


def test_parse_optim_args_types_and_aliases():
    parsed = hf.parse_optim_args("rank=8, update_proj_gap=100,scale=2.5,proj_type=reverse_std,projector=svd,"
                                 "compile=false,codec=auto,state_full=head,density=0.25,free_rule=none")
    assert parsed == {"rank": 8, "update_gap": 100, "scale": 2.5, "proj_side": "reverse_std", "projector": "svd",
                      "compile": False, "codec": "auto", "state_full": "head", "density": 0.25, "free_rule": "none"}
    assert isinstance(parsed["rank"], int) and isinstance(parsed["scale"], float)
    assert hf.parse_optim_args("taco_norm=m/n,taco_alpha=1e-1") == {"taco_norm": "m/n", "taco_alpha": 0.1}
    assert hf.parse_optim_args(None) == {} and hf.parse_optim_args("") == {}


@pytest.mark.parametrize("text,match", [
    ("rank=8,ranks=4", "unknown key 'ranks'"),
    ("rank", "expected key=value"),
    ("rank=", "expected key=value"),
    ("lr=1e-3", "learning_rate"),
    ("betas=(0.9,0.95)", "adam_beta1"),
    ("rank=8,rank=4", "given twice"),
    ("update_gap=3,update_proj_gap=4", "given twice"),
])
def test_parse_optim_args_errors(text, match):
    with pytest.raises(ValueError, match=match):
        hf.parse_optim_args(text)


def test_bad_input():
    model = tiny_bert()
    with pytest.raises(ValueError, match="unknown method 'galor'"):
        hf.optimizer_cls_and_kwargs(model, "galor")
    with pytest.raises(ValueError, match="unknown method"):
        hf.make_optimizer(model, None, "galor")
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        hf.optimizer_cls_and_kwargs(model, "galore", optim_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="optim_target_modules must be"):
        hf.optimizer_cls_and_kwargs(model, "galore", optim_target_modules=3)
    with pytest.raises(ValueError, match="selects only output layers"):
        hf.optimizer_cls_and_kwargs(model, "galore", optim_target_modules=["classifier"])
    with pytest.raises(ValueError, match="both in optim_args and as keyword"):
        hf.make_optimizer(model, None, "galore", optim_args="rank=4", rank=8)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        hf.make_optimizer(model, None, "galore", optim_args="rank=4.5")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        hf.optimizer_cls_and_kwargs(model, "galore", rnak=4)


def _int8_trainer(out, dataset, **kw):
    """A tiny BERT with int8 body weights and host masters, in a Trainer whose schedule, accumulation and
    clipping are on (training_args)."""
    model = tiny_bert()
    args = training_args(out, **kw)
    opt = hf.make_optimizer(model, args, "adamw8bit", weights="int8", offload="host")
    return model, opt, Trainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, None))


def test_trainer_trains_int8_weights_with_host_masters(tmp_path, dataset):
    from slimopt.weights.int8_linear import Int8Linear

    model, opt, trainer = _int8_trainer(tmp_path, dataset, max_steps=12, learning_rate=3e-3, save_strategy="no",
                                        logging_steps=1, warmup_steps=2)
    trainer.callback_handler.callbacks.insert(0, opt.grad_norm_callback())
    seen = []  # what a reporter after it receives
    trainer.add_callback(type("Seen", (TrainerCallback,), {"on_log": lambda self, a, s, c, logs=None, **k:
                                                           seen.append(logs.get("grad_norm"))})())
    # attention and MLP weights int8; the head, and the pooler it reads, in their dtype
    assert sum(isinstance(m, Int8Linear) for m in model.bert.encoder.modules()) == 6 * 2  # 2 layers
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == ["bert.pooler.dense",
                                                                                  "classifier"]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logs]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses  # the loss falls
    assert opt.masters.steps == 12  # one update per optimizer step of the Trainer (2 micro-batches each)
    # the Trainer's own scheduler drives the lr: warmup then linear decay, handed to the host optimizer's groups
    assert [h["learning_rate"] for h in logs[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert opt.masters.optimizer.param_groups[0]["lr"] == pytest.approx(logs[-1]["learning_rate"])
    assert opt.masters.last_grad_norm is not None  # clipped by args.max_grad_norm inside the backward pass
    # the masters' norm, not the 0 of the model's empty gradients, in the log and to every later callback
    norms = [h["grad_norm"] for h in logs]
    assert all(n > 0 for n in norms) and norms[-1] == opt.masters.last_grad_norm
    assert [n for n in seen if n is not None] == norms  # (the run's summary log has no grad_norm)


def test_trainer_resumes_int8_weights_with_host_masters_exactly(tmp_path, dataset):
    whole_model, whole_opt, whole = _int8_trainer(tmp_path / "a", dataset)
    whole.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)  # what the Trainer loads
    assert set(saved) == {"masters", "optimizer", "counters"}
    model, opt, trainer = _int8_trainer(tmp_path / "b", dataset)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == whole.state.global_step == 4
    assert opt.masters.steps == whole_opt.masters.steps == 4
    for name, master in whole_opt.masters.masters.items():
        assert torch.equal(master, opt.masters.masters[name]), name
    for (name, p), (_, q) in zip(whole_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(p, q), name
