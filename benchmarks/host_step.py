"""The optimizer step on the host at a LLaMA-7B layer's shapes: slimopt's states against torch's fused AdamW.

One LLaMA-7B MLP pair and attention projection (4096x11008, 11008x4096, 4096x4096: 107M parameters, far beyond
the caches), bf16 weights and gradients, every state the same weights and gradients, at one thread and at all of
them. Each state's steps are timed in alternation with torch's fused AdamW on the same bf16 weights (its state is
bf16, as torch keeps it for bf16 weights), so a ratio compares adjacent steps; torch's fused AdamW on fp32 weights
and gradients (fp32 moments) is timed beside them too. It prints, per state, the bytes a step moves per parameter
(weight read and written, gradient read, state read and written), the median step, the ratios, and the machine's
copy bandwidth measured in the same run (a copy of 1 GiB: bytes read plus written per second).

    python benchmarks/host_step.py --out benchmarks/results/host_step_cpu.json

Timings are medians of --steps steps after one untimed step, the best of --rounds rounds.
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

import slimopt

SHAPES = [(4096, 11008), (11008, 4096), (4096, 4096)]
STATES = {  # name: SlimOptimizer settings
    "adamw (bf16 moments: its default for bf16 weights)": {},
    "adamw, fp32 moments": dict(codec="fp32"),
    "adamw8bit": dict(codec="int8"),
    "adamw4bit": dict(codec="int4"),
    "ternary_adamw": dict(m_codec="ternary", v_codec="factored"),
}


def copy_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """GB/s of dst.copy_(src) over nbytes (read plus written), median of 5."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def timed(opt: torch.optim.Optimizer, steps: int) -> float:
    """Median ms of `steps` optimizer steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def moved_per_param(params: list[torch.Tensor], state_bytes: int) -> float:
    """Bytes a step reads and writes per parameter: the weight twice, its gradient once, the state twice."""
    n = sum(p.numel() for p in params)
    weight = sum(p.numel() * p.element_size() for p in params)
    grad = sum(p.grad.numel() * p.grad.element_size() for p in params)
    return (2 * weight + grad + 2 * state_bytes) / n


def torch_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
               if torch.is_tensor(t) and k != "step")


def run(threads: int, steps: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)) for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    for p, q in zip(fp32, params):
        p.grad = q.grad.float()
    baseline = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opts = {"torch fused AdamW, fp32 weights": torch.optim.AdamW(fp32, lr=1e-3, fused=True),
            **{name: slimopt.SlimOptimizer(params, lr=1e-3, **kw) for name, kw in STATES.items()}}
    for opt in (baseline, *opts.values()):
        opt.step()  # state allocated, routes chosen, the kernel built
    best: dict[str, float] = {}
    ratios: dict[str, list[float]] = {name: [] for name in opts}
    base_times: list[float] = []
    for _ in range(rounds):
        for name, opt in opts.items():  # baseline, state, baseline: the ratio to the two steps around it
            before = timed(baseline, steps)
            t = timed(opt, steps)
            after = timed(baseline, steps)
            base_times += [before, after]
            best[name] = min(best.get(name, float("inf")), t)
            ratios[name].append(t / ((before + after) / 2))
    n = sum(p.numel() for p in params)
    rows = [{"state": "torch fused AdamW, bf16 weights", "ms": min(base_times), "ratio": 1.0,
             "bytes_per_param": moved_per_param(params, torch_state_bytes(baseline))}]
    for name, opt in opts.items():
        nbytes = torch_state_bytes(opt) if name.startswith("torch") else slimopt.state_nbytes(opt)
        rows.append({"state": name, "ms": best[name], "ratio": min(ratios[name]),
                     "bytes_per_param": moved_per_param(fp32 if name.startswith("torch") else params, nbytes)})
    for r in rows:
        r["ns_per_param"] = r["ms"] * 1e6 / n
        r["GB_per_s"] = r["bytes_per_param"] * n / (r["ms"] / 1e3) / 1e9
    return {"threads": threads, "params": n, "rows": rows}


def table(result: dict) -> str:
    lines = ["| state | bytes moved / param | " + " | ".join(f"{r['threads']} thread{'s' * (r['threads'] > 1)}: ms, "
                                                          f"x torch fused bf16, GB/s" for r in result["runs"]) + " |",
             "|---|---:|" + "---:|" * len(result["runs"])]
    for i, row in enumerate(result["runs"][0]["rows"]):
        cells = [f"{run['rows'][i]['ms']:.1f}, {run['rows'][i]['ratio']:.2f}x, {run['rows'][i]['GB_per_s']:.0f}"
                 for run in result["runs"]]
        lines.append(f"| {row['state']} | {row['bytes_per_param']:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("copy bandwidth (GB/s, read + written): " + ", ".join(
        f"{t} thread{'s' * (t > 1)} {bw:.0f}" for t, bw in result["copy_GB_per_s"].items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per state and round (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the best is kept (default 2)")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()}, {cores} cores, {platform.processor() or platform.platform()}",
              "versions": {"torch": torch.__version__, "slimopt": slimopt.__version__,
                           "python": platform.python_version()},
              "shapes": SHAPES,
              "copy_GB_per_s": {t: copy_bandwidth(t) for t in counts},
              "runs": [run(t, args.steps, args.rounds) for t in counts]}
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
