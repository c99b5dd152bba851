"""`slimopt memory`: will it fit? The planned memory of a training step, per method, before renting anything.

For a LLaMA size (tiny to 70b) or a local model folder (its config.json, read offline), every method asked for
(slimopt's and the peers'), prints a markdown table of weights, gradients, optimizer state (exact: the same
formulas the optimizer allocates by), projections, activations and the peak; with --gpu-memory, whether each
method fits and the largest batch that does. Writes memory.png (stacked bars with the budget line), memory.json
and memory.md into --out when given. `slimopt.bench.planner` documents every formula.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  slimopt memory --model 7b --method all --gpu-memory 24GiB --batch 1 --seq 256
  slimopt memory --model 7b --method adamw,adamw8bit,galore8bit --layerwise --batch 1 --seq 256 --out mem/
  slimopt memory --model ./my-model --method galore,frugal --set galore.rank=256 --gpu-memory 80GB --seq 2048
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("memory", help="plan the memory of a training step per method (what fits where)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a LLaMA size (tiny, small, 60m, 130m, 350m, 1b, 7b; 13b, 34b and 70b are LLaMA-2-13B, "
                        "Code Llama 34B and LLaMA-2-70B, with grouped-query attention at 34b and 70b), smollm2-135m "
                        "(the pretrained decoder of slimopt finetune / train; no file needed) or a folder with a "
                        "config.json")
    p.add_argument("--method", default="all",
                   help="comma-separated methods, or 'all' (every slimopt method and peer formula; default)")
    p.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="the GPU's memory, e.g. 24GiB, 80GB, 24000MB: adds 'fits' and 'max batch' columns")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (needs --seq; default 1 with --seq)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (none: activations left out)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="weights and activations dtype (default: %(default)s)")
    p.add_argument("--layerwise", action="store_true",
                   help="layer-wise updates (optimizer in backward): only one gradient alive at a time")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing, one per decoder layer")
    p.add_argument("--step", type=int, default=None,
                   help="the state right after this optimizer step (default: the block schedule's maximum)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the config's vocabulary size")
    p.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", dest="set_opts",
                   help="a setting for one method, repeatable (e.g. --set galore.rank=256 --set frugal.density=0.5)")
    p.add_argument("--out", default=None, help="folder for memory.md, memory.json and memory.png")
    return p


def _methods(text: str) -> list[str]:
    from slimopt.bench.planner import planner_methods

    known = planner_methods()
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--method needs at least one method name, or 'all'")
    if names == ["all"]:
        return known
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)} for --method; known: all, {', '.join(known)}")
    return names


def run(args) -> int:
    import json
    from pathlib import Path

    from slimopt.bench import planner
    from slimopt.bench.plots import memory_chart
    from slimopt.bench.tables import memory_table
    from slimopt.bench.units import parse_size
    from slimopt.options import parse_method_opts

    budget = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory is not None else None
    if args.batch is not None and args.seq is None:
        raise ValueError("--batch needs --seq (the tokens per sequence)")
    for name in ("batch", "seq"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name} must be an integer >= 1, got {v}")
    methods = _methods(args.method)
    opts = parse_method_opts(args.set_opts)
    stray = sorted(set(opts) - set(methods))
    if stray:
        raise ValueError(f"--set names method(s) {', '.join(stray)} that are not in --method")
    seq = args.seq or 0
    batch = (args.batch or 1) if seq else 0
    label, config = planner.load_config(args.model, args.vocab_size)

    plans, max_batches = [], {} if (budget and seq) else None
    for m in methods:
        # a fresh meta model per method: an optimizer must not see another's parameters (no memory is used)
        prep = planner.prepare(planner.meta_model(config, args.dtype), m, dtype=args.dtype, step=args.step,
                               label=label, config=config, **opts.get(m, {}))
        plans.append(prep.plan(batch, seq, args.layerwise, args.checkpointing))
        if max_batches is not None:
            max_batches[m] = prep.max_batch(budget, seq, args.layerwise, args.checkpointing)

    p0 = plans[0]
    mode = ", ".join(x for x in (args.dtype, f"batch {batch} x seq {seq}" if seq else "no activations",
                                 "layer-wise updates" if args.layerwise else "",
                                 "activation checkpointing" if args.checkpointing else "") if x)
    lines = [f"## Planned memory: {label} ({p0.params / 1e6:.1f}M parameters; {mode})", "",
             "Sizes in GiB. State B/param: optimizer state (moments, counters, projections) per trainable "
             "parameter.", "", memory_table(plans, budget, max_batches), ""]
    if seq:
        lines.append(f"Activations: {p0.activation_formula}.")
    else:
        lines.append("Activations: left out (no --seq), so the peak counts weights, gradients, optimizer state and "
                     "the update's temporaries only" + (" and 'fits' is a lower bound" if budget else "")
                     + ". Give --seq (and --batch, default 1) to include them"
                     + (" and the largest batch that fits." if budget else "."))
    text = "\n".join(lines).rstrip() + "\n"
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.md").write_text(text)
        payload = {"model": label, "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "budget_bytes": budget, "max_batch": max_batches, "plans": [p.to_dict() for p in plans]}
        (out / "memory.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        memory_chart(plans, out / "memory.png", budget, title=f"{label}: {mode}")
        print(f"\nwrote {out / 'memory.md'}, {out / 'memory.json'}, {out / 'memory.png'}")
    return 0
