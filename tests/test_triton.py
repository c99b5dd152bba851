"""The Triton element-wise step (triton_step.py, triton_kernels.py): under the interpreter on CPU tensors it equals
the eager step (tests/triton_worker.py, in a process of its own; bit for bit on the Intel Xeon tried but for fp32
weights' square-root ulp, asserted within what another processor's torch may round otherwise, as test_native), a checkpoint switches path at resume, a failing
kernel costs one warning and the eager step; without triton, or for what it does not cover, the eager step runs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from launch import interpreted_worker

import slimopt
from slimopt.optim.routes.triton import triton_step

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report():
    return interpreted_worker("triton_worker.py")


@pytest.fixture(scope="module")
def compiled(report):
    """Every kernel specialization the worker's steps launched, compiled for an H200 (sm_90) by triton's own
    compiler and ptxas, in a process without the interpreter (tests/triton_compile_worker.py)."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend to compile for")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SLIMOPT_TRITON_CPU")}
    res = subprocess.run([sys.executable, os.path.join(HERE, "triton_compile_worker.py")], capture_output=True,
                         text=True, env=env, timeout=600, input=json.dumps(report["specializations"]))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_launched_kernel_compiles_for_the_gpu(report, compiled):
    # what the interpreter cannot show: a global that is not a tl.constexpr, an operation without a code generator
    assert not compiled["failed"], compiled["failed"]
    kernels = {label.split("(")[0] for label in compiled["compiled"]}
    assert kernels == {"elementwise_step", "moment_step", "taco_columns", "column_best"}, kernels
    assert len(compiled["compiled"]) == len(report["specializations"]) >= 60, len(compiled["compiled"])


def test_every_rule_and_codec_equals_the_eager_step(report):
    cases = {k: v for k, v in report.items()
             if "/" in k and not k.startswith(("taco", "batched", "galore planned", "lift "))}
    assert len(cases) == 52
    for name, r in cases.items():
        # every tensor, every step, on the kernel (routed as on CUDA); a projected 2-D weight one launch more a
        # step: its lifted update's write (GaLore's svd; FRUGAL's columns with their residual)
        assert r["launches"] == 3 * 3 + (3 if "/svd" in name or "/columns" in name else 0), name
        assert r["state"], name  # every moment, code and scale bit for bit
        assert r["weights"], (name, r["max_weight_diff"])
        # the state-free sign step and SGD momentum (no square root, no lerp): the rounded write is bit for bit
        if "signstochastic" in name or "kahan" in name:
            assert r["exact"], name
        # Lion and SGD momentum on ternary moments: the moment pass's stochastic trits and block scales too
        if name.startswith(("lion/ternary", "sgdm/ternary")):
            assert r["exact"], name


def test_a_projected_write_with_a_residual_is_one_launch(report):
    cases = {k: v for k, v in report.items() if k.startswith("lift ")}
    assert len(cases) == 5
    for name, r in cases.items():  # FRUGAL's svd, random and column projections: one write a step, bit for bit
        assert r["lifts"] == 3 and r["exact"], (name, r)


def test_ternary_and_factored_moments_of_one_shape_share_their_launches(report):
    for dtype in ("float32", "bfloat16"):
        r = report[f"batched ternary/{dtype}"]
        # a step: the two 24 x 300 weights (rows layout, then the ternary moment pass), the 7200-element one, the
        # 30-element one (fp32 moments): three launch sets for four tensors
        assert r["launches"] == 3 * 3 and r["tensors"] == 3 * 4, (dtype, r)
        assert r["weights"] and r["state"], (dtype, r)
    # at most WINDOW_BYTES of fp64 sums a launch (here a budget under one weight's): one launch set a 2-D weight
    r = report["batched ternary split/bfloat16"]
    assert r["launches"] == 3 * 4 and r["tensors"] == 3 * 4 and r["exact"], r


def test_a_failing_moment_pass_writes_nothing_and_runs_eagerly(report):
    r = report["failed moment pass"]
    # one warning: the 2-D weight's setting (the smaller weights keep fp32 moments, with no moment pass)
    assert r["warnings"] == 1 and r["weights"] and r["state"] and r["exact"], r


def test_galore_between_refreshes_replays_its_planned_launches(report):
    for dtype in ("float32", "bfloat16"):
        r = report[f"galore planned/{dtype}"]
        # a step: the 2-D weight's subspace rule and lifted write, the two 1-D weights' full-space steps
        assert r["planned"] == "ProjectedLaunchPlan" and r["launches"] == 4 * 4, (dtype, r)
        assert r["weights"] and r["state"], (dtype, r)


def test_tensors_of_one_size_and_settings_step_in_one_launch(report):
    for dtype in ("float32", "bfloat16"):
        r = report[f"batched/{dtype}"]
        # each step: the three weights of 7200 elements in the first group in one launch, the 30-element one in
        # another, the second group's weight in a third
        assert r["launches"] == 3 * 3 and r["tensors"] == 3 * 5, (dtype, r)
        assert r["plans"] == 5, (dtype, r)  # from the second step on, each weight's launch replays its plan
        assert r["weights"] and r["state"], (dtype, r)


def test_taco_steps_equal_the_tensor_operations(report):
    for dtype in ("float32", "bfloat16"):
        for name in ("taco k=1", "taco k=1 int8"):  # fp8 and int8 values: the whole step as kernels
            r = report[f"{name} {dtype}"]
            # each step: the two 24 x 300 weights in one set of launches, the 300 x 24 one in another
            assert r["runs"] == 3 * 2 and r["stepped"] == 3 * 3 and r["searches"] == 0, (name, dtype, r)
            # the 2-D weights and their history bit for bit (no square root on the way); the 1-D ones take AdamW.
            # From the second step on each 2-D weight replays its plan (kernel_plan.TacoLaunchPlan)
            assert r["2-D exact"] and r["weights"] and r["state"], (name, dtype, r)
            assert r["plans"] == ["TacoLaunchPlan"], (name, dtype, r)
        r = report[f"taco k=0 {dtype}"]  # no history: the search as a kernel, the rest tensor operations
        assert r["searches"] == 3 * 3 and r["runs"] == 0 and r["2-D exact"] and r["weights"], (dtype, r)
    # at most the scratch budget a set of launches (here under one weight's): each weight alone, the same results
    r = report["taco k=1 split bfloat16"]
    assert r["runs"] == 3 * 3 and r["stepped"] == 3 * 3 and r["2-D exact"], r


def test_a_checkpoint_switches_path_at_resume(report):
    assert report["switch to eager at resume"]["weights"] and report["switch to eager at resume"]["state"]
    back = report["switch to Triton at resume"]
    assert back["weights"] and back["state"] and back["launches"] == 3


def test_a_failing_kernel_costs_one_warning_and_runs_eagerly(report):
    r = report["failed kernel"]
    assert r["weights"] and r["state"]
    # one warning per kernel specialization that failed: int8 moments (the 2-D tensor) and fp32 ones (the rest)
    assert r["warnings"] == 2 and r["names_kernel"] and r["fallbacks"] == 2


def test_a_failing_taco_kernel_costs_one_warning_and_the_tensor_operations(report):
    r = report["failed taco kernel"]
    assert r["warnings"] == 1 and r["weights"] and r["state"] and r["exact"], r


def test_cpu_tensors_and_uncovered_settings_stay_off_the_kernel(monkeypatch):
    w = torch.nn.Parameter(torch.randn(64, 64))
    w.grad = torch.randn(64, 64)
    opt = slimopt.SlimOptimizer([w], state_bits=8)
    group = opt.param_groups[0]
    codecs = opt._moment_codecs(group, w.shape, w.dtype)
    monkeypatch.delenv("SLIMOPT_TRITON_CPU", raising=False)
    assert not triton_step.applies(group, w, w.grad, codecs)  # a CPU tensor outside the test hook
    monkeypatch.setenv("SLIMOPT_TRITON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(triton_step._state, "triton", object())  # as if installed
    assert triton_step.applies(group, w, w.grad, codecs)
    assert not triton_step.applies({**group, "fused": False}, w, w.grad, codecs)
    monkeypatch.setenv("SLIMOPT_TRITON", "0")
    assert not triton_step.applies(group, w, w.grad, codecs)
    monkeypatch.setenv("SLIMOPT_TRITON", "1")
    ternary = _group_and_codecs(codec="ternary")
    assert triton_step.applies(ternary[0], w, w.grad, ternary[1])  # ternary m, factored v: the kernel too
    muon = _group_and_codecs(rule="muon")
    assert not triton_step.applies(muon[0], w, w.grad, muon[1])  # Newton-Schulz needs the whole matrix: eager
    wide = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    wide.grad = torch.randn(64, 64, dtype=torch.float64)
    assert not triton_step.applies(group, wide, wide.grad, codecs)  # fp64 weights: eager
    monkeypatch.setitem(triton_step._state, "triton", None)  # not installed
    assert not triton_step.applies(group, w, w.grad, codecs)


def _group_and_codecs(**settings):
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = slimopt.SlimOptimizer([w], **settings)
    group = opt.param_groups[0]
    return group, opt._moment_codecs(group, w.shape, w.dtype)
