"""Host masters stepped during the backward pass (slimopt.weights.masters): on a CPU, where the device is the
host, the run equals the same model stepped after its backward pass by one optimizer over the same masters, bit
for bit, for every kind of state; the event log shows steps starting before the backward pass is over."""

import gc

import pytest
import torch
from helpers import batches, tiny_llama

from slimopt.optim.optimizer import SlimOptimizer
from slimopt.optim.recipes import param_groups
from slimopt.train.vocab_chunked_loss import causal_lm_loss
from slimopt.weights.convert import to_int8
from slimopt.weights.int8_embedding import Int8Embedding
from slimopt.weights.int8_layer import Int8Weight
from slimopt.weights.int8_linear import Int8Linear, Int8TiedLinear
from slimopt.weights.masters import MasterWeights, joined_master, split_master

METHODS = {
    "adamw": {},
    "adamw8bit": {},
    "galore": {"rank": 4, "update_gap": 2},
    "frugal": {"density": 0.5, "update_gap": 2},
    "ternary_adamw": {},
    "taco": {},
}


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _sliced_loss(model, ids):  # the output layer's gradient 24 of its 64 rows at a time
    return causal_lm_loss(model, ids, slice_rows=24)


def _model(tied=False):
    model = tiny_llama(seed=0)
    if tied:  # the output layer tied to the input embedding, as SmolLM2's
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _reference(method, settings, data, accumulation=1, loss_fn=_hf_loss, through=None, embeddings=False,
               tied=False):
    """int8 weights and fp32 masters, one optimizer.step() after each window's backward passes, then requantize.
    through: what each master's value becomes at the start and after each step (a master form's rounding)."""
    model = _model(tied)
    groups = param_groups(model, method, **settings)
    names = {id(p): n for n, p in model.named_parameters()}
    masters = dict(to_int8(model, 0, torch.float32, embeddings=embeddings))
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
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Int8Weight)}

    def store():
        with torch.no_grad():
            for name, master in masters.items():
                if through is not None:
                    master.copy_(through(master))
                layers[name].load_weight(master) if name in layers else device[name].copy_(master)

    if through is not None:
        store()
    losses = []
    for k, ids in enumerate(data):
        loss = loss_fn(model, ids) / accumulation
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
        store()
    return model, masters, losses


def _offloaded(method, settings, data, accumulation=1, overlap=False, record=False, master="fp32",
               loss_fn=_hf_loss, embeddings=False, tied=False):
    model = _model(tied)
    host = MasterWeights(model, method, accumulation_steps=accumulation, overlap=overlap, record=record,
                         master=master, int8_embeddings=embeddings, **settings)
    losses = []
    for ids in data:
        loss = loss_fn(model, ids) / accumulation
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


@pytest.mark.parametrize("method", ["adamw", "galore", "ternary_adamw"])
def test_int8_embeddings_run_equals_the_step_after_backward(method):
    data = batches(3, seed=6)
    ref_model, ref_masters, ref_losses = _reference(method, METHODS[method], data, embeddings=True)
    model, host, losses = _offloaded(method, METHODS[method], data, embeddings=True)
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert losses == ref_losses and host.steps == 3
    for name, master in host.masters.items():
        assert torch.equal(master, ref_masters[name]), name
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name  # the embedding's and the output layer's codes and scales too


@pytest.mark.parametrize("method", ["adamw", "frugal", "ternary_adamw"])
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_a_tied_int8_embedding_run_equals_the_step_after_backward(method, overlap):
    """The output layer tied to the int8 embedding (one table, one master, both gradients into it): the run equals
    the reference's, with the output layer computing from the table each step writes."""
    data = batches(3, seed=7)
    ref_model, ref_masters, ref_losses = _reference(method, METHODS[method], data, embeddings=True, tied=True)
    model, host, losses = _offloaded(method, METHODS[method], data, embeddings=True, tied=True, overlap=overlap)
    assert isinstance(model.get_output_embeddings(), Int8TiedLinear)
    assert "lm_head.weight" not in host.masters and "model.embed_tokens.weight" in host.masters
    assert losses == ref_losses and host.steps == 3 and losses[-1] < losses[0]
    for name, master in host.masters.items():
        assert torch.equal(master, ref_masters[name]), name
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name
    plain = host.plain_state_dict(model, torch.float32)  # what save_pretrained writes: the table from its master
    assert torch.equal(plain["model.embed_tokens.weight"], host.masters["model.embed_tokens.weight"])
    host.close()


def test_accumulation_and_the_inline_mode_agree_with_the_reference():
    data = batches(4, seed=6)
    _, ref_masters, ref_losses = _reference("adamw8bit", {}, data, accumulation=2)
    _, host, losses = _offloaded("adamw8bit", {}, data, accumulation=2)
    assert losses == ref_losses and host.steps == 2
    assert all(torch.equal(m, ref_masters[n]) for n, m in host.masters.items())
    host.close()


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "dtype-weights"])
def test_the_worker_thread_makes_the_inline_updates(int8):
    """overlap=True steps on a worker thread while the backward pass goes on: the same losses, masters, int8 codes
    and device weights as the inline run, bit for bit, over repeated short trainings collected between (a worker
    that dropped a master's .grad itself once corrupted the heap here: docs/offload.md)."""
    for seed in range(3):
        data = batches(3, seed=seed)
        runs = []
        for overlap in (False, True):
            model = tiny_llama(seed=0)
            host = MasterWeights(model, "adamw8bit", int8=int8, overlap=overlap)
            losses = []
            for ids in data:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
            host.synchronize()
            runs.append((losses, {n: m.detach().clone() for n, m in host.masters.items()},
                         {k: v.clone() for k, v in model.state_dict().items()}))
            host.close()
            del host, model
            gc.collect()
        (la, ma, sa), (lb, mb, sb) = runs
        assert la == lb
        assert all(torch.equal(ma[n], mb[n]) for n in ma)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("accumulation,overlap", [(1, False), (2, False), (1, True)])
def test_the_output_layers_gradient_leaves_a_slice_at_a_time(accumulation, overlap):
    """Under the vocabulary-sliced loss the output layer's gradient reaches its master a slice of rows at a time
    (weights/row_grads.py) and is never whole on the device; the run equals the step after backward bit for bit,
    with gradient accumulation and on the worker thread."""
    data = batches(4, seed=10)
    _, ref_masters, ref_losses = _reference("adamw8bit", {}, data, accumulation, loss_fn=_sliced_loss)
    model, host, losses = _offloaded("adamw8bit", {}, data, accumulation, overlap=overlap, record=True,
                                     loss_fn=_sliced_loss)
    assert losses == ref_losses and host.steps == 4 // accumulation
    assert all(torch.equal(m, ref_masters[n]) for n, m in host.masters.items())
    head = [what for _, what, name in host.events if name == "lm_head.weight"]
    assert head.count("grad rows") == 3 * 4 and "grad" not in head  # 64 rows: 24, 24, 16 in each of 4 passes
    assert model.lm_head.weight.grad is None
    host.close()


def test_a_split_master_keeps_an_fp32_weight_to_one_residual_step():
    """bf16+int8: the bf16 rounding of the weight and the residual in int8 steps of 2^-8 of its ulp; the joined
    value is high + residual * step exactly, within one step of the weight, and splits again into the same parts."""
    torch.manual_seed(0)
    x = (torch.randn(200, 3000) * torch.logspace(-35, 30, 3000)).float()
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-42, 3.0e38])
    high, residual = split_master(x)
    joined = joined_master(high, residual)
    assert high.dtype == torch.bfloat16 and residual.dtype == torch.int8 and joined.dtype == torch.float32
    assert torch.equal(high, x.to(torch.bfloat16)) and int(residual.min()) >= -127
    wide = high.double()
    step = torch.where(wide != 0, 2.0 ** (torch.floor(torch.log2(wide.abs())) - 15), 2.0 ** -16)
    exact = torch.where(step >= 2.0 ** -149, wide + residual.double() * step, wide)  # fp32 holds the step
    assert torch.equal(joined.double(), exact)
    normal = x.abs() >= 2.0 ** -111  # below, the step underflows fp32 and the value keeps bf16's precision
    assert bool(((joined.double() - x.double()).abs() <= step)[normal].all())
    assert bool(((joined.double() - x.double()).abs() <= (high.double() - x.double()).abs()).all())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(split_master(joined), (high, residual)))
    big = split_master(torch.full((3,), float("inf")))
    assert torch.isinf(joined_master(*big)).all() and not big[1].any()


@pytest.mark.parametrize("method", ["adamw8bit", "galore"])
def test_a_bf16_int8_master_steps_as_fp32_and_keeps_three_bytes(method):
    """master="bf16+int8" equals fp32 masters whose values go through the split after each step, bit for bit
    (losses, masters, int8 codes and device weights); between steps a master holds its two parts only."""
    data = batches(4, seed=11)
    ref_model, ref_masters, ref_losses = _reference(method, METHODS[method], data,
                                                    through=lambda m: joined_master(*split_master(m)))
    model, host, losses = _offloaded(method, METHODS[method], data, master="bf16+int8")
    assert losses == ref_losses and host.steps == 4
    assert all(torch.equal(host.value(n), ref_masters[n]) for n in host.masters)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name
    held = sum(h.nbytes + r.nbytes for h, r in host._parts.values())
    assert held == 3 * sum(m.numel() for m in host.masters.values())
    assert all(m.untyped_storage().nbytes() == 4 for m in host.masters.values())  # a stand-in between steps
    host.close()


def test_steps_start_while_the_backward_pass_runs():
    """The last layer's weights step before the first layer's gradients exist (inline: deterministically)."""
    _, host, _ = _offloaded("adamw", {}, batches(2, seed=7), overlap=False, record=True)
    first_window = host.events[: len(host.events) // 2]
    order = [(what, name) for _, what, name in first_window]
    last_layer = order.index(("step", "model.layers.1.mlp.down_proj.weight"))
    first_layer_grad = order.index(("grad", "model.layers.0.self_attn.q_proj.weight"))
    assert last_layer < first_layer_grad
    host.close()


def test_no_device_tensor_reaches_the_optimizer():
    model = tiny_llama(seed=0)
    host = MasterWeights(model, "galore", rank=4)
    device = {id(p) for p in model.parameters()}
    assert all(id(p) not in device for g in host.optimizer.param_groups for p in g["params"])
    assert sum(p.numel() for p in host.masters.values()) == sum(p.numel() for p in tiny_llama(seed=0).parameters())
    host.close()


def _clipped_reference(data, clip, mode):
    """adamw with host masters stepped after backward, the gradients clipped as each mode says."""
    model = tiny_llama(seed=0)
    host = MasterWeights(model, "adamw", overlap=False)
    host.close()  # hooks off: this reference moves the gradients and steps by hand
    masters, layers, device = host.masters, host._layers, host._device_param
    previous = None
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        for name, p in device.items():
            masters[name].grad, p.grad = p.grad.float(), None
        for name, layer in layers.items():
            masters[name].grad = masters[name].grad  # delivered by the layer's default sink
        ordered = list(masters.values())
        if mode == "hold" or previous is None:
            norm = float(torch.nn.utils.clip_grad_norm_(ordered, clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(m.grad, dtype=torch.float32) for m in ordered])))
            coef = min(1.0, clip / (previous + 1e-6))
            for m in ordered:
                m.grad.mul_(coef) if coef < 1.0 else None
        previous = norm
        host.optimizer.step()
        host.optimizer.zero_grad()
        with torch.no_grad():
            for name, master in masters.items():
                layers[name].load_weight(master) if name in layers else device[name].copy_(master)
    return masters


@pytest.mark.parametrize("mode", ["hold", "previous"])
def test_clipping_modes(mode):
    data = batches(3, seed=8)
    ref = _clipped_reference(data, 0.5, mode)
    model = tiny_llama(seed=0)
    host = MasterWeights(model, "adamw", clip=0.5, clip_mode=mode)
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
    host.synchronize()
    assert host.last_grad_norm > 0.5  # the limit bites
    for name, master in host.masters.items():
        torch.testing.assert_close(master, ref[name], rtol=0, atol=1e-6 if mode == "previous" else 0)
    host.close()


def test_the_gradient_norm_is_measured_without_clipping():
    """last_grad_norm is the window's global gradient norm with no clip set too (what a training loop logs):
    the norm clip_grad_norm_ returns over the same gradients, accumulated over the window's backward passes."""
    data = batches(2, seed=8)
    model, twin = tiny_llama(seed=0), tiny_llama(seed=0)
    host = MasterWeights(model, "adamw", accumulation_steps=2)
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        twin(input_ids=ids, labels=ids).loss.backward()
    host.synchronize()
    expected = float(torch.nn.utils.clip_grad_norm_(list(twin.parameters()), float("inf")))
    assert host.last_grad_norm == pytest.approx(expected, rel=1e-5)
    host.close()


@pytest.mark.parametrize("master", ["fp32", "bf16+int8"])
def test_resume_continues_identically(master, tmp_path):
    data = batches(4, seed=9)
    model = tiny_llama(seed=0)
    host = MasterWeights(model, "adamw8bit", clip=1.0, master=master)
    for ids in data[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
    torch.save(host.state_dict(), tmp_path / "host.pt")
    for ids in data[2:]:
        model(input_ids=ids, labels=ids).loss.backward()
    host.synchronize()

    fresh = tiny_llama(seed=1)  # other weights: the checkpoint's masters must overwrite them
    resumed = MasterWeights(fresh, "adamw8bit", clip=1.0, master=master)
    resumed.load_state_dict(torch.load(tmp_path / "host.pt", weights_only=True))
    for ids in data[2:]:
        fresh(input_ids=ids, labels=ids).loss.backward()
    resumed.synchronize()
    assert resumed.steps == host.steps == 4
    assert all(torch.equal(resumed.value(n), host.value(n)) for n in resumed.masters)
    for (name, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="masters do not match"):
        MasterWeights(tiny_llama(seed=0, layers=1), "adamw8bit").load_state_dict(host.state_dict())
    other = "fp32" if master == "bf16+int8" else "bf16+int8"
    with pytest.raises(ValueError, match="resume with the --master it was saved with"):
        MasterWeights(tiny_llama(seed=0), "adamw8bit", master=other).load_state_dict(host.state_dict())
    host.close()
    resumed.close()


def test_the_host_master_forms_are_the_ones_masterweights_keeps():
    from slimopt.factory import HOST_MASTERS
    from slimopt.weights.masters import MASTERS

    assert set(HOST_MASTERS) == set(MASTERS) - {"none"}


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="clip_mode"):
        MasterWeights(tiny_llama(seed=0), "adamw", clip=1.0, clip_mode="later")
    with pytest.raises(ValueError, match="clip must be"):
        MasterWeights(tiny_llama(seed=0), "adamw", clip=-1)
    with pytest.raises(ValueError, match="accumulation_steps"):
        MasterWeights(tiny_llama(seed=0), "adamw", accumulation_steps=0)


def test_in_place_int8_keeps_no_wide_copy_and_trains():
    """master="none": the int8 weight is its own master; between steps its parameter holds one element."""
    model, host, losses = _offloaded("adamw", {"lr": 3e-3}, [batches(1, seed=3)[0]] * 25, master="none")
    layers = host._layers
    assert layers and all(host.masters[n].stride() == (0, 0) for n in layers)
    assert all(host.masters[n].untyped_storage().nbytes() == 4 for n in layers)
    assert all(host.optimizer.state[host.masters[n]]["exp_avg"].shape == host.masters[n].shape for n in layers)
    assert losses[-1] < losses[0] - 0.3
    again = _offloaded("adamw", {"lr": 3e-3}, [batches(1, seed=3)[0]] * 25, master="none")[0]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    host.close()


def test_in_place_rounding_is_stochastic_so_small_updates_survive():
    """Updates far below half a code step: nearest rounding would never move the int8 weight; stochastic
    rounding moves it by the updates on average (Q-GaLore's reason, arXiv 2407.08296). Column 0 holds each row's
    absmax and gets no gradient, so the scales stay fixed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight[:, 0] = 0.5
    host = MasterWeights(model, "adamw", master="none", lr=1e-4, weight_decay=0.0)
    layer = host._layers["0.weight"]
    before, scale = layer.dequantized_weight(), layer.weight_scale.clone()
    x = torch.randn(16, 64)
    x[:, 0] = 0
    for _ in range(20):
        layer(x).sum().backward()  # the same gradient each step: Adam moves every weight by lr a step
    assert torch.equal(layer.weight_scale, scale) and 1e-4 < 0.1 * scale.min().item()
    moved = (layer.dequantized_weight() - before)[:, 1:].abs().mean().item()
    assert 0.5 * 20 * 1e-4 < moved < 2 * 20 * 1e-4
    host.close()


def test_in_place_resume_continues_identically(tmp_path):
    data = batches(4, seed=10)
    model, host, _ = _offloaded("adamw8bit", {}, data[:2], master="none")
    torch.save(host.state_dict(), tmp_path / "s.pt")
    for ids in data[2:]:
        model(input_ids=ids, labels=ids).loss.backward()
    fresh = tiny_llama(seed=3)
    resumed = MasterWeights(fresh, "adamw8bit", master="none")
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    for ids in data[2:]:
        fresh(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    host.close()
    resumed.close()


def test_slimopt_build_places_the_weights_and_steps_in_the_backward_pass():
    import slimopt

    model = tiny_llama(seed=0)
    opt = slimopt.build(model, "adamw8bit", weights="int8", offload="host", accumulation_steps=1)
    assert isinstance(opt, MasterWeights) and not opt.in_place
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.front, lambda s: 0.5)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    assert opt.steps == 1 and slimopt.state_nbytes(opt) > 0
    in_place = slimopt.build(tiny_llama(seed=0), "adamw", weights="int8")
    assert in_place.in_place
    assert type(slimopt.build(tiny_llama(seed=0), "adamw")).__name__ == "SlimOptimizer"
    with pytest.raises(ValueError, match="weights must be one of"):
        slimopt.build(tiny_llama(seed=0), "adamw", weights="int4")
    with pytest.raises(ValueError, match="offload must be one of"):
        slimopt.build(tiny_llama(seed=0), "adamw", offload="disk")
    with pytest.raises(ValueError, match="clip apply with"):
        slimopt.build(tiny_llama(seed=0), "adamw", clip=1.0)
    opt.close()
    in_place.close()
