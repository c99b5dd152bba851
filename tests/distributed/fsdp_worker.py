"""FSDP2 checks of every slimopt method, run under torchrun (gloo, CPU); tests/test_fsdp.py launches it.

    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT tests/distributed/fsdp_worker.py \
        --phase save --out DIR
    python -m torch.distributed.run --nproc_per_node 4 --master_port PORT tests/distributed/fsdp_worker.py \
        --phase load --out DIR

Phase ``save`` (any world size), for every case of common.CASES:
  1. K1 steps under FSDP2 equal K1 steps in one process on the same gradients (common.exactness says which
     parameters must be bit-identical);
  2. the collectives counted at a plain step and at a refresh step equal ``fsdp_comm.expected_bytes``;
  3. the replicated state (bases, coordinates, TACO's history, steps) and the set of state keys (which blocks
     are active) agree on every rank, gathered;
  4. ``state_nbytes`` per rank is the bytes of the local tensors, and ``total=True`` is their sum over ranks;
  5. a DCP checkpoint (``distcheckpoint.save``) goes to DIR/<case>; K2 more steps still match one process; the
     uninterrupted final parameters go to DIR/<case>.final.pt;
  6. a fresh model and optimizer loading DIR/<case> at the same world size continue bit-identically.
  7. layer-wise updates (``slimopt.optim.layerwise``, the optimizer stepping each sharded parameter from its
     post-accumulate-grad hook, which FSDP2 runs after its reduce-scatter) give the same parameters as
     ``optimizer.step()`` under the same FSDP2 sharding, with and without gradient accumulation, on a small MLP
     trained with real backward passes (LAYERWISE_CASES; DIR/report_layerwise_<world>.json).
Phase ``load`` (another world size): load DIR/<case>, continue K2 steps (a refresh among them) and compare with the
saved uninterrupted run, which equals one process: exact where the method's step does not depend on the world
size (common.exactness); then 3 and 4 again; and, at an even world size above 2, HSDP (replicated over 2 groups,
sharded within each) equals one process.
Any failed check raises, which ends the launch with a nonzero exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402
from slimopt.bench.fsdp_comm import CollectiveCounter, expected_bytes  # noqa: E402
from slimopt.optim.algorithm import taco  # noqa: E402
from slimopt.optim.distributed import distcheckpoint  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fresh_sharded(mesh, perturb: bool = False):
    model = C.make_model()
    if perturb:  # a model a checkpoint must overwrite
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return shard(model, mesh)


full_params = C.full_params


REPLICATED = ("step", "moment_step", "proj_index")  # and "proj" or TACO's history where layout_of says so


def _as_bytes(t: torch.Tensor):
    """(dtype, shape, raw bytes): picklable for every dtype (fp8 tensors are not), compared bit for bit."""
    return str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def check_agreement(model, opt, world: int, what: str) -> int:
    """Gather every rank's replicated state and state key sets; all must equal rank 0's. Returns tensors compared."""
    owner = {id(p): g for g in opt.param_groups for p in g["params"]}
    mine = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        group = owner[id(p)]
        keys = list(REPLICATED)
        from slimopt.optim.distributed import portable
        keys += [k for k in ("proj",) + taco.KEYS if k in st and portable.layout_of(opt, p, group, k) == "replicated"]
        mine[name] = {"keys": sorted(st), **{k: _as_bytes(st[k]) for k in keys if k in st}}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    count = 0
    for r, theirs in enumerate(everyone):
        for name, entries in mine.items():
            for k, v in entries.items():
                other = theirs[name][k]
                same = v == other if k == "keys" else (v[:2] == other[:2] and torch.equal(v[2], other[2]))
                if not same:
                    raise AssertionError(f"{what}: rank {r} disagrees on {name}.{k}")
                count += 1
    return count


def check_nbytes(opt, world: int, what: str) -> None:
    local = 0
    for st in opt.state.values():
        for v in st.values():
            t = v.to_local() if S.is_sharded(v) else v
            local += t.numel() * t.element_size()
    per_rank = slimopt.state_nbytes(opt)
    total = slimopt.state_nbytes(opt, total=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, per_rank)
    if per_rank != local or total != sum(everyone):
        raise AssertionError(f"{what}: state_nbytes {per_rank} (local tensors {local}), total {total} "
                             f"(sum over ranks {sum(everyone)})")


def counted_step(model, opt, step: int, world: int, case: str) -> dict:
    C.set_grads(model, step)
    per_step, refresh = expected_bytes(opt, world, step)  # predicted from the state before the step
    with CollectiveCounter() as counter:
        opt.step()
    opt.zero_grad(set_to_none=True)
    got = counter.total_bytes()
    if got != per_step + refresh:
        raise AssertionError(f"{case}: step {step} communicated {got} bytes in {counter.calls()} calls; "
                             f"expected {per_step} + {refresh} (refresh)")
    return {"step": step, "counted": got, "calls": counter.calls(), "expected_step": per_step,
            "expected_refresh": refresh}


def phase_save(out: str, mesh, world: int, rank: int) -> None:
    report = {}
    for case in C.CASES:
        t0 = time.perf_counter()
        ref = C.make_model()
        ref_opt = C.build(ref, case)
        model = fresh_sharded(mesh)
        opt = C.build(model, case)
        counts = []
        for step in range(1, C.K1 + 1):
            C.set_grads(ref, step)
            ref_opt.step()
            if step == 1:
                C.set_grads(model, step)
                opt.step()
            else:
                counts.append(counted_step(model, opt, step, world, case))
        C.compare(full_params(ref), model, opt, (world,), C.K1, f"{case} at {world} ranks, step {C.K1}")
        agreed = check_agreement(model, opt, world, case)
        check_nbytes(opt, world, case)
        path = os.path.join(out, case)
        distcheckpoint.save(path, model, opt)
        C.run_steps(ref, ref_opt, C.K1 + 1, C.K1 + C.K2)
        C.run_steps(model, opt, C.K1 + 1, C.K1 + C.K2)
        final = full_params(model)
        C.compare(full_params(ref), model, opt, (world,), C.K1 + C.K2, f"{case} at {world} ranks, step "
                  f"{C.K1 + C.K2}")
        if rank == 0:
            torch.save(final, path + ".final.pt")
        again = fresh_sharded(mesh, perturb=True)
        again_opt = C.build(again, case)
        distcheckpoint.load(path, again, again_opt)
        C.run_steps(again, again_opt, C.K1 + 1, C.K1 + C.K2)
        for name, t in full_params(again).items():
            if not torch.equal(t, final[name]):
                raise AssertionError(f"{case}: resumed at {world} ranks, {name} differs from the uninterrupted run "
                                     f"by {(t - final[name]).abs().max().item():.3e}")
        report[case] = {"agreed_tensors": agreed, "collectives": counts, "state_bytes_rank":
                        slimopt.state_nbytes(opt), "state_bytes_total": slimopt.state_nbytes(opt, total=True)}
        if rank == 0:
            print(f"{case} ({time.perf_counter() - t0:.1f} s): ok", flush=True)
    if rank == 0:
        with open(os.path.join(out, f"report_save_{world}.json"), "w") as f:
            json.dump(report, f, indent=1)


LAYERWISE_CASES = ("adamw8bit", "galore", "frugal", "taco")


def _mlp(mesh):
    """Linear weights (128, 64): a right projection; (68, 128): a left one, rows not divisible by 4; (3, 68): ranks
    holding no rows at 4 ranks. Each Linear is its own FSDP2 unit, as a Transformer block would be."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 68), torch.nn.Tanh(),
                                torch.nn.Linear(68, 3))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def phase_layerwise(out: str, mesh, world: int, rank: int) -> None:
    from slimopt.optim.layerwise import enable_layerwise
    report = {}
    for case in LAYERWISE_CASES:
        for accumulation in (1, 2):
            ordinary, hooked = _mlp(mesh), _mlp(mesh)
            opt, hooked_opt = C.build(ordinary, case), C.build(hooked, case)
            lw = enable_layerwise(hooked, hooked_opt, accumulation_steps=accumulation)
            gen = torch.Generator().manual_seed(7)  # the same batches on every rank: the check is the optimizer's
            for micro in range(5 * accumulation):
                x = torch.randn(6, 64, generator=gen)
                for model in (ordinary, hooked):
                    (model(x).square().mean() / accumulation).backward()
                if (micro + 1) % accumulation == 0:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            what = f"layer-wise {case}, accumulation {accumulation}, {world} ranks"
            if lw.steps != 5 or any(p.grad is not None for p in hooked.parameters()):
                raise AssertionError(f"{what}: {lw.steps} steps, gradients left behind")
            a, b = full_params(ordinary), full_params(hooked)
            for name in a:
                if not torch.equal(a[name], b[name]):
                    raise AssertionError(f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item():.3e}")
            report[f"{case}/{accumulation}"] = "equal"
    if rank == 0:
        with open(os.path.join(out, f"report_layerwise_{world}.json"), "w") as f:
            json.dump(report, f, indent=1)
            print(f"layer-wise: {len(report)} cases equal", flush=True)


def phase_load(out: str, mesh, world: int, rank: int) -> None:
    for case in C.CASES:
        t0 = time.perf_counter()
        path = os.path.join(out, case)
        final = torch.load(path + ".final.pt", weights_only=True)
        again = fresh_sharded(mesh, perturb=True)
        again_opt = C.build(again, case)
        distcheckpoint.load(path, again, again_opt)
        C.run_steps(again, again_opt, C.K1 + 1, C.K1 + C.K2)
        C.compare(final, again, again_opt, (2, world), C.K1 + C.K2, f"{case} saved at 2 ranks, resumed at {world}")
        check_agreement(again, again_opt, world, case)
        check_nbytes(again_opt, world, case)
        if rank == 0:
            print(f"{case} ({time.perf_counter() - t0:.1f} s): ok", flush=True)


def phase_hsdp(world: int, rank: int) -> None:
    """HSDP (a 2 x W/2 mesh: Replicate on the first dimension, Shard(0) on the second) equals one process."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for case in ("mixed_a", "mixed_b"):
        ref = C.make_model()
        ref_opt = C.build(ref, case)
        model = fresh_sharded(mesh)
        opt = C.build(model, case)
        C.run_steps(ref, ref_opt, 1, C.K1 + C.K2)
        C.run_steps(model, opt, 1, C.K1 + C.K2)
        C.compare(full_params(ref), model, opt, (world // 2,), C.K1 + C.K2, f"{case} under HSDP 2 x {world // 2}")
        if rank == 0:
            print(f"{case} under HSDP: ok", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("save", "load", "layerwise"), required=True,
                    help="save or load run step 7 after theirs; layerwise runs only step 7")
    args, mesh, world, rank = C.start_ranks(ap)
    try:
        if args.phase != "layerwise":
            (phase_save if args.phase == "save" else phase_load)(args.out, mesh, world, rank)
        phase_layerwise(args.out, mesh, world, rank)
        if args.phase == "load" and world % 2 == 0 and world > 2:
            phase_hsdp(world, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
