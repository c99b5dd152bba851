"""FSDP2 in this process (one rank, gloo): every method equals the unsharded optimizer; the portable state dict
and DCP checkpoints round-trip between a sharded and a plain model; TACO's packed max-loc keys order like
torch.argmax; unsupported layouts and stale load templates fail loudly. The multi-rank checks are in
tests/test_fsdp.py."""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "distributed"))

import common as C  # noqa: E402
from helpers import save_and_load  # noqa: E402

import slimopt  # noqa: E402
from slimopt.bench.fsdp_comm import CollectiveCounter, expected_bytes  # noqa: E402
from slimopt.optim.distributed import distcheckpoint, portable, sharded_taco  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402
from slimopt.train.process_group import init_process_group  # noqa: E402


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    init_process_group("gloo", store=store, rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


# A few cases run by default (this file stays within the per-file budget); the others are marked slow, and the
# multi-rank launch of tests/test_fsdp.py covers all of them anyway.
FAST = ("mixed_a", "mixed_b")  # between them: every projector, side, rule and codec
ALL_CASES = [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in C.CASES]


def _sharded(mesh, perturb=False):
    from torch.distributed.fsdp import fully_shard
    model = C.make_model()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(model):
    return {n: (p.full_tensor() if S.is_sharded(p) else p.detach()).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ALL_CASES)
def test_fsdp_on_one_rank_equals_one_process(mesh, case):
    ref = C.make_model()
    ref_opt = C.build(ref, case)
    model = _sharded(mesh)
    opt = C.build(model, case)
    assert all(S.is_sharded(p) for p in model.parameters())
    C.run_steps(ref, ref_opt, 1, C.K1 + C.K2)
    with CollectiveCounter() as counter:
        C.run_steps(model, opt, 1, C.K1 + C.K2)
    C.compare(_full(ref), model, opt, (1,), C.K1 + C.K2, f"{case} on one FSDP rank")
    assert counter.calls() == 0  # one rank: nothing to send
    assert expected_bytes(opt, 1, C.K1) == (0, 0)
    assert slimopt.state_nbytes(opt) == slimopt.state_nbytes(opt, total=True) == slimopt.state_nbytes(ref_opt)


@pytest.mark.parametrize("case", ALL_CASES)
def test_portable_state_dict_roundtrips_exactly_in_one_process(case):
    model = C.make_model()
    opt = C.build(model, case)
    C.run_steps(model, opt, 1, C.K1)
    with portable.portable_state(opt):
        sd = opt.state_dict()
    assert portable.is_portable(sd) and not portable.is_portable(opt.state_dict())
    sd = save_and_load(sd)
    twin = copy.deepcopy(model)
    twin_opt = C.build(twin, case)
    twin_opt.load_state_dict(sd)
    for (p, a), (q, b) in zip(opt.state.items(), twin_opt.state.items()):
        assert sorted(a) == sorted(b)
        for k in a:
            # ternary_ef's residual trits in a block's zero padding are drawn at random and never read
            same = torch.equal(a[k], b[k]) if not k.endswith("_err") else a[k].shape == b[k].shape
            assert a[k].dtype == b[k].dtype and same, (case, k)
    C.run_steps(model, opt, C.K1 + 1, C.K1 + C.K2)
    C.run_steps(twin, twin_opt, C.K1 + 1, C.K1 + C.K2)
    for x, y in zip(model.parameters(), twin.parameters()):
        if twin_opt.param_groups[0]["projector"] != "random":
            assert torch.equal(x, y), case


@pytest.mark.parametrize("case", ["mixed_a", "mixed_b"])
def test_dcp_checkpoint_moves_between_a_sharded_and_a_plain_model(mesh, tmp_path, case):
    model = _sharded(mesh)
    opt = C.build(model, case)
    C.run_steps(model, opt, 1, C.K1)
    distcheckpoint.save(tmp_path / "sharded", model, opt)
    plain = C.make_model()
    plain_opt = C.build(plain, case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to load in a single process"
        distcheckpoint.load(tmp_path / "sharded", plain, plain_opt)
    back = _sharded(mesh, perturb=True)
    back_opt = C.build(back, case)
    distcheckpoint.load(tmp_path / "sharded", back, back_opt)
    for m, o in ((model, opt), (plain, plain_opt), (back, back_opt)):
        C.run_steps(m, o, C.K1 + 1, C.K1 + C.K2)
    final = _full(model)
    C.compare(final, plain, plain_opt, (1,), C.K1 + C.K2, f"{case}: sharded -> plain")
    for name, t in _full(back).items():
        assert torch.equal(t, final[name]), (case, name)


def test_a_checkpoint_saved_before_the_first_step_resumes_like_a_fresh_start(tmp_path):
    model = C.make_model()
    opt = C.build(model, "galore")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        distcheckpoint.save(tmp_path / "step0", model, opt)
        twin = C.make_model()
        twin_opt = C.build(twin, "galore")
        distcheckpoint.load(tmp_path / "step0", twin, twin_opt)
    assert all(set(st) == {"step"} and st["step"] == 0 for st in twin_opt.state.values())
    C.run_steps(model, opt, 1, 3)
    C.run_steps(twin, twin_opt, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_stale_load_template_for_block_methods_fails_loudly(tmp_path):
    """torch's own recipe builds the load template with a zero-gradient step at step 1; FRUGAL's active blocks at
    the saved step differ, so loading through that template must fail, never drop moments silently."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    model = C.make_model()
    opt = C.build(model, "frugal")
    C.run_steps(model, opt, 1, 3)  # blocks of refresh period 1 are active
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        distcheckpoint.save(tmp_path / "frugal", model, opt)
        fresh = C.make_model()
        fresh_opt = C.build(fresh, "frugal")
        with portable.portable_state(fresh_opt):
            template = get_optimizer_state_dict(fresh, fresh_opt)  # step-1 blocks
        with pytest.raises((CheckpointException, ValueError), match="Missing key|no moments"):
            dcp.load({"optim": template}, checkpoint_id=str(tmp_path / "frugal"))
            set_optimizer_state_dict(fresh, fresh_opt, template)


def test_packed_keys_order_like_argmax_with_the_first_row_on_ties():
    gen = torch.Generator().manual_seed(0)
    g = torch.randint(-3, 4, (40, 25), generator=gen).float()  # many ties, zeros and -0.0
    g[5, 3] = -0.0
    rows = torch.arange(40).unsqueeze(1).expand(40, 25)
    keys = sharded_taco.pack_keys(g.abs(), rows, torch.signbit(g))
    best = keys.max(dim=0).values
    value, row, valid = sharded_taco.unpack_keys(best)
    assert valid.all()
    assert torch.equal(row, g.abs().argmax(dim=0))
    assert torch.equal(value, g.gather(0, row.unsqueeze(0))[0])
    v, r, ok = sharded_taco.unpack_keys(keys)
    assert torch.equal(r, rows) and torch.equal(v.view(torch.int32), g.view(torch.int32))  # -0.0 survives
    assert not sharded_taco.unpack_keys(torch.full((3,), -1, dtype=torch.int64))[2].any()


def test_placements_other_than_row_shards_are_refused(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    opt = slimopt.SlimOptimizer([w], lr=1e-2)
    w.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)])
    with pytest.raises(ValueError, match="sharded on dim 0"):
        opt.step()


def test_a_dtensor_parameter_needs_a_dtensor_gradient(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    opt = slimopt.SlimOptimizer([w], lr=1e-2)
    w.grad = torch.randn(8, 6)
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()



def test_layerwise_updates_work_on_fsdp2_parameters(mesh, tmp_path):
    # FSDP2 runs a sharded parameter's post-accumulate-grad hooks after its reduce-scatter, so layer-wise updates
    # step the sharded parameters; the worker's check (2 and 4 ranks in tests/test_fsdp.py), here on one rank
    import fsdp_worker
    fsdp_worker.phase_layerwise(str(tmp_path), mesh, 1, 0)
    assert set(json.loads((tmp_path / "report_layerwise_1.json").read_text()).values()) == {"equal"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [(40,), (20, 20), (14, 13, 13, 0)])
def test_taco_row_shards_step_as_one_weight(dtype, blocks):
    """TACO at one component a column on row shards, simulated without ranks (the MAX all-reduce is an element-wise
    max of every shard's keys): the C kernel's two calls (taco_shard_keys, taco_shard_step) and the tensor
    operations (sharded_taco.local_keys, finish_k1, apply_local) both equal one process's step (native.taco_one)
    bit for bit, the stored component the same on every shard, over steps that move it."""
    from slimopt.optim.algorithm import taco
    from slimopt.optim.distributed.shardcomm import Rows
    from slimopt.optim.routes.cpu import native
    if native.library() is None:
        pytest.skip("the C kernel could not be built here")
    m, n = sum(blocks), 24
    group = {"taco_decay": 0.5, "taco_alpha": 3.0, "taco_norm": "m/n", "taco_format": "fp8", "taco_scale_dtype": "bf16",
             "lr": 1e-2, "weight_decay": 0.1, "param_rounding": "nearest"}
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(m, n, generator=gen).to(dtype)
    bounds = [(sum(blocks[:i]), sum(blocks[:i + 1])) for i in range(len(blocks))]
    one = {k: v for k, v in taco.init_state((m, n), 1, "fp8", "bf16", "cpu").items()}
    kernel = [(whole[a:b].clone(), {k: v.clone() for k, v in one.items()}) for a, b in bounds]
    ops = [(whole[a:b].clone(), {k: v.clone() for k, v in one.items()}) for a, b in bounds]
    c = 3.0 * m / n
    for step in range(4):
        g = torch.randn(m, n, generator=gen).to(dtype)
        native.taco_one(whole, g, one, 0.5, 1e-2, 0.1, c)
        shards = [native.TacoShard(p, g[a:b], st, a) for (p, st), (a, b) in zip(kernel, bounds)]
        sent = [(s.keys(g[a:b]).clone(), s) for s, (a, b) in zip(shards, bounds)]
        # the keys travel as float64 and a float64 MAX orders them as integers
        assert all(k.dtype == torch.float64 and bool((k >= 0).all()) and bool(k.isfinite().all()) for k, _ in sent)
        reduced = torch.stack([k for k, _ in sent]).amax(0)
        assert torch.equal(reduced.view(torch.int64), torch.stack([k.view(torch.int64) for k, _ in sent]).amax(0))
        for (p, st), (_, shard) in zip(kernel, sent):
            assert shard.step(reduced, 0.5, 1e-2, 0.1, c) is None
        rows = [Rows(m, a, b, world=len(blocks)) for a, b in bounds]
        # each shard's whole record (what sharded_taco.record gathers): the kernel's state dicts here
        keys = [sharded_taco.local_keys(st, g[a:b], r) for (_, st), (a, b), r in zip(ops, bounds, rows)]
        for k, sent_k in zip(keys, sent):
            assert torch.equal(k, sent_k[0])
        reduced = torch.stack(keys).amax(0)
        for (p, st), r in zip(ops, rows):
            kept, signs, coef = sharded_taco.finish_k1(st, reduced, group, (m, n))
            sharded_taco.apply_local(p, kept, signs, coef, group, r)
        for shards in (kernel, ops):
            assert torch.equal(torch.cat([p for p, _ in shards]), whole), step
            for _, st in shards:
                for key in taco.KEYS:
                    assert torch.equal(st[key].view(torch.uint8) if st[key].dtype == torch.float8_e4m3fn else
                                       st[key], one[key].view(torch.uint8) if one[key].dtype == torch.float8_e4m3fn
                                       else one[key]), (step, key)
