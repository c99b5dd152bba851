"""`slimopt compare`: pretrain several methods on the same data, seed and token budget; table and plots.

With no arguments: a tiny LLaMA on the built-in KJV corpus (a 512-token BPE, 512 steps of 16 x 64 tokens), the
default methods (adamw, adamw8bit, galore, frugal, frugal_rho0, badam, ternary_adamw; TACO, a fine-tuning method,
joins them on a pretrained --model such as smollm2-135m) at the learning rates a tuned 3-seed run picked for this
setting, two runs at a time on a 2-core CPU: about 5 minutes. Any other setting
runs each method at its default learning rate (its paper's, or AdamW's times a measured ratio for slimopt's own
recipes: `slimopt methods`), or tuned ones with --tune-lr. Writes results.md, results.csv, results_per_seed.csv, loss_curves.png, memory.png and
runs/<method>/metrics.jsonl.

Every comparison includes a control row (method frozen: AdamW on embeddings, norms and head, the attention and
MLP weights frozen); a method that does not beat it is marked, and a warning says what to change when AdamW
beats it by less than 20% in perplexity. --tune-lr picks each method's learning rate on short runs first,
--seeds N repeats every run and says which gaps are inside the noise. The control runs at its best learning
rate, picked from a few multiples of AdamW's on short runs.
"""

from __future__ import annotations

import argparse

from slimopt.cli.honest import add_honest_args, parse_lr_grid, tuning_from_args
from slimopt.cli.train import _int, add_data_model_args, add_recipe_args
from slimopt.options import parse_method_opts

__all__ = ["add_parser", "run"]


EXAMPLES = """examples:
  slimopt compare                                         # defaults: tiny model, KJV, ~5 min on 2 CPU cores
  slimopt compare --data bbc --out results/bbc
  slimopt compare --methods adamw,galore,frugal,torch-adamw,galore-torch --tokens 4e6
  slimopt compare --methods adamw,galore,frugal --tune-lr --seeds 3   # tuned lrs, mean and spread of 3 seeds
  slimopt compare --tune-lr --lr-grid 1/3,1,3 --tune-fraction 0.5 --no-control
  slimopt compare --model 60m --data ./c4.jsonl --tokenizer ./t5-base --device cuda --batch-size 512 \\
      --tokens 1.1e9 --dtype bf16-autocast --set galore.rank=128
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from slimopt.compare.config import DEFAULT_METHODS, FINE_TUNING_METHODS, CompareConfig
    d = CompareConfig().base
    p = subparsers.add_parser("compare", help="train several methods on equal budgets and compare them",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (slimopt, peers, baselines; default: those of "
                        f"{', '.join(DEFAULT_METHODS)} that exist, the fine-tuning ones ({', '.join(FINE_TUNING_METHODS)}) "
                        "only on a pretrained --model); NAME+KEY=VALUE runs a variant in a row of its "
                        "own, at NAME's lr unless it sets lr (e.g. adamw,adamw+param_rounding=kahan)")
    p.add_argument("--out", default="runs/compare", help="output folder (default: %(default)s)")
    p.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", dest="set_opts",
                   help="a hyperparameter for one method, repeatable (e.g. --set galore.rank=64 --set frugal.lr=3e-3)")
    p.add_argument("--in-process", action="store_true",
                   help="run methods in this process (faster start, but peak memory is not per method)")
    p.add_argument("--no-progress", action="store_true", help="no per-method progress bars")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="runs at a time, each a process of its own (default: on a CPU one per core that --threads "
                        "leaves free, so 2 on a 2-core machine at the default 1 thread; on a GPU 1); per-method "
                        "progress bars show only with 1")
    m = p.add_argument_group("memory at scale")
    m.add_argument("--plan-model", default="7b", metavar="MODEL",
                   help="beside the measured memory, each method's planned optimizer state and step peak at this "
                        "model, as `slimopt memory` plans it (bf16, batch 1 x 256 tokens, layer-wise updates): a "
                        "LLaMA size (tiny .. 7b, 13b, 34b, 70b), smollm2-135m or a folder with a config.json; 'none' plans "
                        "nothing (default: %(default)s)")
    m.add_argument("--plan-gpu-memory", default="24GiB", metavar="SIZE",
                   help="the GPU memory the planned peak is checked against, e.g. 24GiB, 80GB "
                        "(default: %(default)s)")
    h = add_honest_args(p, control="(frozen: AdamW on embeddings, norms and head with every attention and MLP "
                                  "weight frozen, at AdamW's lr), the floor a method must clear",
                        tuning_runs="for --tune-fraction of the steps (before the comparison)",
                        edge_note="; a best lr still on the edge is marked",
                        tuning_files="lr_sweep.csv, lr_sweep.json, lr_sweep.png",
                        seeds="(initialisation and batch order); the table shows mean and spread, the ranking which "
                              "gaps are inside the noise")
    h.add_argument("--control-lr-grid", default=None, metavar="MULTIPLIERS",
                   help="multipliers of AdamW's lr the control is swept over before the comparison, so that it is "
                        "the best a model with frozen transformer weights can do (default: 1,3,10,30; "
                        "--set frozen.lr=LR runs it at LR instead)")
    h.add_argument("--tune-fraction", type=float, default=None, metavar="F",
                   help="length of each tuning run (--tune-lr, and the control's sweep) as a fraction of the full "
                        "run's steps (default: 0.25)")
    add_data_model_args(p, d)
    add_recipe_args(p, d, f"default {d.tokens:.0e}")
    p.add_argument("--eval-every", type=_int, default=None, help="steps between evaluations (default: 8 per run)")
    return p


def run(args) -> int:
    from dataclasses import replace

    from slimopt.compare.config import CompareConfig
    from slimopt.compare.run import run_compare
    d = CompareConfig().base
    tokens = args.tokens if args.tokens is not None or args.max_steps is not None else d.tokens
    base = replace(d, model=args.model, data=args.data, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   text_field=args.text_field, txt_split=args.txt_split, seq_len=args.seq_len,
                   batch_size=args.batch_size, grad_accum=args.grad_accum, max_steps=args.max_steps, tokens=tokens,
                   warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                   clip=args.clip, dtype=args.dtype, seed=args.seed, device=args.device, threads=args.threads,
                   eval_tokens=args.eval_tokens, eval_every=args.eval_every, cache_dir=args.cache_dir)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    tuning = tuning_from_args(args)
    if args.no_control and args.control_lr_grid is not None:
        raise ValueError("--control-lr-grid sets up the control row, which --no-control leaves out")
    if args.control_lr_grid is not None:
        tuning["control_lr_grid"] = parse_lr_grid(args.control_lr_grid, "--control-lr-grid")
    if args.tune_fraction is not None:
        tuning["tune_fraction"] = args.tune_fraction
    from slimopt.compare.plan import PlanSetting
    plan = None if args.plan_model.lower() == "none" else PlanSetting(args.plan_model, args.plan_gpu_memory)
    if plan is not None:
        plan.budget  # noqa: B018 - a bad size fails here, before any run
    cfg = CompareConfig(base=base, methods=methods, method_opts=parse_method_opts(args.set_opts), out=args.out,
                        isolate=not args.in_process, progress=not args.no_progress, control=not args.no_control,
                        tune_lr=args.tune_lr, seeds=args.seeds, jobs=args.jobs, plan=plan, **tuning)
    rows = run_compare(cfg)
    failed = [r["method"] for r in rows if r["status"].startswith("failed")]
    return 1 if failed else 0
