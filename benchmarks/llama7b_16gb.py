"""LLaMA-7B pretraining steps under a 16 GB cap: the measured peak next to the planner's, and the step time.

The recipe (docs/benchmarks.md, "LLaMA-7B under 16 GB"): bf16 weights with no fp32 copy, written with stochastic
rounding; signSGD on every parameter but the output layer, whose Adam moments are 8-bit (method ``frugal_head``);
layer-wise updates (each parameter steps inside the backward pass, so one gradient exists at a time); one activation
checkpoint per decoder layer. The model is initialised at random, the tokens are random: this measures memory and
time, not learning.

Run on a GPU machine from the repository root (benchmarks/gpu_bench.sh calls it after the 1B table):

    python3 benchmarks/llama7b_16gb.py --out gpu-bench            # LLaMA-7B, batch 1 x 1024, 16 GB cap
    python3 benchmarks/llama7b_16gb.py --model tiny --device cpu --steps 2 --out /tmp/x   # the same code on CPU

Writes llama7b.json and llama7b.md into --out: the cap, the planner's peak and its parts, the measured
``torch.cuda.max_memory_allocated`` over the training steps, their ratio, and the step times. The exit status is 0
when the steps ran under the cap and the measured peak is within 5% of the plan, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="7b", help="a LLaMA size (default 7b)")
    p.add_argument("--method", default="frugal_head", help="slimopt method (default frugal_head)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12, help="training steps, the first two not timed (default 12)")
    p.add_argument("--cap", default="16GB", help="GPU memory cap (default 16GB = 16e9 bytes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-bench")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from slimopt.bench import planner
    from slimopt.bench.units import parse_size
    from slimopt.optim.layerwise import enable_layerwise
    from slimopt.factory import make_optimizer
    from slimopt.models.llama import build_model

    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cap = parse_size(a.cap)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    record = {"model": a.model, "method": a.method, "batch": a.batch, "seq": a.seq, "cap_bytes": cap,
              "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}

    torch.manual_seed(0)
    model = build_model(a.model, None, a.seq, device=dev).to(torch.bfloat16)  # fp32 init, then bf16 weights only
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    vocab = model.config.vocab_size
    plan = planner.plan(model, a.method, batch=a.batch, seq=a.seq, layerwise=True, checkpointing=True)
    record["plan"] = {"peak": plan.peak, **{f"at the peak: {k}": v for k, v in plan.peak_parts.items()},
                      "optimizer state": plan.optimizer_state, "largest update scratch": plan.scratch}
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)

    opt = make_optimizer(model, a.method)
    hooks = enable_layerwise(model, opt)
    times, status = [], "ok"
    try:
        for step in range(a.steps):
            ids = torch.randint(0, vocab, (a.batch, a.seq), device=dev)
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()  # every parameter steps inside the backward pass (layer-wise updates)
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
            print(f"step {step + 1}/{a.steps}: loss {loss.item():.3f}, {times[-1] * 1e3:.0f} ms", flush=True)
    except torch.OutOfMemoryError as e:
        status = f"out of memory under the cap at step {len(times) + 1}: {str(e).splitlines()[0]}"
    del hooks
    measured = torch.cuda.max_memory_allocated(dev) if cuda else None
    timed = times[2:] if len(times) > 2 else times
    record.update(status=status, steps=len(times), step_ms=[round(t * 1e3, 1) for t in times],
                  mean_step_ms=round(sum(timed) / len(timed) * 1e3, 1) if timed else None,
                  measured_peak=measured, measured_over_plan=(measured / plan.peak) if measured else None)
    (out / "llama7b.json").write_text(json.dumps(record, indent=2))
    gib = 2 ** 30
    lines = [f"# {a.model} pretraining steps under a {a.cap} cap ({record['device']}, torch {torch.__version__})", "",
             f"Method {a.method}, bf16 weights, batch {a.batch} x {a.seq}, layer-wise updates, activation "
             f"checkpointing; status: {status}.", "",
             "| | GiB |", "| :--- | ---: |"]
    for k, v in record["plan"].items():
        lines.append(f"| plan: {k} | {v / gib:.2f} |")
    if measured is not None:
        lines.append(f"| measured max_memory_allocated | {measured / gib:.2f} |")
        lines.append(f"| measured / planned peak | {measured / plan.peak:.3f} |")
    lines += ["", f"Step time (mean of steps 3-{len(times)}): {record['mean_step_ms']} ms."]
    (out / "llama7b.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = status == "ok" and (measured is None or (measured <= cap and abs(measured / plan.peak - 1) <= 0.05))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
