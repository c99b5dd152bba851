"""int8 device weights (slimopt.weights, optim/algorithm/int8_weight.py): the quantizer against a plain loop, the
layer against nn.Linear and the embedding against nn.Embedding on the dequantized weight (bit for bit, both
passes), and a model converted with its masters trained by an optimizer."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, tiny_llama

from slimopt.optim.algorithm import int8_weight
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.weights.convert import int8_weights, to_int8
from slimopt.weights.int8_embedding import Int8Embedding
from slimopt.weights.int8_linear import Int8Linear, Int8TiedLinear


def _loop_quantize(w: torch.Tensor, group: int, u: torch.Tensor | None = None):
    """The format, element by element: scale = absmax / 127 of each row (group 0) or group; code = round(w /
    scale), ties to even, or floor(w / scale + u)."""
    rows, cols = w.shape
    width = cols if group == 0 else group
    groups = math.ceil(cols / width)
    codes = torch.zeros(rows, cols, dtype=torch.int8)
    scales = torch.zeros(rows, groups)
    for i in range(rows):
        for g in range(groups):
            part = w[i, g * width:(g + 1) * width].float()
            scale = part.abs().max() / 127
            scales[i, g] = scale
            for j in range(part.numel()):
                x = part[j] / scale.clamp_min(torch.finfo(torch.float32).tiny)
                x = torch.round(x) if u is None else torch.floor(x + u[i, g * width + j])
                codes[i, g * width + j] = int(x.clamp(-127, 127))
    return codes, scales


@pytest.mark.parametrize("group", [0, 4, 5, 7, 64])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantizer_equals_a_plain_loop(group, stochastic):
    w = torch.randn(6, 20, dtype=torch.bfloat16)
    w[2] = 0  # an all-zero row: scale 0, codes 0
    w[3, 5] = 2.5 * w[3].abs().max()  # one outlier sets its group's scale
    stream = CounterStream(key=12345, offset=3) if stochastic else None
    u = stream.uniform((6, 20), "cpu") if stochastic else None
    codes, scales = int8_weight.quantize(w, group, noise=stream)
    want_codes, want_scales = _loop_quantize(w, group, u)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    back = int8_weight.dequantize(codes, scales, group)
    width = 20 if group == 0 else group
    per_elem_scale = scales.repeat_interleave(width, dim=1)[:, :20]
    assert torch.equal(back, codes.float() * per_elem_scale)
    assert (back - w.float()).abs().le(per_elem_scale * (1.0 if stochastic else 0.5) + 1e-7).all()


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    w = torch.full((1, 4096), 0.3)
    w[0, 0] = 127 * 0.25  # scale 0.25: 0.3 lies 1/5 of the way from code 1 to code 2
    mean = sum(int8_weight.dequantize(*int8_weight.quantize(w, noise=CounterStream(k)))[0, 1:].mean()
               for k in range(20)) / 20
    assert abs(mean.item() - 0.3) < 0.002
    assert int8_weight.dequantize(*int8_weight.quantize(w))[0, 1].item() == 0.25


def test_bad_groups_and_shapes_are_named():
    with pytest.raises(ValueError, match="int8_group"):
        int8_weight.quantize(torch.ones(2, 2), -1)
    with pytest.raises(ValueError, match="int8_group"):
        Int8Linear(4, 4, group=True)
    with pytest.raises(ValueError, match="matrix"):
        int8_weight.quantize(torch.ones(4))
    codes, scales = int8_weight.quantize(torch.ones(2, 10), 4)
    with pytest.raises(ValueError, match="do not fit"):
        int8_weight.dequantize(codes, scales, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_equals_linear_on_the_dequantized_weight(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 16).to(dtype)
    layer = Int8Linear.from_linear(linear, group=8)
    assert [n for n, _ in layer.named_parameters()] == ["bias"]  # the master is not the module's
    assert layer.master.dtype == torch.float32 and torch.equal(layer.master, linear.weight.float())
    x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    weight = layer.dequantized_weight(dtype).requires_grad_()
    bias = linear.bias.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), F.linear(x_ref, weight, bias)
    assert torch.equal(y, y_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(layer.bias.grad, bias.grad)
    assert torch.equal(layer.master.grad, weight.grad.float())
    layer(x).backward(grad)  # a second micro-batch adds into the master's gradient
    assert torch.equal(layer.master.grad, weight.grad.float() * 2)


def test_a_sink_takes_the_gradient_instead_of_the_master():
    layer = Int8Linear.from_linear(torch.nn.Linear(8, 4, bias=False))
    seen = []
    layer.grad_sink = seen.append
    layer(torch.randn(2, 8)).sum().backward()
    assert layer.master.grad is None and len(seen) == 1 and seen[0].shape == (4, 8)


def test_a_converted_llama_computes_as_its_dequantized_twin_and_trains():
    torch.manual_seed(0)
    model, twin = tiny_llama(seed=0), tiny_llama(seed=0)
    names = [n for n, _ in int8_weights(model)]
    assert names and all(n.startswith("model.layers.") for n in names)  # the body's projections, not lm_head
    masters = to_int8(model, group=16)
    assert [n for n, _ in masters] == names
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    for name, layer in layers.items():
        twin.get_submodule(name).weight.data.copy_(layer.dequantized_weight())
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    twin_loss = twin(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, twin_loss)
    loss.backward()
    twin_loss.backward()
    for name, master in masters:
        assert torch.equal(master.grad, twin.get_submodule(name.removesuffix(".weight")).weight.grad)

    for p in model.parameters():  # the masters alone train: the first layer's input then needs no grad
        p.requires_grad_(False)
    opt = torch.optim.AdamW([m for _, m in masters], lr=3e-3)
    opt.zero_grad()
    first = None
    ids = batches(1, seed=3)[0]
    for _ in range(30):  # one batch memorized: the loss falls only if the requantized masters move the weights
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        for name, master in masters:  # the master's new value, requantized for the next forward pass
            layers[name.removesuffix(".weight")].load_weight(master)
        first = loss.item() if first is None else first
    assert loss.item() < first - 0.3


def test_tied_weights_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="tied"):
        to_int8(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_equals_nn_embedding_on_the_dequantized_table(dtype, padding_idx):
    torch.manual_seed(1)
    table = torch.nn.Embedding(50, 16, padding_idx=padding_idx).to(dtype)
    layer = Int8Embedding.from_embedding(table)
    twin = torch.nn.Embedding(50, 16, padding_idx=padding_idx).to(dtype)
    twin.weight.data = layer.dequantized_weight(dtype)
    ids = torch.randint(0, 50, (4, 300))
    ids[0, :9] = 3  # a repeated row, and the padding row where there is one
    grad = torch.randn(4, 300, 16).to(dtype)
    out, twin_out = layer(ids), twin(ids)
    assert out.dtype == dtype and torch.equal(out, twin_out)
    out.backward(grad)
    twin_out.backward(grad)
    assert torch.equal(layer.master.grad, twin.weight.grad.float())  # the master is fp32
    if padding_idx is not None:
        assert not layer.master.grad[padding_idx].any()


def _computes_as_its_twin(model, twin, masters):
    """The twin (the model before to_int8) given the int8 layers' dequantized weights: the same loss, and each
    master's gradient its weight's."""
    for name, module in model.named_modules():
        if isinstance(module, (Int8Linear, Int8Embedding)):
            twin.get_submodule(name).weight.data.copy_(module.dequantized_weight())
    ids = batches(1)[0]
    loss, twin_loss = model(input_ids=ids, labels=ids).loss, twin(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, twin_loss)
    loss.backward()
    twin_loss.backward()
    for name, master in masters:
        assert torch.equal(master.grad, twin.get_submodule(name.removesuffix(".weight")).weight.grad), name


def test_a_llama_with_int8_embeddings_computes_as_its_dequantized_twin():
    model, twin = tiny_llama(seed=0), tiny_llama(seed=0)
    names = [n for n, _ in int8_weights(model, embeddings=True)]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    masters = to_int8(model, group=16, embeddings=True)
    assert [n for n, _ in masters] == names
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(emb, Int8Embedding) and isinstance(head, Int8Linear)
    assert head.group == 0 and emb.group == 0 and head.weight_scale.shape == (head.out_features, 1)
    _computes_as_its_twin(model, twin, masters)


def test_embeddings_that_int8_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="max_norm"):
        Int8Embedding.from_embedding(torch.nn.Embedding(10, 4, max_norm=1.0))
    with pytest.raises(ValueError, match="sparse"):
        Int8Embedding.from_embedding(torch.nn.Embedding(10, 4, sparse=True))
    with pytest.raises(ValueError, match="padding_idx"):
        Int8Embedding(10, 4, padding_idx=10)
    model = tiny_llama(seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's: without the embeddings in int8
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight  # the body's two sinks
    with pytest.raises(ValueError, match="tied"):
        to_int8(model, embeddings=True)


def _tied(model):
    model.lm_head.weight = model.model.embed_tokens.weight  # as SmolLM2 ties them
    return model


def test_an_output_layer_tied_to_the_int8_embedding_computes_with_its_table():
    """One table, one master: the output layer computes with the embedding's codes and scales, and the master's
    gradient is the output layer's part plus the embedding's, as the tied twin's weight gradient."""
    model, twin = _tied(tiny_llama(seed=0)), _tied(tiny_llama(seed=0))
    masters = to_int8(model, embeddings=True)
    assert next(n for n, _ in masters) == "model.embed_tokens.weight"
    assert "lm_head.weight" not in dict(masters) and len(masters) == len(int8_weights(twin, embeddings=True))
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, Int8TiedLinear) and head.owner is emb and isinstance(emb, Int8Embedding)
    assert not any(k.startswith("lm_head") for k in model.state_dict())  # the table is the embedding's
    assert twin.lm_head.weight is twin.model.embed_tokens.weight  # the twin's gradient holds both parts too
    _computes_as_its_twin(model, twin, masters)
    # the head's part is in: the embedding's alone would leave the rows of unseen tokens at zero
    assert dict(masters)["model.embed_tokens.weight"].grad.abs().sum(1).gt(0).all()
