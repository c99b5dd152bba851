"""int8 weights with a host master against bf16 weights with the state on the device: one model, the same steps.

The same pretraining run (one method, one seed, the same batches of the built-in corpus) in three placements:
bf16 weights with the optimizer state on the device; int8 weights on the device with an fp32 master and the state
on the host (``--weights int8 --offload host``); int8 weights stepped on the device with stochastic rounding and no
master (``--weights int8``). Per placement: the peak device memory over training (``torch.cuda.max_memory_allocated``;
on a CPU the growth of the peak resident set), tokens a second after the first two steps, the training loss of the
last steps and the held-out loss after them. docs/offload.md says what each placement keeps where.

    python3 benchmarks/offload_gpu.py --out gpu-bench                                     # LLaMA-1B on the GPU
    python3 benchmarks/offload_gpu.py --model tiny --device cpu --steps 4 --out /tmp/x   # the same code on a CPU

Writes offload.json and offload.md into --out; the exit status is 0 when every placement ran.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

# name: (weights, offload)
PLACEMENTS = {"bf16 weights, state on the device": ("dtype", "none"),
              "int8 weights, fp32 master and state on the host": ("int8", "host"),
              "int8 weights, no master (stochastic rounding)": ("int8", "none")}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", help="a LLaMA size (default 1b)")
    p.add_argument("--method", default="adamw8bit", help="slimopt method (default adamw8bit)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--seq", type=int, default=512, help="tokens a sequence (default 512)")
    p.add_argument("--steps", type=int, default=20, help="training steps, the first two not timed (default 20)")
    p.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored at the end")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu-bench")
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error(f"--steps must be at least 3 (the first two are not timed), got {a.steps}")
    return a


def _run(a: argparse.Namespace, weights: str, offload: str) -> dict:
    """One placement's training run: its summary and the steps' times (from the loop's per-step callback)."""
    from slimopt.train.loop import TrainConfig, train

    config = TrainConfig(model=a.model, data="kjv", seq_len=a.seq, batch_size=a.batch, max_steps=a.steps,
                         method=a.method, device=a.device, dtype="bf16", seed=0, eval_tokens=a.eval_tokens,
                         weights=weights, offload=offload, progress=False, save_model=False)
    marks: list[tuple[float, int]] = []  # (time, tokens) after each step
    summary = train(config, callback=lambda step, record: marks.append((time.perf_counter(), record["tokens"])))
    (t0, n0), (t1, n1) = marks[1], marks[-1]
    losses = [loss for _, loss in summary["history"]["train"]][-max(1, a.steps // 5):]
    return {"weights": weights, "offload": offload, "peak_mem_bytes": summary["peak_mem_bytes"],
            "peak_mem_kind": summary["peak_mem_kind"], "tokens_per_s": (n1 - n0) / max(t1 - t0, 1e-9),
            "train_loss": sum(losses) / len(losses), "val_loss": summary["val_loss"],
            "state_bytes": summary["state_bytes"], "params": summary["params"]}


def _table(record: dict) -> str:
    title = (f"# {record['method']} on LLaMA-{record['model']}, {record['steps']} steps of {record['batch']} x "
             f"{record['seq']} tokens ({record['device']}, torch {record['torch']}, {record['date']})")
    lines = [title, "",
             "| placement | peak memory (GiB) | tokens/s | train loss (last steps) | held-out loss |",
             "|---|---:|---:|---:|---:|"]
    for name, r in record["placements"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {name} | {r['peak_mem_bytes'] / 2**30:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['train_loss']:.3f} | {r['val_loss']:.3f} |")
    kinds = {r["peak_mem_kind"] for r in record["placements"].values() if "peak_mem_kind" in r}
    lines += ["", f"peak memory: {', '.join(sorted(kinds))}"]
    if record["device"] == "cpu":
        lines.append("(on a CPU the device is the host: the memory column does not tell the placements apart)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    record = {"model": a.model, "method": a.method, "batch": a.batch, "seq": a.seq, "steps": a.steps,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "placements": {}}
    ok = True
    for name, (weights, offload) in PLACEMENTS.items():
        try:
            r = _run(a, weights, offload)
            ok = ok and math.isfinite(r["val_loss"])
        except Exception as e:  # noqa: BLE001 - a placement that fails is a row saying why; the others run
            r, ok = {"weights": weights, "offload": offload, "error": f"{type(e).__name__}: {e}"}, False
        record["placements"][name] = r
        print(f"{name}: {r}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    (out / "offload.json").write_text(json.dumps(record, indent=1))
    (out / "offload.md").write_text(_table(record))
    print(_table(record))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
