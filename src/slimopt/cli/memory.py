"""`slimopt memory`: will it fit? The planned memory of a training step, per method, before renting anything.

For a LLaMA size (tiny to 70b) or a local model folder (its config.json, read offline), every method asked for
(slimopt's and the peers'), prints a markdown table of weights, gradients, optimizer state (exact: the same
formulas the optimizer allocates by), projections, activations and the peak; with --gpu-memory, whether each
method fits and the largest batch that does. Writes memory.png (stacked bars with the budget line), memory.json
and memory.md into --out when given. With --weights int8 (attention and MLP weights in int8 on the device) and
--offload host (master copy and optimizer state in pinned host memory, gradients leaving as the backward pass makes
them), also the device, host and PCIe bytes of a step, and whether this machine's free memory holds the host part.
With --fsdp-ranks W, also the optimizer state the busiest of W FSDP2 ranks holds. `slimopt.bench.planner` documents
every formula.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]

EXAMPLES = """examples:
  slimopt memory --model 7b --method all --gpu-memory 24GiB --batch 1 --seq 256
  slimopt memory --model 7b --method adamw,adamw8bit,galore8bit --layerwise --batch 1 --seq 256 --out mem/
  slimopt memory --model ./my-model --method galore,frugal --set galore.rank=256 --gpu-memory 80GB --seq 2048
  slimopt memory --model 7b --method galore8bit,frugal_head --weights int8 --offload host --master bf16+int8 \
      --checkpointing --batch 1 --seq 2048 --gpu-memory 8GiB
  slimopt memory --model 1b --method adamw8bit,galore,taco --fsdp-ranks 64
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("memory", help="plan the memory of a training step per method (what fits where)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a LLaMA size (tiny, small, 60m, 130m, 350m, 1b, 7b; 8b, 13b, 34b and 70b are LLaMA-3-8B, "
                        "LLaMA-2-13B, Code Llama 34B and LLaMA-2-70B, with grouped-query attention at 8b, 34b and "
                        "70b), smollm2-135m "
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
    p.add_argument("--weights", default="dtype", metavar="FORMAT",
                   help="the weights on the device: dtype (all in --dtype; default) or int8 (attention and MLP "
                        "weights in symmetric int8, one fp32 scale per row; embeddings, head and norms in --dtype)")
    p.add_argument("--int8-group", type=int, default=0, metavar="N",
                   help="with --weights int8: one scale per N elements of a row instead of per row (default 0: per "
                        "row)")
    p.add_argument("--int8-embeddings", action="store_true",
                   help="with --weights int8: the embedding and output layer in int8 too")
    p.add_argument("--offload", default="none", metavar="WHERE",
                   help="none (default) or host: master copy and all optimizer state in pinned host memory, stepped "
                        "there; gradients go out as the backward pass makes them, weights come back")
    p.add_argument("--master", default=None, metavar="FORMAT",
                   help="with --offload host, the master copy: fp32 (4 B/param; default), bf16+int8 (3 B/param: bf16 "
                        "and an 8-bit residual) or bf16 (2 B/param)")
    p.add_argument("--vocab-slice", type=int, default=0, metavar="N",
                   help="the loss takes the vocabulary N rows at a time, never holding the whole logits (slimopt "
                        "train --vocab-slice; default 0: the whole logits)")
    p.add_argument("--fsdp-ranks", type=int, default=0, metavar="W",
                   help="also the optimizer state the busiest of W FSDP2 ranks holds, per slimopt method "
                        "(slimopt.bench.rank_state; default 0: not shown)")
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

    from slimopt.atomic import write_atomic
    from slimopt.bench import planner
    from slimopt.bench.plots import memory_chart
    from slimopt.bench.tables import memory_table
    from slimopt.bench.units import parse_size
    from slimopt.options import parse_method_opts
    from slimopt.train.results import check_out_dir

    if args.out:
        check_out_dir(args.out)
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
    if args.fsdp_ranks < 0:
        raise ValueError(f"--fsdp-ranks must be an integer >= 0 (0: not shown); got {args.fsdp_ranks}")
    seq = args.seq or 0
    batch = (args.batch or 1) if seq else 0
    place = _placement(args)
    label, config = planner.load_config(args.model, args.vocab_size)

    plans, max_batches = [], {} if (budget and seq) else None
    for m in methods:
        # a fresh meta model per method: an optimizer must not see another's parameters (no memory is used)
        prep = planner.prepare(planner.meta_model(config, args.dtype), m, dtype=args.dtype, step=args.step,
                               label=label, config=config, **place, **opts.get(m, {}))
        plans.append(prep.plan(batch, seq, args.layerwise, args.checkpointing))
        if max_batches is not None:
            max_batches[m] = prep.max_batch(budget, seq, args.layerwise, args.checkpointing)

    p0 = plans[0]
    offload = p0.offload == "host"
    mode = ", ".join(x for x in (args.dtype, f"batch {batch} x seq {seq}" if seq else "no activations",
                                 "layer-wise updates" if args.layerwise and not offload else "",
                                 "activation checkpointing" if args.checkpointing else "",
                                 f"loss in vocabulary slices of {args.vocab_slice}" if args.vocab_slice else "",
                                 "int8 weights" if p0.weight_format == "int8" else "",
                                 f"offload host, master {p0.master}" if offload else "") if x)
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
    per_rank = None
    if args.fsdp_ranks:
        per_rank = _rank_states(methods, config, args, opts)
        lines += ["", *_rank_lines(per_rank, args.fsdp_ranks)]
    host_note = None
    if p0.weight_format != "dtype" or offload:
        lines += ["", *_placement_lines(plans, offload)]
        if offload:
            host_note = _host_note(plans, config, label, args, opts, place)
            lines += ["", host_note["line"]]
    text = "\n".join(lines).rstrip() + "\n"
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "memory.md", text)
        payload = {"model": label, "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "budget_bytes": budget, "max_batch": max_batches, "host_memory": host_note,
                   "fsdp_rank_state": per_rank,
                   "plans": [p.to_dict() for p in plans]}
        write_atomic(out / "memory.json", json.dumps(payload, indent=1, default=str) + "\n")
        memory_chart(plans, out / "memory.png", budget, title=f"{label}: {mode}")
        print(f"\nwrote {out / 'memory.md'}, {out / 'memory.json'}, {out / 'memory.png'}")
    return 0


def _rank_states(methods: list[str], config, args, opts) -> dict[str, dict[str, int] | None]:
    """method -> {"busiest": bytes, "one_process": bytes} of its optimizer state under FSDP2 at --fsdp-ranks, or
    None for a peer (slimopt does not shard a peer's state)."""
    import slimopt
    from slimopt.bench import planner
    from slimopt.bench.rank_state import rank_state

    out: dict[str, dict[str, int] | None] = {}
    for m in methods:
        if m not in slimopt.methods():
            out[m] = None
            continue
        busiest, one = rank_state(planner.meta_model(config, args.dtype), m, args.fsdp_ranks, step=args.step,
                                  **opts.get(m, {}))
        out[m] = {"busiest": busiest, "one_process": one}
    return out


def _rank_lines(per_rank: dict[str, dict[str, int] | None], world: int) -> list[str]:
    """The per-rank state table (GiB)."""
    from slimopt.bench.tables import markdown
    from slimopt.bench.units import fmt_gib

    rows = []
    for m, r in per_rank.items():
        if r is None:
            rows.append([m, "-", "-", "not sharded by slimopt"])
            continue
        ratio = r["busiest"] / (r["one_process"] / world) if r["one_process"] else 1.0
        rows.append([m, fmt_gib(r["one_process"]), fmt_gib(r["busiest"], 3), f"{ratio:.2f}"])
    return [f"Optimizer state under FSDP2 on {world} ranks (GiB): one process's, the busiest rank's (every state "
            f"tensor split over the ranks, by its rows or, for column statistics, its columns; step counters and "
            f"coordinates on every rank), and its ratio to one process's / {world}:", "",
            markdown(["method", "one process", "busiest rank", f"x one / {world}"], rows)]


def _placement(args) -> dict:
    """The planner's weight-format and offload keywords from the options, with errors that name the option."""
    from slimopt.bench.planner import MASTERS
    from slimopt.factory import OFFLOADS, WEIGHT_FORMATS

    if args.weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}; got {args.weights!r}")
    if args.offload not in OFFLOADS:
        raise ValueError(f"--offload must be one of {', '.join(OFFLOADS)}; got {args.offload!r}")
    if args.master is not None and args.master not in MASTERS:
        raise ValueError(f"--master must be one of {', '.join(MASTERS)}; got {args.master!r}")
    if args.master is not None and args.offload != "host":
        raise ValueError("--master needs --offload host (without offload there is no master copy)")
    if args.int8_group < 0:
        raise ValueError(f"--int8-group must be an integer >= 0 (0: one scale per row); got {args.int8_group}")
    if (args.int8_group or args.int8_embeddings) and args.weights != "int8":
        raise ValueError("--int8-group and --int8-embeddings need --weights int8")
    if args.vocab_slice < 0:
        raise ValueError(f"--vocab-slice must be an integer >= 0 (0: the whole logits); got {args.vocab_slice}")
    return dict(weight_format=args.weights, offload=args.offload, master=args.master, int8_group=args.int8_group,
                int8_embeddings=args.int8_embeddings, vocab_slice=args.vocab_slice)


def _placement_lines(plans, offload: bool) -> list[str]:
    """The device / host / PCIe table of the plans (GiB)."""
    from slimopt.bench.tables import markdown
    from slimopt.bench.units import fmt_gib

    header = ["method", "device peak", "weights", "grads", "activations", "state on device", "temporaries"]
    if offload:
        header += ["host", "master", "host state", "pinned", "PCIe / step", "out", "back"]
    rows = []
    for p in plans:
        d = p.peak_parts
        row = [p.method, fmt_gib(p.peak), fmt_gib(d["weights"]), fmt_gib(d["gradients"]), fmt_gib(d["activations"]),
               fmt_gib(d["optimizer state"] + d["projections"]), fmt_gib(d["temporaries"])]
        if offload:
            h = p.host_parts
            row += [fmt_gib(p.host), fmt_gib(h["master"]), fmt_gib(h["optimizer state"] + h["projections"]),
                    fmt_gib(h["pinned gradients"] + h["pinned weights"]), fmt_gib(p.pcie),
                    fmt_gib(p.pcie_parts["gradients out"]), fmt_gib(p.pcie_parts["weights back"])]
        rows.append(row)
    title = "Device, host and PCIe per step" if offload else "Device"
    out = [f"{title} (GiB; the device's parts at its peak)" + (":" if not offload else
           f", master {plans[0].master}: the opt. state and projections above live on the host; 'pinned' holds "
           "a gradient buffer per parameter and the weights in their device format; PCIe: gradients out, "
           "weights back:"), "", markdown(header, rows)]
    return out


def available_host_memory() -> int | None:
    """Bytes this machine can still give ($SLIMOPT_HOST_BYTES, else MemAvailable of /proc/meminfo, else psutil),
    None if unknown: what `slimopt train` checks its plan against too."""
    from slimopt.train.host_memory import available_host_bytes

    return available_host_bytes()


def _host_note(plans, config, label, args, opts, place) -> dict:
    """One line on the host memory the plans need against this machine's, and the --master that fits if the
    chosen one does not."""
    from slimopt.bench import planner
    from slimopt.bench.units import fmt_gib

    need = max(p.host for p in plans)
    avail = available_host_memory()
    note = {"needed_bytes": need, "available_bytes": avail, "fits": None, "fitting_master": None}
    if avail is None:
        note["line"] = f"Host memory: {fmt_gib(need)} GiB needed; this machine's available memory is unknown."
        return note
    note["fits"] = need <= avail
    if note["fits"]:
        note["line"] = (f"Host memory: {fmt_gib(need)} GiB needed, {fmt_gib(avail)} GiB available on this "
                        "machine: fits.")
        return note
    fitting = None
    for master in sorted(planner.MASTERS, key=planner.MASTERS.get, reverse=True):
        if master == plans[0].master:
            continue
        alt = max(planner.prepare(planner.meta_model(config, args.dtype), p.method, dtype=args.dtype,
                                  step=args.step, label=label, config=config, **{**place, "master": master},
                                  **opts.get(p.method, {})).plan(p.batch, p.seq, args.layerwise,
                                                                 args.checkpointing).host for p in plans)
        if alt <= avail:
            fitting = (master, alt)
            break
    note["fitting_master"] = fitting[0] if fitting else None
    hint = (f"--master {fitting[0]} needs {fmt_gib(fitting[1])} GiB and fits" if fitting else
            "no --master setting fits; a machine with more memory does")
    note["line"] = (f"Host memory: does not fit this machine: {fmt_gib(need)} GiB needed, {fmt_gib(avail)} GiB "
                    f"available; {hint}.")
    return note
