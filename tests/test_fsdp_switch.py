"""An optimizer follows parameters switched in place in its groups, as accelerate's FSDP2 ``prepare`` switches those
of an optimizer the Hugging Face Trainer built on the plain model (docs/finetune.md, "The Trainer with FSDP2").

In one process the switch is accelerate's own sequence with a copy of the model in place of ``fully_shard``: six
methods then step as an optimizer built on the new parameters, and state taken before the switch continues. Under
FSDP2 (2 ranks, gloo; tests/distributed/switch_worker.py) every method, switched before any step or after two,
equals an optimizer built after sharding bit for bit, and one process within 1e-6.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import warnings
import weakref

import pytest
import torch
from helpers import assert_same_models, backward, batches, run, tiny_llama
from launch import read_report, run_worker

import slimopt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "distributed"))

pytest.importorskip("accelerate")
from defaults_worker import settings  # noqa: E402
from switch_worker import switch_like_accelerate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

METHODS = ("adamw", "adamw8bit", "galore", "frugal", "taco", "muon")


def _build(model, method):
    # update_gap 2 where there is a subspace or a block: refreshes and block turns at steps 1 and 3, on both sides
    # of a switch at 2
    return slimopt.build(model, method, **settings(method))


@pytest.mark.parametrize("method", METHODS)
def test_switched_before_the_first_step_steps_as_built_on_the_new_parameters(method):
    model = tiny_llama()
    opt = _build(model, method)
    old = [weakref.ref(p) for p in model.parameters()]
    model = switch_like_accelerate(model, opt, copy.deepcopy)
    gc.collect()
    assert all(r() is None for r in old)  # an optimizer that has not stepped keeps no parameter alive
    twin = copy.deepcopy(model)
    twin_opt = _build(twin, method)
    data = batches(3)
    run(model, opt, data)
    run(twin, twin_opt, data)
    assert_same_models(model, opt, twin, twin_opt)


@pytest.mark.parametrize("method", METHODS)
def test_state_continues_across_a_switch_afterrun(method):
    model, twin = tiny_llama(), tiny_llama()
    opt, twin_opt = _build(model, method), _build(twin, method)
    data = batches(4)
    run(model, opt, data[:2])
    old = [weakref.ref(p) for p in model.parameters()]
    model = switch_like_accelerate(model, opt, copy.deepcopy)
    run(model, opt, data[2:])
    run(twin, twin_opt, data)
    assert_same_models(model, opt, twin, twin_opt)  # the moments went on where they were, not from zero
    gc.collect()
    assert all(r() is None for r in old)  # nothing keeps the parameters that left


def test_state_dict_right_after_a_switch_holds_the_moved_state():
    model, twin = tiny_llama(), tiny_llama()
    opt, twin_opt = _build(model, "adamw8bit"), _build(twin, "adamw8bit")
    data = batches(2)
    run(model, opt, data)
    run(twin, twin_opt, data)
    model = switch_like_accelerate(model, opt, copy.deepcopy)
    sd, want = opt.state_dict(), twin_opt.state_dict()  # torch's state_dict finds state by the groups' parameters
    assert sorted(sd["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert all(torch.equal(v, sd["state"][i][k]) for k, v in st.items())


def test_step_param_follows_a_switch():
    model, twin = tiny_llama(), tiny_llama()
    opt, twin_opt = _build(model, "adamw8bit"), _build(twin, "adamw8bit")
    data = batches(3)
    run(model, opt, data[:1])
    run(twin, twin_opt, data[:1])
    model = switch_like_accelerate(model, opt, copy.deepcopy)
    for ids in data[1:]:
        for m, o in ((model, opt), (twin, twin_opt)):
            backward(m, ids)
            for p in m.parameters():  # what layer-wise updates call, one parameter at a time
                o.step_param(p)
    assert_same_models(model, opt, twin, twin_opt)


def test_an_optimizer_built_on_meta_parameters_steps_on_the_real_ones():
    # accelerate's fsdp_cpu_ram_efficient_loading: ranks but the first build the model (and the Trainer the
    # optimizer) on the meta device; prepare switches in the real parameters
    real = tiny_llama()
    with torch.device("meta"):
        meta = tiny_llama()
    data = batches(2)
    for method in ("adamw8bit", "galore"):
        opt = _build(meta, method)
        model = switch_like_accelerate(meta, opt, lambda m: copy.deepcopy(real))
        twin = copy.deepcopy(real)
        twin_opt = _build(twin, method)
        run(model, opt, data)
        run(twin, twin_opt, data)
        assert_same_models(model, opt, twin, twin_opt)


def test_a_parameter_switched_for_another_shape_starts_afresh_with_a_warning():
    a, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    opt = slimopt.SlimOptimizer([a, b], lr=0.1)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    c = torch.nn.Parameter(torch.randn(4, 8))
    opt.param_groups[0]["params"] = [c, b]
    c.grad, b.grad = torch.ones_like(c), torch.ones_like(b)
    with pytest.warns(RuntimeWarning, match=r"position 0: \(8, 4\) -> \(4, 8\)"):
        opt.step()
    assert float(opt.state[c]["step"]) == 1 and float(opt.state[b]["step"]) == 2
    assert a not in opt.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()  # nothing left keyed by a parameter that is gone


@pytest.mark.slow
def test_fsdp2_every_method_switched_to_shards_equals_built_after_sharding(tmp_path):
    """One launch at 2 ranks (about 40 s on 2 busy cores) runs every method (tests/distributed/switch_worker.py);
    any failed check there fails the launch."""
    run_worker(2, "switch_worker.py", tmp_path)
    report = read_report(tmp_path, "switch_2.json")
    assert sorted(report) == sorted(slimopt.methods())
    for method, r in report.items():
        assert r["before_diff"] <= 1e-6 and r["after_diff"] <= 1e-6, (method, r)
    assert all(r["moved"] > 0 for r in report.values())
