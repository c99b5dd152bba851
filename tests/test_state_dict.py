"""state_dict: tensors only, loads with weights_only=True, keeps codec dtypes, continues bit-identically."""

import copy
import pickle

import pytest
import torch
from helpers import assert_continues_identically, backward, batches, save_and_load, tiny_llama

import slimopt

SETTINGS = [
    dict(projector="none"),
    dict(projector="svd", rank=3, free_rule="sign"),
    dict(projector="randomized_svd", rank=3, on_refresh="project"),
    dict(projector="random", density=0.25, on_refresh="reset", free_rule="sgd"),
    dict(projector="columns", density=0.5, free_rule="sign"),
    dict(projector="rows", rank=4, on_refresh="project"),
    dict(projector="block", density=0.5, block_order="random", free_rule="sign", on_refresh="reset"),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s["projector"])
def test_roundtrip_continues_bit_identically(settings):
    model = tiny_llama()
    data = batches(10)
    opt = slimopt.SlimOptimizer(model.parameters(), lr=1e-2, update_gap=3, weight_decay=0.01, **settings)
    for ids in data[:5]:
        backward(model, ids)
        opt.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = save_and_load(opt.state_dict())
    for st in saved_opt["state"].values():
        assert all(isinstance(v, torch.Tensor) for v in st.values())

    clone = tiny_llama()
    clone.load_state_dict(saved_model)
    opt2 = slimopt.SlimOptimizer(clone.parameters(), lr=1e-2, update_gap=3, weight_decay=0.01, **settings)
    opt2.load_state_dict(saved_opt)
    assert_continues_identically(model, opt, clone, opt2, data[5:])  # crosses a refresh at step 7 and 10


def test_build_roundtrip_and_dtypes_are_preserved_for_bf16_params():
    model = tiny_llama(dtype=torch.bfloat16)
    opt = slimopt.build(model, "galore", rank=4, update_gap=2)
    for ids in batches(3):
        backward(model, ids)
        opt.step()
    sd = save_and_load(opt.state_dict())
    dtypes = {(i, k): v.dtype for i, st in sd["state"].items() for k, v in st.items()}
    fresh = slimopt.build(tiny_llama(dtype=torch.bfloat16), "galore", rank=4, update_gap=2)
    fresh.load_state_dict(sd)
    params = [p for g in fresh.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        for k, v in fresh.state[p].items():
            assert v.dtype == dtypes[(i, k)], (i, k)  # torch would cast fp32 state to bf16
    assert any(d == torch.float32 for (i, k), d in dtypes.items() if k == "moment_step")
    assert [g["name"] for g in fresh.param_groups] == [g["name"] for g in opt.param_groups]


def test_a_deep_copy_or_a_pickle_of_the_optimizer_continues_as_the_original():
    # torch.optim.Optimizer's copy keeps defaults, state and groups; the caches are derived anew (a planned kernel
    # step is made again for the copy's own state tensors, never written through the original's)
    def grads(step, ws):
        gen = torch.Generator().manual_seed(step)
        for w in ws:
            w.grad = torch.randn(w.shape, generator=gen).to(w.dtype)

    ws = [torch.nn.Parameter(torch.randn(64, 96).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(300))]
    opt = slimopt.SlimOptimizer(ws, lr=1e-2, state_bits=8, weight_decay=0.1)
    for step in range(2):
        grads(step, ws)
        opt.step()
    copies = [copy.deepcopy((ws, opt)), pickle.loads(pickle.dumps((ws, opt)))]
    for step in range(2, 4):
        for cws, copt in [(ws, opt)] + copies:
            grads(step, cws)
            copt.step()
    for cws, copt in copies:
        for a, b in zip(ws, cws):
            assert torch.equal(a, b)
            assert all(torch.equal(opt.state[a][k], copt.state[b][k]) for k in opt.state[a])
            assert opt.state[a]["exp_avg"].data_ptr() != copt.state[b]["exp_avg"].data_ptr()
