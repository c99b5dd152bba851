"""A setting is applied where it is accepted: build() spreads compile over every group, a method whose groups never
read a setting refuses it (naming it and why), and projector=none turns GaLore's projection off."""

import pytest
from helpers import backward, batches, tiny_llama

import slimopt
from slimopt.factory import make_optimizer
from slimopt.optim.routes.torch import compiled


@pytest.mark.parametrize("method,setting,why", [
    ("adamw", {"rank": 4}, "the projector is 'none'"),
    ("adamw", {"momentum": 0.5}, "only rules 'sgdm', 'muon', 'nesterov' read it"),
    ("adamw", {"rule": "nesterov", "betas": (0.9, 0.99)}, "rule 'nesterov' uses momentum, not betas"),
    ("adamw", {"ns_steps": 3}, "only rule 'muon' reads it"),
    ("adamw", {"taco_k": 2}, "only rule 'taco' reads it"),
    ("frugal", {"scale": 2.0}, "the projector is 'block'"),
    ("galore", {"oversample": 4}, "tunes the randomized_svd projector"),
    ("frugal", {"proj_dtype": "grad"}, "the projector is 'block'"),
    ("galore", {"projector": "none", "rank": 8}, "the projector is 'none'"),
    ("badam", {"free_scale": 0.5}, "there is none"),
    ("galore", {"compile": True, "rule": "lion"}, "full-space AdamW only"),
])
def test_a_setting_no_group_reads_is_an_error(method, setting, why):
    key = next(k for k in setting if k not in ("projector", "rule"))
    with pytest.raises(ValueError, match=f"{key}=.* has no effect with method '{method}'.*{why}"):
        slimopt.build(tiny_llama(), method, **setting)


@pytest.mark.parametrize("method,setting", [
    ("galore", {"compile": True}),           # read by the full-space groups (embeddings, norms, head)
    ("galore", {"compile": False}),          # restating a default changes nothing either way
    ("galore_rsvd", {"oversample": 4}),
    ("galore", {"proj_dtype": "fp32"}),
    ("taco", {"taco_k": 2}),
    ("frugal", {"rank": 2}),
    ("adamw", {"rule": "sgdm", "momentum": 0.5}),
    ("muon", {"momentum": 0.9, "ns_steps": 3}),
    ("frugal_muon", {"adjust_lr_fn": "original"}),
])
def test_settings_that_are_read_are_accepted(method, setting):
    slimopt.build(tiny_llama(), method, **setting)


def test_overrides_are_checked_too():
    with pytest.raises(ValueError, match="override 'lm_head'"):
        slimopt.build(tiny_llama(), "adamw", overrides={"lm_head": {"rank": 2}})


def test_projector_none_turns_galore_into_adamw():
    """--opt projector=none used to arrive as Python None and be dropped: the run kept the SVD projector."""
    model = tiny_llama()
    opt = make_optimizer(model, "galore", projector="none")  # no automatic rank for a projector that is off
    assert {g["projector"] for g in opt.param_groups} == {"none"}
    backward(model, batches(1)[0])
    opt.step()
    assert not any(k in s for s in opt.state.values() for k in ("proj", "proj_index"))


def test_compile_reaches_every_full_space_group(monkeypatch):
    """`--set adamw.compile=true` compiled only the Linear weights; embeddings and head (over half of a small
    model) stayed eager, so the bench saw no change."""
    model = tiny_llama()
    opt = slimopt.build(model, "adamw", compile=True)
    calls = []
    monkeypatch.setattr(compiled, "adamw_step", lambda p, *a, **k: calls.append(p))
    backward(model, batches(1)[0])
    opt.step()
    assert len(calls) == sum(1 for p in model.parameters() if p.requires_grad)
    assert all(g["compile"] for g in opt.param_groups)
