"""Each rank's optimizer step under FSDP2 against one process stepping the whole model, per method.

A method's step on a rank's shard should cost about its share of the one-process step: what FSDP2 saves in memory
must not be paid back in optimizer time. This script starts `--world` ranks (gloo on CPU, one torch thread each;
nccl on CUDA), each holding the bench's small LLaMA (vocabulary 8192, bf16 weights) sharded by ``fully_shard``
(every decoder layer and the root), and the whole model too; gradients come from one backward of a
fixed batch and stay the same for every step. Per method it alternates, step by step: every rank steps its shards
(each timing its own ``opt.step()``), then rank 0 steps the whole model (every rank holds a copy) while the others
wait at a barrier. The sharded step's span runs from the moment the last rank enters ``opt.step()`` to the moment the last one leaves it
(one monotonic clock serves every process of a machine): a rank's own time would also count its wait, inside a
collective, for a rank that left the barrier late. The paired ratio of a step is the span over the whole-model step
next to it (the slowest rank's own time over it is printed too, "own time"); the script prints
the medians of the two times and of the paired ratios, so that the noise of a shared machine (which moves both
alike within a pair) cancels, as ``slimopt bench``'s paired figure does. A third step of each triple has every
rank step the whole model at once: on a machine whose cores share caches and memory bandwidth, what the same
work costs when all cores run (the "ratio to it" column compares the sharded step with that).

    python benchmarks/fsdp_step.py --methods adamw,adamw8bit,frugal,galore,taco,ternary_adamw --world 2 --runs 3
    python benchmarks/fsdp_step.py --methods galore,galore+proj_side=right      # a variant NAME+KEY=VALUE

Medians of `--steps` pairs after 3 warm-up steps of each (GaLore's refresh, at step 1, is among the warm-up: its
steps are timed between refreshes). ``--device cuda`` (nccl, one GPU a rank) makes the same comparison on GPUs and
counts the CUDA kernels each step launches (torch's profiler), sharded and whole; benchmarks/gpu_bench.sh runs it at
one rank on LLaMA-1B (``--model 1b``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from ranks import spawn_ranks

METHODS = ("adamw", "adamw8bit", "frugal", "galore", "taco", "ternary_adamw")


MODEL = {"name": "small"}  # --model: a size of slimopt.models.llama, set in every rank by _rank


def _model(device: str):
    from slimopt.models.llama import build_model
    return build_model(MODEL["name"], 8192, 64, dtype=torch.bfloat16, seed=0, device=torch.device(device))


def _backward(model, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (4, 64), generator=gen).to(device)
    model(input_ids=ids, labels=ids).loss.backward()


def _kernels(step) -> int:
    """CUDA kernels one call of step() launches (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def _build(model, entry: str):
    """slimopt.build of a method, or of a variant NAME+KEY=VALUE (e.g. galore+proj_side=right)."""
    import slimopt
    from slimopt.options import split_variant
    name, settings = split_variant(entry) if "+" in entry else (entry, {})
    return slimopt.build(model, name, **settings)


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process of the machine


def _timed(step, device: str) -> tuple[float, float]:
    """(start, end) of one call of step() on the machine's monotonic clock."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = _clock()
    step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return t, _clock()


def _took(span: tuple[float, float]) -> float:
    return span[1] - span[0]


def _rank(rank: int, world: int, port: int, methods: list[str], steps: int, device: str, model: str,
          queue) -> None:
    from torch.distributed.fsdp import fully_shard
    MODEL["name"] = model
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from slimopt.train.process_group import init_process_group
    init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank, world_size=world)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    sharded = _model(device)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    _backward(sharded, device)
    whole = _model(device)
    _backward(whole, device)
    mine = {}
    for m in methods:
        opt = _build(sharded, m)
        plain = _build(whole, m)
        for _ in range(3):
            opt.step()
            plain.step()
        shard_t, whole_t, together_t = [], [], []
        for _ in range(steps):
            dist.barrier()
            shard_t.append(_timed(opt.step, device))
            dist.barrier()
            if rank == 0:
                whole_t.append(_took(_timed(plain.step, device)))
            dist.barrier()
            together_t.append(_took(_timed(plain.step, device)))  # every rank at once: what sharing costs
        kernels = (_kernels(opt.step), _kernels(plain.step)) if device.startswith("cuda") else None
        routes: dict[str, int] = {}
        for p in sharded.parameters():
            name = (opt.explain(p) or ("none",))[0]
            routes[name] = routes.get(name, 0) + 1
        mine[m] = {"shard_s": shard_t, "whole_s": whole_t, "together_s": together_t, "routes": routes,
                   "kernels": kernels}
        del opt, plain
    queue.put((rank, mine))
    dist.destroy_process_group()


def measure(methods: list[str], steps: int, world: int, device: str, model: str = "small") -> dict:
    results = spawn_ranks(_rank, world, methods, steps, device, model)
    out = {}
    for m in methods:
        whole = results[0][m]["whole_s"]
        shards = [results[r][m]["shard_s"] for r in range(world)]
        # the step's span: from the last rank's start (every rank in the step) to the last rank's end; a rank's own
        # time also counts its wait for a rank that left the barrier before it late, which the span does not
        span = [max(s[i][1] for s in shards) - max(s[i][0] for s in shards) for i in range(steps)]
        slowest = [max(_took(s[i]) for s in shards) for i in range(steps)]
        together = [max(results[r][m]["together_s"][i] for r in range(world)) for i in range(steps)]
        out[m] = {"whole_ms": statistics.median(whole) * 1e3,
                  "rank_ms": [statistics.median(_took(x) for x in s) * 1e3 for s in shards],
                  "span_ms": statistics.median(span) * 1e3,
                  "paired_ratio": statistics.median(a / b for a, b in zip(span, whole)),
                  "paired_ratio_own_time": statistics.median(a / b for a, b in zip(slowest, whole)),
                  "together_ms": statistics.median(together) * 1e3,
                  "ratio_to_together": statistics.median(a / b for a, b in zip(span, together)),
                  "routes": results[0][m]["routes"], "kernels_sharded_whole": results[0][m]["kernels"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--world", type=int, default=2, help="ranks of the FSDP2 run (default 2)")
    ap.add_argument("--steps", type=int, default=15, help="timed pairs a method (default 15; medians are kept)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl, one GPU a rank)")
    ap.add_argument("--model", default="small", help="a model size of slimopt.models.llama (default small)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    os.environ["OMP_NUM_THREADS"] = "1"
    runs = []
    for run in range(args.runs):
        res = measure(methods, args.steps, args.world, args.device, args.model)
        runs.append(res)
        print(f"run {run + 1}: each rank's step under FSDP2 ({args.world} ranks) against the whole model's step in "
              f"one process, alternated ({args.steps} pairs a method)")
        print(f"{'method':<24}{'one process ms':>16}{'ranks ms':>22}{'span ms':>10}{'paired ratio':>14}"
              f"{'(own time)':>12}{'whole, every rank at once ms':>30}{'ratio to it':>13}")
        for m in methods:
            r = res[m]
            kernels = r["kernels_sharded_whole"]
            print(f"{m:<24}{r['whole_ms']:>16.2f}{' / '.join(f'{x:.2f}' for x in r['rank_ms']):>22}"
                  f"{r['span_ms']:>10.2f}{r['paired_ratio']:>14.2f}{r['paired_ratio_own_time']:>12.2f}"
                  f"{r['together_ms']:>30.2f}{r['ratio_to_together']:>13.2f}"
                  + (f"   kernels a step: sharded {kernels[0]}, whole {kernels[1]}" if kernels else ""))
    if args.json:
        info = {"world": args.world, "steps": args.steps, "device": args.device, "model": args.model,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
