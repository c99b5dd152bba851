"""Host masters stepped during the backward pass (slimopt.weights.host_master): on a CPU, where the device is the
host, the run equals the same model stepped after its backward pass by one optimizer over the same masters, bit
for bit, for every kind of state; the event log shows steps starting before the backward pass is over."""

import pytest
import torch

from helpers import batches, tiny_llama
from slimopt.optim.recipes import param_groups
from slimopt.optim.optimizer import SlimOptimizer
from slimopt.weights.convert import to_int8
from slimopt.weights.host_master import HostMaster
from slimopt.weights.int8_linear import Int8Linear

METHODS = {
    "adamw": {},
    "adamw8bit": {},
    "galore": {"rank": 4, "update_gap": 2},
    "frugal": {"density": 0.5, "update_gap": 2},
    "ternary_adamw": {},
    "taco": {},
}


def _reference(method, settings, data, accumulation=1):
    """int8 weights and fp32 masters, one optimizer.step() after each window's backward passes, then requantize."""
    model = tiny_llama(seed=0)
    groups = param_groups(model, method, **settings)
    names = {id(p): n for n, p in model.named_parameters()}
    masters = dict(to_int8(model, 0, torch.float32))
    device = {}
    for group in groups:
        ps = []
        for p in group["params"]:
            name = names[id(p)]
            if name not in masters:
                masters[name] = torch.nn.Parameter(p.detach().clone().float())
                device[name] = p
            ps.append(masters[name])
        group["params"] = ps
    opt = SlimOptimizer(groups)
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    losses = []
    for k, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss / accumulation
        loss.backward()
        losses.append(loss.item())
        for name, p in device.items():
            if p.grad is not None:
                masters[name].grad = p.grad.float() if masters[name].grad is None else masters[name].grad + p.grad
                p.grad = None
        if (k + 1) % accumulation:
            continue
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, master in masters.items():
                layers[name].load_weight(master) if name in layers else device[name].copy_(master)
    return model, masters, losses


def _offloaded(method, settings, data, accumulation=1, overlap=True, record=False):
    model = tiny_llama(seed=0)
    host = HostMaster(model, method, accumulation_steps=accumulation, overlap=overlap, record=record, **settings)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss / accumulation
        loss.backward()
        losses.append(loss.item())
    host.synchronize()
    return model, host, losses


@pytest.mark.parametrize("method", list(METHODS))
def test_offloaded_run_equals_the_step_after_backward(method):
    data = batches(4, seed=5)
    ref_model, ref_masters, ref_losses = _reference(method, METHODS[method], data)
    model, host, losses = _offloaded(method, METHODS[method], data)
    assert losses == ref_losses and host.steps == 4
    for name, master in host.masters.items():
        assert torch.equal(master, ref_masters[name]), name
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name  # int8 codes, scales and every device weight
    host.close()


def test_accumulation_and_the_inline_mode_agree_with_the_reference():
    data = batches(4, seed=6)
    _, ref_masters, ref_losses = _reference("adamw8bit", {}, data, accumulation=2)
    for overlap in (True, False):
        _, host, losses = _offloaded("adamw8bit", {}, data, accumulation=2, overlap=overlap)
        assert losses == ref_losses and host.steps == 2
        assert all(torch.equal(m, ref_masters[n]) for n, m in host.masters.items())
        host.close()


def test_steps_start_while_the_backward_pass_runs():
    """In the inline mode (deterministic) the last layer's weights step before the first layer's gradients exist;
    with a worker, each forward waits only for its own module's update."""
    _, host, _ = _offloaded("adamw", {}, batches(2, seed=7), overlap=False, record=True)
    first_window = host.events[: len(host.events) // 2]
    order = [(what, name) for _, what, name in first_window]
    last_layer = order.index(("step", "model.layers.1.mlp.down_proj.weight"))
    first_layer_grad = order.index(("grad", "model.layers.0.self_attn.q_proj.weight"))
    assert last_layer < first_layer_grad
    host.close()


def test_no_device_tensor_reaches_the_optimizer():
    model = tiny_llama(seed=0)
    host = HostMaster(model, "galore", rank=4)
    device = {id(p) for p in model.parameters()}
    assert all(id(p) not in device for g in host.optimizer.param_groups for p in g["params"])
    assert sum(p.numel() for p in host.masters.values()) == sum(p.numel() for p in tiny_llama(seed=0).parameters())
    host.close()
