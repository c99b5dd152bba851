"""The 7B-under-16GB recipe (method frugal_head): its partition, its plan, and the GPU script's code path on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

import slimopt
from slimopt.bench import planner
from slimopt.models.llama import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_frugal_head_partition():
    model = build_model("tiny", 512, 32).to(torch.bfloat16)
    opt = slimopt.build(model, "frugal_head")
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"projectable", "embedding", "other", "head"}
    for name in ("projectable", "embedding", "other"):  # state-free signSGD
        g = groups[name]
        assert (g["projector"], g["density"], g["free_rule"]) == ("block", 0.0, "sign")
    head = groups["head"]
    assert (head["projector"], head["rule"], head["codec"]) == ("none", "adamw", "int8")
    assert all(g["param_rounding"] == "stochastic" for g in opt.param_groups)
    # one step: Adam state on the head only (8-bit codes and scales), a step counter elsewhere
    model(input_ids=torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss.backward()
    opt.step()
    w_head = model.get_output_embeddings().weight
    assert opt.state[w_head]["exp_avg"].dtype == torch.uint8
    assert all(set(opt.state[p]) == {"step"} for g in opt.param_groups if g["name"] != "head" for p in g["params"])
    # the recipe's state_full can still be overridden
    opt_all = slimopt.build(model, "frugal_head", state_full="all")
    assert {g["name"]: g["projector"] for g in opt_all.param_groups}["embedding"] == "none"


def test_7b_recipe_fits_16gb_and_32b_taco_fits_80gb():
    p7 = planner.plan("7b", "frugal_head", batch=1, seq=1024, layerwise=True, checkpointing=True)
    assert p7.peak < 16e9 * 0.95  # 13.45 GiB of 14.9
    assert p7.scratch <= 64 << 20  # windowed: no update allocates more than 64 MiB
    folder = ROOT / "benchmarks" / "configs" / "qwen2.5-32b-shape"
    p32 = planner.plan(str(folder), "taco", batch=1, seq=1024, layerwise=True, checkpointing=True)
    assert p32.peak < 80e9  # 69.3 GiB of 74.5
    assert p32.params > 32e9


def test_llama7b_script_runs_its_steps_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("llama7b_16gb", ROOT / "benchmarks" / "llama7b_16gb.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "tiny", "--device", "cpu", "--steps", "2", "--seq", "32",
                        "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "llama7b.json").read_text())
    assert record["status"] == "ok" and record["steps"] == 2 and record["plan"]["peak"] > 0
    assert "status: ok" in (tmp_path / "llama7b.md").read_text()


def test_settings_given_to_build_beat_the_methods_own():
    model = build_model("tiny", 512, 32)
    groups = {g["name"]: g for g in slimopt.build(model, "frugal_head", codec="fp32").param_groups}
    assert groups["head"]["codec"] == "fp32"  # the recipe's int8 head gives way
    groups = {g["name"]: g for g in slimopt.build(model, "frugal_head", codec="fp32",
                                                  overrides={"lm_head": {"codec": "int4"}}).param_groups}
    assert groups["head:lm_head"]["codec"] == "int4"  # an override beats both
    groups = {g["name"]: g for g in slimopt.build(model, "taco", rule="adamw").param_groups}
    assert groups["projectable"]["rule"] == "adamw"
