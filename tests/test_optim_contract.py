"""torch.optim's contract as torch's own optimizer tests check it (pytorch test/test_optim.py): SlimOptimizer loads
what torch's optimizers load, runs the hooks where torch runs them, and keeps the state torch keeps."""

import copy

import pytest
import torch
from helpers import assert_same_state, fill_grads, random_params
from torch.nn import Parameter

import slimopt
from slimopt.optim.distributed import portable

SETTINGS = {
    "adamw": dict(),
    "galore": dict(projector="svd", rank=2, update_gap=2),
    "frugal": dict(projector="block", density=0.5, free_rule="sign", update_gap=2, on_refresh="reset"),
    "int8": dict(state_bits=8),
    "columns-sgdm": dict(projector="columns", density=0.5, rule="sgdm", update_gap=2),
    "lion-int4": dict(rule="lion", codec="int4"),
}
SHAPES = [(80, 64), (64,), (64, 80)]  # the weights hold 5120 elements: over 4096, 8-bit moments are uint8 codes


def _trained(settings, steps=3):
    params = random_params(SHAPES)
    opt = slimopt.SlimOptimizer(params, lr=1e-2, weight_decay=0.01, **settings)
    for step in range(steps):
        fill_grads(params, 100 + step)
        opt.step()
    return params, opt


def _fresh(params, settings):
    clones = [Parameter(p.detach().clone()) for p in params]
    return clones, slimopt.SlimOptimizer(clones, lr=1e-2, weight_decay=0.01, **settings)


def _numbers_for_counters(state_dict):
    """What an old or hand-edited checkpoint holds: the step counters as Python floats."""
    state_dict = copy.deepcopy(state_dict)
    for st in state_dict["state"].values():
        for key in ("step", "moment_step"):
            if key in st:
                st[key] = st[key].item()
    return state_dict


# ------------------------------------------------------------------------------------------------ counters


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_step_saved_as_a_python_number_loads_and_continues_as_the_tensor_form(name):
    # torch.optim loads {"step": 12.0} (test_load_nontensor_step); the counters become slimopt's own form
    settings = SETTINGS[name]
    params, opt = _trained(settings)
    saved = copy.deepcopy(opt.state_dict())
    as_numbers = _numbers_for_counters(saved)
    assert any(isinstance(v, float) for st in as_numbers["state"].values() for v in st.values())

    ref_params, ref = _fresh(params, settings)
    ref.load_state_dict(saved)
    new_params, new = _fresh(params, settings)
    new.load_state_dict(as_numbers)
    for p in new_params:
        for key in ("step", "moment_step"):
            if key in new.state[p]:
                t = new.state[p][key]
                assert isinstance(t, torch.Tensor) and t.shape == () and t.dtype == torch.float32
                assert t.device.type == "cpu"
    for step in range(3, 7):  # across a refresh (update_gap 2)
        fill_grads(ref_params, 100 + step)
        fill_grads(new_params, 100 + step)
        ref.step()
        new.step()
    for a, b in zip(ref_params, new_params):
        assert torch.equal(a, b)
        assert_same_state(ref.state[a], new.state[b])


def test_a_step_saved_as_a_number_loads_in_the_portable_form():
    params, opt = _trained(SETTINGS["int8"])
    with portable.portable_state(opt):
        saved = _numbers_for_counters(opt.state_dict())
    new_params, new = _fresh(params, SETTINGS["int8"])
    new.load_state_dict(saved)
    assert new.state[new_params[0]]["step"].dtype == torch.float32
    assert float(new.state[new_params[0]]["step"]) == 3.0
    fill_grads(new_params, 100 + 3)
    new.step()
    assert float(new.state[new_params[0]]["step"]) == 4.0


@pytest.mark.parametrize("bad", ["12", -1.0, 2.5, float("nan"), True, torch.zeros(2)])
def test_a_counter_that_is_not_a_whole_number_is_refused_naming_the_parameter(bad):
    params, opt = _trained(SETTINGS["adamw"], steps=1)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["step"] = bad
    _, new = _fresh(params, SETTINGS["adamw"])
    with pytest.raises(ValueError, match=r"parameter 1.*'step'.*whole number"):
        new.load_state_dict(saved)


def test_a_state_value_that_is_not_a_tensor_is_refused_naming_the_parameter_and_key():
    params, opt = _trained(SETTINGS["galore"], steps=1)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["projector"] = {"rank": 2}  # what galore-torch keeps in its state
    _, new = _fresh(params, SETTINGS["galore"])
    with pytest.raises(ValueError, match=r"parameter 0.*'projector'.*tensors"):
        new.load_state_dict(saved)


# ------------------------------------------------------------------------------------------------ load hooks


@pytest.mark.parametrize("form", ["torch", "portable"])
def test_a_load_state_dict_post_hook_sees_the_loaded_state(form):
    # torch runs the post-hooks after the state is in place (test_load_state_dict_post_hook)
    params, opt = _trained(SETTINGS["int8"])
    if form == "portable":
        with portable.portable_state(opt):
            saved = opt.state_dict()
    else:
        saved = opt.state_dict()
    new_params, new = _fresh(params, SETTINGS["int8"])
    seen = {}

    def post_hook(optimizer):
        seen["steps"] = [float(optimizer.state[p]["step"]) for p in new_params if p in optimizer.state]
        seen["codes"] = optimizer.state[new_params[0]]["exp_avg"].dtype

    new.register_load_state_dict_post_hook(post_hook)
    new.load_state_dict(saved)
    assert seen == {"steps": [3.0, 3.0, 3.0], "codes": torch.uint8}


def test_a_load_state_dict_pre_hook_may_change_or_replace_the_state():
    # a pre-hook edits the state_dict in place or returns a new one; what it leaves is what torch loads
    params, opt = _trained(SETTINGS["adamw"])
    saved = opt.state_dict()
    new_params, new = _fresh(params, SETTINGS["adamw"])

    def in_place(optimizer, state_dict):
        state_dict["state"] = {i: {**st, "step": torch.tensor(7.0)} for i, st in state_dict["state"].items()}

    def replace(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        state_dict["param_groups"][0]["lr"] = 0.003
        state_dict["state"][2]["exp_avg"] = torch.zeros(64, 80)
        return state_dict

    new.register_load_state_dict_pre_hook(in_place)
    new.register_load_state_dict_pre_hook(replace)
    new.load_state_dict(saved)
    assert new.param_groups[0]["lr"] == 0.003
    assert [float(new.state[p]["step"]) for p in new_params] == [7.0, 7.0, 7.0]
    assert not new.state[new_params[2]]["exp_avg"].any()
    assert saved["state"][2]["exp_avg"].any() and float(saved["state"][0]["step"]) == 3.0  # the caller's dict


def test_state_not_keyed_by_a_parameter_is_kept_as_torch_keeps_it():
    # torch copies state entries that name no parameter as they are (test_load_state_dict_post_hook writes them)
    params, opt = _trained(SETTINGS["adamw"], steps=1)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"]["ran_hook"] = True
    new_params, new = _fresh(params, SETTINGS["adamw"])
    new.load_state_dict(saved)
    assert new.state["ran_hook"] is True
    assert new.state_dict()["state"]["ran_hook"] is True
    with portable.portable_state(new):
        assert new.state_dict()["state"]["ran_hook"] is True
    fill_grads(new_params, 100 + 1)
    new.step()


# ------------------------------------------------------------------------------------------------ torch.optim.AdamW's state


def _torch_adamw(params, **settings):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **settings)


@pytest.mark.parametrize("fused", [True, False])
def test_torch_adamw_state_continues_in_slimopt_adamw(fused):
    # torch.optim lets optimizers of one algorithm load each other's state dicts: a run moved from torch's AdamW
    # to slimopt's (the same moments, step, exp_avg, exp_avg_sq) continues as torch's would
    params = random_params(SHAPES)
    reference = _torch_adamw(params)
    for step in range(3):
        fill_grads(params, 100 + step)
        reference.step()
    saved = copy.deepcopy(reference.state_dict())
    assert saved["param_groups"][0]["fused"] is None and "moment_step" not in saved["state"][0]
    clones = [Parameter(p.detach().clone()) for p in params]
    opt = slimopt.SlimOptimizer(clones, rule="adamw", codec="fp32", fused=fused)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert group["fused"] is fused  # torch's None (torch picks) is no slimopt setting: this optimizer's stays
    assert group["lr"] == 1e-2 and group["weight_decay"] == 0.01  # the saved hyperparameters, as torch loads them
    for step in range(3, 6):
        fill_grads(params, 100 + step)
        fill_grads(clones, 100 + step)
        reference.step()
        opt.step()
    for p, q in zip(params, clones):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    for p, q in zip(params, clones):
        ours, theirs = opt.state[q], reference.state[p]
        assert float(ours["step"]) == float(ours["moment_step"]) == float(theirs["step"]) == 6.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("setting", ["amsgrad", "maximize"])
def test_a_torch_setting_slimopt_does_not_compute_is_refused_naming_it(setting):
    params = random_params(SHAPES)
    reference = _torch_adamw(params, **{setting: True})
    fill_grads(params, 100 + 0)
    reference.step()
    saved = reference.state_dict()
    clones = [Parameter(p.detach().clone()) for p in params]
    opt = slimopt.SlimOptimizer(clones, lr=1e-3)
    with pytest.raises(ValueError, match=f"{setting}=True") as caught:
        opt.load_state_dict(saved)
    assert "parameter group 0" in str(caught.value)
    assert opt.param_groups[0]["lr"] == 1e-3 and not opt.state  # nothing was loaded


def test_torch_adam_l2_weight_decay_is_refused_and_without_decay_loads():
    # torch.optim.Adam adds weight_decay * p to the gradient (decoupled_weight_decay=False); slimopt decays the
    # weights themselves, so only Adam without weight decay is the same arithmetic
    params = random_params(SHAPES)
    for weight_decay in (0.01, 0.0):
        reference = torch.optim.Adam(params, lr=1e-2, weight_decay=weight_decay)
        fill_grads(params, 100 + 0)
        reference.step()
        opt = slimopt.SlimOptimizer([Parameter(p.detach().clone()) for p in params])
        if weight_decay:
            with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
                opt.load_state_dict(reference.state_dict())
        else:
            opt.load_state_dict(reference.state_dict())


# ------------------------------------------------------------------------------------------------ what already holds


def test_the_rest_of_the_torch_contract():
    params, opt = _trained(SETTINGS["galore"])
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))

    def closure():
        fill_grads(params, 100 + 3)
        return torch.tensor(1.5)

    assert opt.step(closure).item() == 1.5 and calls == ["pre", "post"]
    opt.zero_grad()
    assert all(p.grad is None for p in params)

    # a deep copy of the state_dict, loaded into clones, continues identically and leaves the dict as it was
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(saved)
    clones, twin = _fresh(params, SETTINGS["galore"])
    twin.load_state_dict(saved)
    assert saved["param_groups"] == before["param_groups"]
    assert set(twin.state) == set(clones)
    for step in range(4, 7):
        fill_grads(params, 100 + step)
        fill_grads(clones, 100 + step)
        opt.step()
        twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, clones))
    a, b = opt.state_dict(), twin.state_dict()
    assert list(a) == ["state", "param_groups"] and a["param_groups"] == b["param_groups"]
    assert all(list(a["state"][i]) == list(b["state"][i]) for i in a["state"])

    # another number of parameters is refused as torch refuses it
    with pytest.raises(ValueError, match="doesn't match the size"):
        slimopt.SlimOptimizer(params[:2], lr=1e-2, **SETTINGS["galore"]).load_state_dict(saved)


def test_named_parameters_tensor_lr_and_a_scheduler():
    model = torch.nn.Linear(64, 80)
    opt = slimopt.SlimOptimizer(model.named_parameters(), lr=torch.tensor(0.01), projector="svd", rank=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fill_grads(model, 100 + 0)
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.005)]
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["param_names"] == ["weight", "bias"]
    other = slimopt.SlimOptimizer(model.parameters(), lr=0.01, projector="svd", rank=2)
    other.load_state_dict(saved)
    assert other.param_groups[0]["param_names"] == ["weight", "bias"]
    fill_grads(model, 100 + 1)
    other.step()
