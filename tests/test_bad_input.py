"""Invalid settings raise ValueError naming the setting and what is allowed; bad gradients raise."""

import pytest
import torch

import slimopt


def _w():
    return torch.nn.Parameter(torch.randn(8, 8))


@pytest.mark.parametrize("settings, match", [
    (dict(projector="svd", rank=0), "rank must be a positive integer"),
    (dict(projector="svd", rank=2.5), "rank must be a positive integer"),
    (dict(projector="svd", density=1.5), r"density must be a number in \[0, 1\]"),
    (dict(projector="svd", density=-0.1), r"density must be a number in \[0, 1\]"),
    (dict(projector="svd", rank=2, density=0.5), "either rank or density"),
    (dict(projector="svd"), "needs a subspace size"),
    (dict(projector="svd", rank=2, update_gap=0), "update_gap must be an integer >= 1"),
    (dict(projector="pca", rank=2), "projector must be one of"),
    (dict(rule="adam"), "rule must be one of"),
    (dict(free_rule="signum"), "free_rule must be one of"),
    (dict(on_refresh="rotate"), "on_refresh must be one of"),
    (dict(proj_side="top"), "proj_side must be one of"),
    (dict(proj_dtype="bf16"), "proj_dtype must be one of fp32, grad, auto; got 'bf16'"),
    (dict(eps_placement="before_bias"), "eps_placement must be one of torch, galore; got 'before_bias'"),
    (dict(lr=-1.0), "lr must be a finite number >= 0"),
    (dict(eps=-1e-8), "eps must be a finite number >= 0"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
])
def test_invalid_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        slimopt.SlimOptimizer([_w()], **settings)


def test_invalid_group_setting_names_the_setting():
    with pytest.raises(ValueError, match="rank"):
        slimopt.SlimOptimizer([{"params": [_w()]}, {"params": [_w()], "projector": "svd", "rank": -3}])


def test_unknown_setting_and_method():
    with pytest.raises(TypeError, match="unknown setting"):
        slimopt.SlimOptimizer([_w()], rnak=3)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="unknown method 'adamx'; available: adamw"):
        slimopt.build(model, "adamx")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        slimopt.build(model, "galore", rnak=3)
    with pytest.raises(ValueError, match="state_full must be"):
        slimopt.build(model, "frugal", state_full="some")


def test_sparse_and_complex_gradients_raise():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = slimopt.SlimOptimizer(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    z = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    opt = slimopt.SlimOptimizer([z])
    z.grad = torch.randn(3, 3, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()


def test_target_modules_and_overrides_that_match_nothing_are_refused():
    # a typo would otherwise leave no weight projectable: GaLore silently became AdamW at GaLore's lr
    from helpers import tiny_llama
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"target_modules 'q_porj' matches no nn.Linear module.*q_proj"):
        slimopt.build(model, "galore", rank=4, target_modules="q_porj")
    with pytest.raises(ValueError, match=r"target_modules \['q_porj'\] matches no nn.Linear"):
        slimopt.build(model, "galore", rank=4, target_modules=["q_porj"])
    with pytest.raises(ValueError, match=r"overrides pattern 'nonexistent\.\*' matches no trainable parameter"):
        slimopt.build(model, "galore", rank=4, overrides={"nonexistent.*": {"lr": 1e-3}})
    opt = slimopt.build(model, "galore", rank=4, target_modules=["q_proj"], overrides={"lm_head": {"lr": 1e-3}})
    projected = [n for g in opt.param_groups if g["projector"] != "none" for n in g["names"]]
    assert projected and all(".q_proj." in n for n in projected)
    assert any(g["name"].endswith(":lm_head") and g["lr"] == 1e-3 for g in opt.param_groups)
