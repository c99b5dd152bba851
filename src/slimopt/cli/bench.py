"""`slimopt bench`: optimizer step time, state bytes and peak memory, slimopt's methods and the peers side by side.

Builds one model (a LLaMA size or a local config folder), fills its gradients with seeded random values, and
times every method's `optimizer.step()` on them (median of --steps after --warmup), counts its state and peak
memory, and times one subspace refresh of a gradient-sized matrix (2048x5461 at rank 512 by default) by full SVD,
randomized SVD and galore-torch's projector. Peers that are not installed get a row saying so. Writes
bench.json, bench.md (tables with ratios to torch AdamW, and the goals) and bench.png into --out.

CPU mode (about 10 minutes on 2 cores): slimopt bench --model small --vocab-size 8192 --steps 3 --warmup 1
GPU mode (LLaMA-1B bf16, one run of under 8 minutes on an H200): benchmarks/gpu_bench.sh
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run", "write_report"]

EXAMPLES = """examples:
  slimopt bench --model small --vocab-size 8192 --steps 3 --warmup 1 --out docs/bench-cpu
  slimopt bench --model 1b --device cuda --steps 20 --warmup 3 --out $OUT/bench
  slimopt bench --model tiny --methods adamw,adamw8bit,torch-adamw-fused,bnb-adamw8bit --no-refresh
  slimopt bench --model 1b --device cuda --methods adamw,galore --check-planner --batch 8 --seq 512
"""


def _shape(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    try:
        m, n = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxN, e.g. 2048x5461; got {text!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"both sides must be >= 1, got {text!r}")
    return m, n


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="time and size optimizer steps, slimopt against the peers",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small",
                   help="a LLaMA size (tiny, small, 60m, 130m, 350m, 1b, 7b) or a folder with a config.json "
                        "(default: %(default)s)")
    p.add_argument("--methods", default="all",
                   help="comma-separated slimopt methods and peers, or 'all' (default)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="weights and gradients dtype (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary of a LLaMA size (default 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 steadies CPU timings on a shared machine")
    p.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", dest="set_opts",
                   help="a setting for one method, repeatable (e.g. --set galore.rank=256)")
    p.add_argument("--no-refresh", action="store_true", help="skip the subspace-refresh timing")
    p.add_argument("--refresh-shape", type=_shape, default=(2048, 5461), metavar="MxN",
                   help="matrix of the refresh timing (default: 2048x5461, a LLaMA-1B MLP weight)")
    p.add_argument("--refresh-rank", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--refresh-reps", type=int, default=None, help="timed refreshes (default: 3 cuda, 1 cpu)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="skip the methods left once this much time has passed (they get a row saying so)")
    p.add_argument("--check-planner", nargs="?", const="default", default=None, metavar="METHODS",
                   help="also run two real training iterations (--batch x --seq random tokens) per method and compare "
                        "the measured peak memory with the planner's; METHODS: comma-separated (default: "
                        "torch-adamw-fused, bnb-adamw8bit, adamw, adamw8bit, galore_rsvd, frugal, taco)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step for --check-planner (default: 8)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence for --check-planner (default: 512)")
    p.add_argument("--out", default=None, help="folder for bench.json, bench.md and bench.png")
    return p


def write_report(result: dict, command: str) -> str:
    """The markdown report of a `run_bench` result: environment, the command, tables and goals."""
    from slimopt.bench.harness import cpu_goals, goals
    from slimopt.bench.tables import bench_table, markdown, refresh_table

    env, cfg, info = result["environment"], result["config"], result["model"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines = [
        f"## slimopt bench: {cfg['model']} ({info['params'] / 1e6:.1f}M parameters, {cfg['dtype']}) on {env['device']}",
        "",
        f"Date: {env['date']}. Versions: python {env['python']}, {versions}."
        + (f" Load average at the end (1, 5, 15 min): {', '.join(map(str, env['load_average']))}."
           if env.get("load_average") else ""),
        "",
        "Reproduce with:",
        "",
        "```",
        command,
        "```",
        "",
        f"Median of {cfg['steps']} optimizer step{'s' if cfg['steps'] != 1 else ''} after {cfg['warmup']} warm-up "
        f"step{'s' if cfg['warmup'] != 1 else ''}, random {cfg['dtype']} gradients. "
        "Ratios are to torch AdamW (fused) in the same run"
        + ("; 'x AdamW paired' is the median ratio of the method's steps to fused AdamW steps timed in alternation "
           "with them on the same weights (a shared CPU's speed drifts between methods, not between two adjacent "
           "steps)" if any(r.get("paired_ratio") is not None for r in result["rows"]) else "")
        + ". State bytes as allocated; 'B/param projectable' counts "
        "the state of the projectable Linear weights only; 'planner = measured' compares with the memory "
        "planner's exact state. Refresh ms = first step - median step (the first step chooses every subspace).",
        "",
        bench_table(result["rows"]),
        "",
    ]
    if result.get("refresh"):
        lines += ["One subspace refresh of a matrix with singular values 1/i (energy: share of the best rank-r "
                  "energy the basis captures):", "", refresh_table(result["refresh"]), ""]
    cpu = cpu_goals(result["rows"])
    if cpu:
        lines += ["CPU step goals (paired ratios; set for the small model on one thread):", "",
                  markdown(["goal", "measured", "verdict"], [[x["goal"], x["measured"], x["verdict"]] for x in cpu],
                           ["l", "l", "l"]), ""]
    if result.get("planner_check"):
        rows = [[r["method"], f"{r['batch']}x{r['seq']}", f"{r['measured_peak_bytes'] / 2**30:.3f}",
                 f"{r['planned_peak_bytes'] / 2**30:.3f}", f"{r['ratio']:.3f}", r["measured_by"]]
                if r.get("status") == "ok" else [r["method"], f"{r['batch']}x{r['seq']}", r["status"], "-", "-", "-"]
                for r in result["planner_check"]]
        lines += ["Planner against a real training step (forward, backward, step; GiB):", "",
                  markdown(["method", "batch x seq", "measured peak", "planned peak", "planned / measured",
                            "measured by"], rows), ""]
    g = goals(result["rows"], cfg["device"], result.get("planned_1b"))
    lines += ["Goals (LLaMA-1B, bf16, H200):", "",
              markdown(["goal", "measured", "verdict"], [[x["goal"], x["measured"], x["verdict"]] for x in g],
                       ["l", "l", "l"]), ""]
    return "\n".join(lines)


def _command(args) -> str:
    """The command line that reproduces this run, from the parsed options (defaults spelled out)."""
    import shlex

    parts = ["slimopt", "bench", "--model", args.model, "--methods", args.methods, "--device", args.device,
             "--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.vocab_size is not None:
        parts += ["--vocab-size", str(args.vocab_size)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    for item in args.set_opts or []:
        parts += ["--set", item]
    if args.no_refresh:
        parts.append("--no-refresh")
    elif tuple(args.refresh_shape) != (2048, 5461) or args.refresh_rank != 512 or args.refresh_reps is not None:
        parts += ["--refresh-shape", "x".join(map(str, args.refresh_shape)), "--refresh-rank",
                  str(args.refresh_rank)] + (["--refresh-reps", str(args.refresh_reps)] if args.refresh_reps else [])
    if args.max_minutes is not None:
        parts += ["--max-minutes", f"{args.max_minutes:g}"]
    if args.check_planner:
        parts += ["--check-planner"] + ([] if args.check_planner == "default" else [args.check_planner])
        parts += ["--batch", str(args.batch), "--seq", str(args.seq)]
    if args.out:
        parts += ["--out", args.out]
    return " ".join(shlex.quote(x) for x in parts)


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from slimopt.bench.harness import CHECK_METHODS, BenchConfig, check_planner, planned_goal_bytes, run_bench
    from slimopt.bench.plots import bench_chart
    from slimopt.atomic import write_atomic
    from slimopt.options import parse_method_opts
    from slimopt.train.results import check_out_dir

    if args.out:
        check_out_dir(args.out)  # before the benchmark runs, not after
    methods = None if args.methods.strip() == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods == []:
        raise ValueError("--methods needs at least one method name, or 'all'")
    reps = args.refresh_reps if args.refresh_reps is not None else (3 if args.device == "cuda" else 1)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    if args.check_planner and (args.batch < 1 or args.seq < 1):
        raise ValueError(f"--batch and --seq must be >= 1 for --check-planner, got {args.batch} and {args.seq}")
    cfg = BenchConfig(model=args.model, methods=methods, device=args.device, dtype=args.dtype, steps=args.steps,
                      warmup=args.warmup, seed=args.seed, vocab_size=args.vocab_size,
                      method_opts=parse_method_opts(args.set_opts), refresh=not args.no_refresh,
                      refresh_shape=args.refresh_shape, refresh_rank=args.refresh_rank, refresh_reps=reps,
                      max_minutes=args.max_minutes)
    result = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["planned_1b"] = planned_goal_bytes("1b", "bf16")
    if args.check_planner:
        names = list(CHECK_METHODS) if args.check_planner == "default" else \
            [m.strip() for m in args.check_planner.split(",") if m.strip()]
        result["planner_check"] = check_planner(args.model, names, args.batch, args.seq, args.device, args.dtype,
                                                args.seed, args.vocab_size)
    command = _command(args)
    text = write_report(result, command)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "bench.md", text)
        write_atomic(out / "bench.json", json.dumps({**result, "command": command}, indent=1, default=str) + "\n")
        bench_chart(result["rows"], out / "bench.png",
                    title=f"{args.model} {args.dtype} on {result['environment']['device']}")
        print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'bench.png'}", file=sys.stderr)
    return 0
