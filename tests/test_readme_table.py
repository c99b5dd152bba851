"""The README's "Which method" table and its picture are what benchmarks/readme_table.py makes from the planner and
the recorded results: a change to either (a planner formula, a recorded run, a method's recipe) that is not
regenerated with `python3 benchmarks/readme_table.py --write` fails here. No training: the planner works on a
meta-device model (a few seconds for LLaMA-7B)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_table"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("readme_table", None)


@pytest.fixture(scope="module")
def plans(rt):
    return rt.plans()


def test_readme_table_is_the_generated_one(rt, plans):
    text = rt.README.read_text()
    assert text.count(rt.BEGIN) == 1 and text.count(rt.END) == 1
    assert rt.readme_block(text) == rt.block(plans), (
        "README.md's method table differs from what the planner and the recorded results give: run "
        "python3 benchmarks/readme_table.py --write")


def test_picture_is_drawn_from_the_same_data(rt, plans):
    assert rt.PNG.exists()
    assert rt.png_digest() == rt.digest(rt.figure_data(plans)), (
        f"{rt.PNG.relative_to(ROOT)} was drawn from other data: run python3 benchmarks/readme_table.py --write")
    assert f"]({rt.PNG.relative_to(ROOT).as_posix()})" in rt.readme_block(rt.README.read_text())


def test_digest_follows_the_data(rt, plans):
    """A changed figure changes the digest (so a stale picture cannot pass)."""
    data = rt.figure_data(plans)
    changed = rt.figure_data(plans)
    changed["methods"][0]["peak"] += 1
    assert rt.digest(data) != rt.digest(changed)


def test_planner_figures_are_slimopt_memory_s(rt, plans):
    """The table's memory columns are the planner's own numbers for the stated setting."""
    from slimopt.bench import planner
    from slimopt.bench.units import parse_size

    s = rt.SETTING
    p = planner.plan(s["model"], "frugal_head", dtype=s["dtype"], batch=s["batch"], seq=s["seq"],
                     layerwise=s["layerwise"], checkpointing=s["checkpointing"])
    assert plans["frugal_head"]["peak"] == p.peak
    p8 = planner.plan(rt.SECOND, "frugal_head", dtype=s["dtype"], batch=s["batch"], seq=s["seq"],
                      layerwise=s["layerwise"], checkpointing=s["checkpointing"])
    assert plans["frugal_head"]["second"]["peak"] == p8.peak and plans["frugal_head"]["second"]["label"] == "llama-3-8b"
    assert plans["frugal_head"]["state_bytes_per_param"] == p.state_bytes_per_param
    assert plans["adamw"]["max_batch"]["16GB"] == 0  # bf16 AdamW's 25 GiB of state fit no 16 GB card
    assert plans["frugal_head"]["max_batch"]["16GB"] == planner.max_batch(
        s["model"], "frugal_head", parse_size("16GB"), s["seq"], dtype=s["dtype"], layerwise=True,
        checkpointing=True)


def test_quality_agrees_with_the_recorded_tables(rt):
    """The 3-seed means the script computes from the per-seed files are the ones the docs' tables print."""
    qual = rt.quality()
    # docs/reproduction.md, "Three seeds" (SmolLM2 on KJV): mean vs AdamW
    text = (ROOT / "docs" / "reproduction.md").read_text()
    for method in ("frugal", "taco", "ternary_adamw"):
        row = re.search(rf"^\| {method} \|.*\| ([+-][0-9.]+)% \|$", text, re.M)
        q = qual["smollm2-kjv"][method]
        assert row, method
        assert f"{100 * (q['value'] / q['adamw'] - 1):+.1f}" == row.group(1), method
    # the 0.5M table's means are results.csv's val_ppl
    for r in rt._rows("docs/results/compare-kjv-tuned/results.csv"):
        if r["method"] in qual["tiny"]:
            assert abs(qual["tiny"][r["method"]]["value"] - float(r["val_ppl"])) < 1e-9, r["method"]
    # what no 3-seed run measured says so
    assert "galore8bit" not in qual["tiny"] and "signsgd" not in qual["tiny"]
    assert "galore" not in qual["smollm2-kjv"]  # one seed only


def test_every_method_in_the_table_is_a_slimopt_method(rt):
    import slimopt

    assert set(rt.METHODS) <= set(slimopt.methods())
