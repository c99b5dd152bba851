"""The host step of int8 weights with fp32 masters at one LLaMA-7B layer's shapes, against torch's fused AdamW.

One decoder layer of LLaMA-7B (q, k, v, o: 4096x4096; gate, up: 11008x4096; down: 4096x11008; 202M parameters) as
int8 Linear layers with fp32 host masters (``slimopt.weights.MasterWeights``, master="fp32"). The timed step is
what the host does for each weight once its gradient has arrived: the optimizer's step of the master and the
requantization that writes the new int8 codes and scales (``MasterWeights._step``). Beside it, on the same
fp32 values and gradients: ``torch.optim.AdamW(fused=True)`` over the fp32 masters (fp32 moments), and the host step
of torchao's ``CPUOffloadOptimizer`` (a fused AdamW per parameter on bf16 host copies, the layout it keeps for bf16
weights; the class itself needs a CUDA device, so its step is run here as it runs it). Each state's step is timed
in alternation with the two references, at one thread and at all of them; the ratios compare medians of one round.
Every side's gradients are freed outside its timed steps (the host step drops the ones it takes).

    python benchmarks/offload_step.py --out benchmarks/results/offload_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
from torch import nn

from slimopt.weights.masters import MasterWeights

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]  # (out, in) of q, k, v, o, gate, up, down
METHODS = {"adamw (fp32 moments)": ("adamw", {"codec": "fp32"}), "adamw8bit": ("adamw8bit", {}),
           "ternary_adamw": ("ternary_adamw", {}), "galore8bit (rank 1024)": ("galore8bit", {"rank": 1024})}


def layer(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(i, o, bias=False, dtype=torch.bfloat16) for o, i in SHAPES])


def gradients(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o, i, generator=gen) * 1e-3 for o, i in SHAPES]


def timed(step, set_grads, steps: int) -> float:
    """Median ms of `steps` calls of step(), the gradients set before each (untimed)."""
    times = []
    for _ in range(steps):
        set_grads()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class Offloaded:
    """One method's host side: MasterWeights over an int8 layer, stepped weight by weight as after a backward."""

    def __init__(self, method: str, settings: dict, grads: list[torch.Tensor]) -> None:
        self.host = MasterWeights(layer(), method, master="fp32", overlap=False, **settings)
        self.names, self.grads = list(self.host.masters), grads

    def set_grads(self) -> None:
        # the step takes each gradient off its master and drops it; held here, they are freed at the next call, as
        # the references' are, and not inside the timed step (freeing 0.8 GB of pages took ~50 ms of it)
        self.held = [g.clone() for g in self.grads]
        for name, g in zip(self.names, self.held):
            self.host.masters[name].grad = g

    def step(self) -> None:
        for name in self.names:  # what the host does as each gradient arrives: its step and its int8 write
            self.host._submit(name)


class TorchFused:
    """torch.optim.AdamW(fused=True) over copies of the masters: one optimizer (fp32), or one per parameter on
    bf16 copies (torchao CPUOffloadOptimizer's host step)."""

    def __init__(self, grads: list[torch.Tensor], dtype: torch.dtype, per_param: bool) -> None:
        self.params = [nn.Parameter(w.weight.detach().to(dtype)) for w in layer()]
        self.grads = [g.to(dtype) for g in grads]
        groups = [[p] for p in self.params] if per_param else [self.params]
        self.opts = [torch.optim.AdamW(g, lr=1e-4, fused=True) for g in groups]

    def set_grads(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()

    def step(self) -> None:
        for opt in self.opts:
            opt.step()


def run(threads: int, steps: int, labels: list[str]) -> dict:
    torch.set_num_threads(threads)
    grads = gradients()
    fused = TorchFused(grads, torch.float32, per_param=False)
    torchao = TorchFused(grads, torch.bfloat16, per_param=True)
    rows = {}
    for label in labels:
        method, settings = METHODS[label]
        state = Offloaded(method, settings, grads)
        for runner in (state, fused, torchao):  # one untimed step each: state created, routes chosen
            runner.set_grads()
            runner.step()
        ms = {"slimopt": timed(state.step, state.set_grads, steps),
              "fused": timed(fused.step, fused.set_grads, steps),
              "torchao": timed(torchao.step, torchao.set_grads, steps)}
        rows[label] = {**{f"{k}_ms": v for k, v in ms.items()},
                       "ratio_to_fused_adamw": ms["slimopt"] / ms["fused"],
                       "ratio_to_torchao_host_step": ms["slimopt"] / ms["torchao"]}
        state.host.close()
        print(f"  {threads} thread(s) {label}: {ms['slimopt']:.0f} ms; fused AdamW {ms['fused']:.0f} ms "
              f"({rows[label]['ratio_to_fused_adamw']:.2f}x), torchao's host step {ms['torchao']:.0f} ms "
              f"({rows[label]['ratio_to_torchao_host_step']:.2f}x)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per state and reference (default 3)")
    ap.add_argument("--methods", default=",".join(m for m, _ in METHODS.values()),
                    help="comma-separated methods among " + ", ".join(m for m, _ in METHODS.values()) + " (default all)")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    by_method = {method: label for label, (method, _) in METHODS.items()}
    unknown = [m for m in args.methods.split(",") if m not in by_method]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose among {', '.join(by_method)}")
    labels = [by_method[m] for m in args.methods.split(",")]
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.processor()
              or platform.machine(), "cores": cores, "torch": torch.__version__,
              "params": sum(o * i for o, i in SHAPES), "runs": {}}
    for t in counts:
        result["runs"][str(t)] = run(t, args.steps, labels)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
