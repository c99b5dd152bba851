"""Each rank's optimizer step under FSDP2 against one process stepping the whole model, per method.

A method's step on a rank's shard should cost about its share of the one-process step: what FSDP2 saves in memory
must not be paid back in optimizer time. For each method this script times ``opt.step()`` of the bench's small
LLaMA (vocabulary 8192, bf16 weights) in one process over the whole model, then under FSDP2 on `--world` ranks
(gloo, every decoder layer and the root ``fully_shard``-ed), each rank timing its own step; gradients come from one
backward of a fixed batch and stay the same for every step; every process runs one torch thread. It prints, per
method, the one-process median, each rank's median and their ratio, and with ``--json`` writes them.

    python benchmarks/fsdp_step.py --methods adamw,adamw8bit,frugal,galore,taco,ternary_adamw --world 2 --runs 3

The medians are of `--steps` steps after 3 warm-up steps (GaLore's refresh, at step 1, is among the warm-up:
its steps are timed between refreshes). On a GPU (``--device cuda``, one rank: ``--world 1``, nccl) the same
comparison shows the sharded route's time beside the plain one (benchmarks/gpu_bench.sh runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("adamw", "adamw8bit", "frugal", "galore", "taco", "ternary_adamw")


def _model(device: str):
    from slimopt.train.models import build_model
    return build_model("small", 8192, 64, dtype=torch.bfloat16, seed=0, device=torch.device(device))


def _backward(model, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (4, 64), generator=gen).to(device)
    model(input_ids=ids, labels=ids).loss.backward()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_steps(opt, steps: int, device: str) -> float:
    """The median ms of `steps` calls of opt.step() after 3 warm-up calls."""
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3



def one_process(methods: list[str], steps: int, device: str, out: dict) -> None:
    import slimopt
    torch.set_num_threads(1)
    model = _model(device)
    _backward(model, device)
    for m in methods:
        opt = slimopt.build(model, m)
        out[m] = _time_steps(opt, steps, device)
        del opt


def _rank(rank: int, world: int, port: int, methods: list[str], steps: int, device: str, queue) -> None:
    from torch.distributed.fsdp import fully_shard

    import slimopt
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    model = _model(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _backward(model, device)
    mine = {}
    for m in methods:
        opt = slimopt.build(model, m)
        dist.barrier()
        mine[m] = _time_steps(opt, steps, device)
        routes = {}
        for p in model.parameters():
            name = opt.explain(p)[0] if opt.explain(p) else "none"
            routes[name] = routes.get(name, 0) + 1
        mine[m + ":routes"] = routes
        del opt
    queue.put((rank, mine))
    dist.destroy_process_group()


def sharded(methods: list[str], steps: int, world: int, device: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, methods, steps, device, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    return [results[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--world", type=int, default=2, help="ranks of the FSDP2 run (default 2)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps a run (default 7; the median is kept)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU a rank)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    os.environ["OMP_NUM_THREADS"] = "1"
    runs = []
    for run in range(args.runs):
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            plain = manager.dict()
            p = ctx.Process(target=one_process, args=(methods, args.steps, args.device, plain))
            p.start()
            p.join()
            plain = dict(plain)
        ranks = sharded(methods, args.steps, args.world, args.device)
        runs.append({"one_process_ms": plain, "ranks_ms": [{m: r[m] for m in methods} for r in ranks],
                     "routes": {m: ranks[0][m + ":routes"] for m in methods}})
        print(f"run {run + 1}: per-rank step under FSDP2 ({args.world} ranks) against one process, whole model")
        print(f"{'method':<16}{'one process ms':>16}{'ranks ms':>22}{'ratio (slowest rank)':>24}")
        for m in methods:
            rank_ms = [r[m] for r in ranks]
            print(f"{m:<16}{plain[m]:>16.2f}{' / '.join(f'{x:.2f}' for x in rank_ms):>22}"
                  f"{max(rank_ms) / plain[m]:>24.2f}")
    if args.json:
        info = {"world": args.world, "steps": args.steps, "device": args.device, "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
