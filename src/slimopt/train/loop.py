"""The pretraining loop behind `slimopt train` and `slimopt compare`.

One function, `train(TrainConfig)`, runs a causal-LM pretraining job the way the GaLore (arXiv 2403.03507) and
FRUGAL (arXiv 2411.07837) experiments do: packed token blocks, a fixed global batch with gradient accumulation,
linear warmup then cosine decay to 10% of the peak lr, gradient clipping, bf16 autocast or bf16 weights, and
held-out evaluation at intervals and at the end. Any slimopt method, peer optimizer (`slimopt.peers`) or
low-rank baseline (`slimopt.baselines`) can be trained with the same loop, data, seed and token budget.

Guarantees:
- Bad input (unknown method or model, missing data, a batch that cannot be split, a sequence longer than the
  model allows) raises before the first step and before anything is written into the output folder.
- Exact resume: model, optimizer, scheduler, sampler position and every RNG are checkpointed atomically; a run
  killed at any moment and resumed with `resume=True` ends bit-identical (on CPU) to one never stopped.
- DDP under torchrun (gloo on CPU, nccl on GPU): each rank takes its slice of the global batch, the optimizer
  steps on all-reduced gradients (so every rank picks the same subspaces and blocks), only rank 0 writes.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from slimopt.catalog import method_kind, resolve_lr
from slimopt.factory import HOST_MASTERS, OFFLOADS, WEIGHT_FORMATS, make_optimizer
from slimopt.train import checkpoint as ckpt
from slimopt.train import fsdp, run_checkpoint
from slimopt.train.evaluate import evaluate, lm_loss
from slimopt.train.logger import MemoryProbe, RunLogger, read_jsonl
from slimopt.train.results import check_out_dir
from slimopt.train.schedule import build_scheduler
from slimopt.train.vocab_chunked_loss import causal_lm_loss

__all__ = ["TrainConfig", "train", "DTYPES"]

DTYPES = ("fp32", "bf16-autocast", "bf16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """Every setting of a pretraining run; the `slimopt train` options map one to one onto these fields."""

    model: str = "tiny"                 # a size in models.LLAMA_SIZES, a local directory, or a hub name
    data: str = "kjv"                   # kjv | bbc | c4 | hf:NAME | a local .txt/.jsonl/.parquet file or folder
    tokenizer: str | None = None        # a Hugging Face tokenizer name/path; None trains a byte-level BPE
    vocab_size: int = 4096              # size of the BPE trained when tokenizer is None
    text_field: str = "text"            # the text column of .jsonl/.parquet files and HF datasets
    txt_split: str = "paragraph"        # how .txt files split into documents: paragraph | line | file
    seq_len: int = 128
    batch_size: int = 32                # sequences per optimizer step, over all ranks and micro-batches
    grad_accum: int = 1
    max_steps: int | None = None
    tokens: int | None = None           # token budget; steps = ceil(tokens / (batch_size * seq_len))
    max_train_tokens: int | None = None  # cap on the training tokens prepared from the source (streaming sources)
    lr: float | None = None             # None: the method's paper default
    warmup: float = 0.1                 # fraction of the run in [0, 1), or a step count >= 1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0                   # max gradient norm; 0 disables clipping
    dtype: str = "fp32"                 # fp32 | bf16-autocast | bf16 (weights)
    method: str = "adamw"
    opt: dict[str, Any] = field(default_factory=dict)  # method hyperparameters (rank, density, update_gap, ...)
    seed: int = 0
    eval_every: int | None = None       # steps between evaluations; None: 8 per run; 0: only at the end
    eval_tokens: int = 32768            # held-out tokens scored per evaluation (the first ones of the split)
    eval_batch_size: int | None = None  # None: the per-rank micro-batch size times 2
    save_every: int = 0                 # steps between checkpoints; 0: none (the final one only with --resume)
    log_every: int = 1
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    threads: int | None = None          # CPU threads for torch (None: torch's default, one per core)
    fsdp: bool = False                  # shard weights, gradients and optimizer state with FSDP2 (train/fsdp.py)
    weights: str = "dtype"              # dtype | int8: the body's Linear weights in int8 on the device
    int8_group: int = 0                 # with int8 weights: one scale per this many elements of a row (0: a row)
    int8_embeddings: bool = False       # with int8 weights: the input embedding and the output layer in int8 too
    offload: str = "none"               # none | host: the master copy and the optimizer state on the host
    master: str = "fp32"                # with --offload host: the master copy's dtype, fp32 | bf16
    vocab_slice: int = 0                # the loss takes the vocabulary this many rows at a time (0: whole logits)
    cache_dir: str | None = None
    progress: bool = True               # False: no progress bar at all, the libraries' included
    save_model: bool = True
    tensorboard: bool = True


# --------------------------------------------------------------------------------------------- methods

def slimopt_state_nbytes(opt: torch.optim.Optimizer, total: bool = False) -> int:
    from slimopt.optim.accounting import state_nbytes
    return state_nbytes(opt, total=total)


def optimizer_state_nbytes(opt: torch.optim.Optimizer) -> int:
    from slimopt.peers import optimizer_state_nbytes as count
    return count(opt)


# --------------------------------------------------------------------------------------------- validation

def _check_config(c: TrainConfig, world_size: int) -> None:
    """Everything that can be checked without loading data or models. Raises ValueError naming the option."""
    def positive(name: str, v, allow_none: bool = False, allow_zero: bool = False):
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if allow_zero else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {0 if allow_zero else 1}, got {v!r}")

    positive("seq_len", c.seq_len)
    if c.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (a block predicts seq_len - 1 tokens), got {c.seq_len}")
    positive("batch_size", c.batch_size)
    positive("grad_accum", c.grad_accum)
    positive("max_steps", c.max_steps, allow_none=True)
    positive("tokens", c.tokens, allow_none=True)
    positive("max_train_tokens", c.max_train_tokens, allow_none=True)
    positive("vocab_size", c.vocab_size)
    positive("eval_every", c.eval_every, allow_none=True, allow_zero=True)
    positive("eval_tokens", c.eval_tokens)
    positive("eval_batch_size", c.eval_batch_size, allow_none=True)
    positive("save_every", c.save_every, allow_zero=True)
    positive("log_every", c.log_every)
    positive("threads", c.threads, allow_none=True)
    if not isinstance(c.seed, int):
        raise ValueError(f"--seed must be an integer, got {c.seed!r}")
    if c.max_steps is not None and c.tokens is not None:
        raise ValueError("give either --max-steps or --tokens (a token budget), not both")
    per_step = c.grad_accum * world_size
    if c.batch_size % per_step:
        raise ValueError(f"--batch-size {c.batch_size} must be divisible by --grad-accum ({c.grad_accum}) x "
                         f"world size ({world_size}) = {per_step}, so every rank gets equal micro-batches")
    if c.lr is not None and not (c.lr > 0 and math.isfinite(c.lr)):
        raise ValueError(f"--lr must be a positive number, got {c.lr!r}")
    if not c.weight_decay >= 0:
        raise ValueError(f"--weight-decay must be >= 0, got {c.weight_decay!r}")
    if not c.clip >= 0:
        raise ValueError(f"--clip must be >= 0 (0 disables clipping), got {c.clip!r}")
    if not 0 <= c.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {c.min_lr_ratio!r}")
    if not c.warmup >= 0 or (c.warmup >= 1 and c.warmup != int(c.warmup)):
        raise ValueError(f"--warmup must be a fraction in [0, 1) or a whole number of steps, got {c.warmup!r}")
    if c.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
    if c.device not in DEVICES and not c.device.startswith("cuda:"):
        raise ValueError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {c.device!r}")
    if c.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {c.device} requested but CUDA is not available here; use --device cpu")
    if not isinstance(c.opt, dict):
        raise ValueError(f"opt must be a dict of method hyperparameters, got {type(c.opt).__name__}")
    if c.fsdp:
        fsdp.check_method(method_kind(c.method), c.method)
    _check_placement(c, world_size)
    method_kind(c.method)
    _check_model_name(c.model)
    _check_data_source(c.data, c.text_field, c.txt_split)
    if c.resume and c.out is None:
        raise ValueError("--resume needs --out (the folder of the run to continue)")
    if c.out is not None:
        check_out_dir(c.out)
    found = (ckpt.find_checkpoint(c.out), fsdp.find_checkpoint(c.out)) if c.out is not None else (None, None)
    if c.out is not None and not c.resume and not c.overwrite and any(found):
        raise ValueError(f"--out {c.out} already holds a run's checkpoint; pass --resume to continue it or "
                         f"--overwrite to start over")
    if c.resume and found[c.fsdp] is None and found[not c.fsdp] is not None:
        raise ValueError(f"--out {c.out} holds a checkpoint written {'without' if c.fsdp else 'with'} --fsdp; "
                         f"resume it the same way")


def _check_placement(c: TrainConfig, world_size: int) -> None:
    """The weights' format, the offload and the sliced loss: values, and what they do not combine with yet."""
    for name, value, allowed in (("weights", c.weights, WEIGHT_FORMATS), ("offload", c.offload, OFFLOADS),
                                 ("master", c.master, HOST_MASTERS)):
        if value not in allowed:
            raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
    if not isinstance(c.int8_group, int) or isinstance(c.int8_group, bool) or c.int8_group < 0:
        raise ValueError(f"--int8-group must be an integer >= 0 (0: one scale per row), got {c.int8_group!r}")
    if c.int8_group and c.weights != "int8":
        raise ValueError("--int8-group needs --weights int8")
    if c.int8_embeddings and c.weights != "int8":
        raise ValueError("--int8-embeddings needs --weights int8")
    if c.int8_embeddings and c.vocab_slice:
        raise ValueError("--int8-embeddings and --vocab-slice: the sliced loss reads the output layer's weight, "
                         "which int8 replaces; use one of them")
    if not isinstance(c.vocab_slice, int) or isinstance(c.vocab_slice, bool) or c.vocab_slice < 0:
        raise ValueError(f"--vocab-slice must be an integer >= 0 (0: the whole logits), got {c.vocab_slice!r}")
    placed = _placement(c) is not None
    if placed and method_kind(c.method) != "slimopt":
        raise ValueError(f"--weights int8 and --offload host step slimopt methods; {c.method!r} is a "
                         f"{method_kind(c.method)}")
    if (placed or c.vocab_slice) and (c.fsdp or world_size > 1):
        raise ValueError("--weights int8, --offload host and --vocab-slice run in one process for now (each rank "
                         "would offload its own shard; docs/modules.md, slimopt.weights)")


def _placement(c: TrainConfig) -> dict | None:
    """MasterWeights' settings for int8 weights or a host master (None: the model steps as it is)."""
    if c.weights == "dtype" and c.offload == "none":
        return None
    return {"int8": c.weights == "int8", "int8_group": c.int8_group, "int8_embeddings": c.int8_embeddings,
            "master": c.master if c.offload == "host" else "none", "accumulation_steps": c.grad_accum,
            "clip": c.clip or None}


def _check_model_name(name: str) -> None:
    from slimopt.models import llama as models
    if not isinstance(name, str) or not name:
        raise ValueError(f"--model must be a size ({', '.join(models.LLAMA_SIZES)}), a local directory or a "
                         f"Hugging Face name; got {name!r}")
    if name.lower() in models.LLAMA_SIZES:
        return
    p = Path(name).expanduser()
    if p.exists():
        if not (p.is_dir() and (p / "config.json").is_file()):
            raise ValueError(f"--model {name}: a model path must be a directory holding config.json")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(f"--model {name}: no such directory (built-in sizes: {', '.join(models.LLAMA_SIZES)})")


def _check_data_source(source: str, text_field: str, txt_split: str) -> None:
    # Resolving a source checks names and paths without reading any document.
    from slimopt.train import data
    data.resolve_source(source, text_field, txt_split)


# --------------------------------------------------------------------------------------------- setup helpers

@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def _setup_distributed(device_choice: str) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    import torch.distributed as dist

    from slimopt.train.process_group import init_process_group
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_choice != "cpu" and torch.cuda.is_available()
    here = False
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(local)
        init_process_group("nccl" if use_cuda else "gloo")
        here = True
    return _Dist(rank, dist.get_world_size(), local, here)


def _pick_device(choice: str, d: _Dist) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and d.world_size > 1:
        return torch.device("cuda", d.local_rank)
    return torch.device(choice)


def _model_dtype(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype or None)."""
    return {"fp32": (torch.float32, None), "bf16-autocast": (torch.float32, torch.bfloat16),
            "bf16": (torch.bfloat16, None)}[name]


def tokenizer_name(c: TrainConfig) -> str | None:
    """The tokenizer a run reads: the one named, a pretrained model's own (its ids are what the model knows), or
    None: a byte-level BPE of c.vocab_size trained on the training documents."""
    from slimopt.models.smollm2 import SMOLLM2
    return c.tokenizer if c.tokenizer is not None or c.model != SMOLLM2 else SMOLLM2


def _prepare_data(c: TrainConfig, total_steps: int):
    """(tokenizer, PackedData): the tokenizer (``tokenizer_name``) and the packed train/held-out blocks, both
    cached on disk by slimopt.train.data."""
    from slimopt.train import data
    tok = data.tokenizer_for_source(c.data, tokenizer_name(c), c.vocab_size, text_field=c.text_field,
                                    txt_split=c.txt_split, cache_dir=c.cache_dir)
    cap = c.max_train_tokens
    if cap is None and not data.resolve_source(c.data, c.text_field, c.txt_split).finite:
        cap = total_steps * c.batch_size * c.seq_len  # a stream: read exactly one pass of the token budget
    packed = data.prepare_data(c.data, tok, c.seq_len, max_train_tokens=cap, text_field=c.text_field,
                               cache_dir=c.cache_dir, txt_split=c.txt_split)
    return tok, packed


def _total_steps(c: TrainConfig) -> int:
    if c.max_steps is not None:
        return c.max_steps
    tokens = c.tokens if c.tokens is not None else 2_000_000
    return max(1, math.ceil(tokens / (c.batch_size * c.seq_len)))


def _resume_key(c: TrainConfig, total_steps: int) -> dict:
    # Settings that must match for a checkpoint to continue this run; eval/log/save cadence may change.
    return {"model": c.model, "data": c.data, "tokenizer": c.tokenizer, "vocab_size": c.vocab_size,
            "seq_len": c.seq_len, "batch_size": c.batch_size, "grad_accum": c.grad_accum, "total_steps": total_steps,
            "lr": c.lr, "warmup": c.warmup, "min_lr_ratio": c.min_lr_ratio, "weight_decay": c.weight_decay,
            "clip": c.clip, "dtype": c.dtype, "method": c.method, "opt": dict(sorted(c.opt.items())),
            "seed": c.seed, **({"weights": c.weights, "int8_group": c.int8_group, "offload": c.offload,
                                "master": c.master} if _placement(c) else {}),
            **({"int8_embeddings": True} if c.int8_embeddings else {})}


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _ranks_agree(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every rank holds the same parameters (a fingerprint of each tensor, gathered across ranks).

    Ranks step on the same all-reduced gradients, so they must stay identical; a method whose random choices
    (blocks, projections) differed between ranks would drift apart, which this catches.
    """
    import torch.distributed as dist
    with torch.no_grad():
        fp = torch.stack([p.detach().double().sum() for p in model.parameters()]
                         + [p.detach().double().square().sum() for p in model.parameters()]).to(device)
    gathered = [torch.empty_like(fp) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, fp)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# --------------------------------------------------------------------------------------------- the loop

def train(config: TrainConfig, callback: Callable[[int, dict], None] | None = None) -> dict:
    """Run (or resume) a pretraining job and return its summary.

    callback(step, record) is called on every rank after each optimizer step (and after that step's checkpoint);
    raising from it stops the run as a crash would.
    Returns a dict: method, model, params, steps, tokens, val_loss, val_ppl, start_val_loss and start_val_ppl (a
    loaded model's held-out loss before training; None for a size built from scratch), state_bytes, state_bytes_per_param,
    peak_mem_bytes, peak_mem_kind, tokens_per_s, train_time_s, wall_time_s, cpu_time_s, lr, history (train and
    eval curves).
    """
    t_start = time.perf_counter()
    cpu_start = time.process_time()
    c = config
    dist_info = _setup_distributed(c.device)
    try:
        # No bar means none from anyone: transformers draws one when it loads or saves a model, datasets and the
        # hub when they read; every rank but the first keeps quiet, so ranks do not draw the same bar N times.
        if c.progress and dist_info.main:
            return _train(c, dist_info, callback, t_start, cpu_start)
        from slimopt.hushed import progress_bars_off
        with progress_bars_off():
            return _train(c, dist_info, callback, t_start, cpu_start)
    finally:
        if dist_info.initialised_here:
            import torch.distributed as dist
            dist.destroy_process_group()


@dataclass
class _Run:
    """One run's parts (``_build``) and where it stands: the loop's steps read and advance it."""

    c: TrainConfig
    d: _Dist
    device: torch.device
    autocast_dtype: torch.dtype | None
    total_steps: int
    tokenizer: Any
    packed: Any  # data.PackedData
    val_blocks: torch.Tensor  # [n_val, seq_len]
    probe: MemoryProbe
    model: torch.nn.Module
    baseline_hook: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    peak_lr: float
    checkpoint: Any  # run_checkpoint.FileCheckpoint or ShardedCheckpoint, None without --out
    step: int = 0
    tokens: int = 0
    train_time: float = 0.0
    logger: RunLogger | None = None
    history: dict = field(default_factory=lambda: {"train": [], "eval": []})

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) + sum(m.numel() for m in self._int8_masters())

    @property
    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad) + \
            sum(m.numel() for m in self._int8_masters())

    def _int8_masters(self) -> list[torch.Tensor]:
        """The masters of int8 weights: trainable, but not parameters of the model."""
        from slimopt.weights.int8_layer import Int8Weight
        return [m.master for m in self.model.modules() if isinstance(m, Int8Weight) and m.master is not None]


def _build(c: TrainConfig, d: _Dist) -> _Run:
    """Check the settings, read the data, build the model, its optimizer, schedule and sampler (nothing written)."""
    _check_config(c, d.world_size)
    device = _pick_device(c.device, d)
    if c.fsdp:  # one plain process: FSDP over a group of one
        d.initialised_here |= fsdp.ensure_process_group(device)
    if c.threads is not None:
        torch.set_num_threads(c.threads)
    weight_dtype, autocast_dtype = _model_dtype(c.dtype)
    total_steps = _total_steps(c)

    # Data first: a bad source fails here, before any model is built.
    tokenizer, packed = _prepare_data(c, total_steps)
    train_blocks = packed.train  # [num_blocks, seq_len] numpy (memory-mapped from the cache)
    if train_blocks.shape[0] < c.batch_size:
        raise ValueError(f"the training split has {train_blocks.shape[0]} blocks of {c.seq_len} tokens, fewer than "
                         f"--batch-size {c.batch_size}; use a smaller batch, a shorter --seq-len or more data")
    n_val = min(packed.val.shape[0], max(1, c.eval_tokens // c.seq_len))
    val_blocks = torch.from_numpy(np.asarray(packed.val[:n_val], dtype=np.int64))  # [n_val, seq_len]

    from slimopt.models import llama as models
    from slimopt.train import data as data_mod
    probe = MemoryProbe(device)
    probe.start()
    model = models.build_model(c.model, packed.vocab_size, c.seq_len, dtype=weight_dtype, seed=c.seed,
                               device=device)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and c.seq_len > max_pos:
        raise ValueError(f"--seq-len {c.seq_len} exceeds the model's max_position_embeddings {max_pos}")
    kind = method_kind(c.method)
    if _placement(c) is not None:  # before the masters and the state exist: one line if the host cannot hold them
        from slimopt.train.host_memory import check_host_memory
        check_host_memory(model, c.method, c.opt, weights=c.weights, offload=c.offload, master=c.master,
                          int8_group=c.int8_group, int8_embeddings=c.int8_embeddings,
                          batch=c.batch_size // c.grad_accum, seq=c.seq_len, device=device, vocab_slice=c.vocab_slice)
    baseline_hook = None
    # Seed before anything that draws from the global generators (LoRA's adapter init, random projections), so
    # a run depends on its seed alone, not on what the process did before.
    _seed_everything(c.seed)
    if kind == "baseline":
        from slimopt import baselines
        model, baseline_hook = baselines.prepare(model, c.method, seed=c.seed, **c.opt)
        model.to(device)
    if c.fsdp:
        fsdp.shard_model(model, device)
    optimizer = make_optimizer(model, c.method, lr=c.lr, weight_decay=c.weight_decay, placement=_placement(c),
                               **({} if kind == "baseline" else c.opt))
    return _Run(c, d, device, autocast_dtype, total_steps, tokenizer, packed, val_blocks, probe, model, baseline_hook,
                optimizer, build_scheduler(optimizer.front if _placement(c) else optimizer, total_steps, c.warmup,
                                           c.min_lr_ratio),
                data_mod.BatchSampler(train_blocks, c.batch_size, seed=c.seed, rank=d.rank, world_size=d.world_size),
                resolve_lr(c.method, c.lr), run_checkpoint.for_run(c.out, c.fsdp, d.main))


def _resume(run: _Run) -> dict | None:
    """Continue from the checkpoint in --out where --resume asks it (nothing is written yet): the model,
    optimizer, schedule, sampler and the run's counters restored. Returns the RNG state to set, or None."""
    c = run.c
    found = run.checkpoint.find() if c.resume else None
    if c.resume and found is None and run.d.main:  # documented: a job script may always pass --resume
        print(f"slimopt train: no checkpoint in {c.out} to resume: starting at step 0", file=sys.stderr, flush=True)
    if found is None:
        return None
    state = run.checkpoint.read(found, run.device)
    key = _resume_key(c, run.total_steps)
    diff = {k: (state["resume_key"].get(k), v) for k, v in key.items() if state["resume_key"].get(k) != v}
    if diff:
        raise ValueError(f"cannot resume {c.out}: settings differ from the checkpoint's "
                         f"(option: checkpoint -> now): {diff}")
    rng = run.checkpoint.restore(found, state, run.model, run.optimizer)
    run.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    if run.baseline_hook is not None and "baseline" in state:
        run.baseline_hook.load_state_dict(state["baseline"])
    run.step, run.tokens, run.train_time = state["step"], state["tokens"], state["train_time"]
    return rng


def _open_log(run: _Run, rng: dict | None) -> None:
    """The run's log (rank 0 writes): a fresh run's settings, or a resumed run's log cut back to its checkpoint
    and its curves read back; a resumed run's random generators set where the checkpoint left them."""
    c, resumed = run.c, rng is not None
    run.logger = RunLogger(Path(c.out) if c.out is not None else None, enabled=run.d.main, tensorboard=c.tensorboard,
                           truncate_after_step=run.step if resumed else None)
    if not resumed:
        run.logger.log("config", step=0, config=asdict(c), total_steps=run.total_steps, peak_lr=run.peak_lr,
                       params=run.n_params, trainable_params=run.n_trainable, world_size=run.d.world_size,
                       device_used=str(run.device), train_blocks=int(run.packed.train.shape[0]),
                       val_blocks=int(run.val_blocks.shape[0]),
                       data_meta={k: v for k, v in run.packed.meta.items() if isinstance(v, (int, float, str))})
        return
    run.logger.log("resume", step=run.step, tokens=run.tokens)
    ckpt.set_rng_state(rng)
    if run.logger.enabled:  # curves from before the interruption, as the truncated log has them
        for r in read_jsonl(run.logger.path):
            if r.get("event") == "train":
                run.history["train"].append((r["tokens"], r["loss"]))
            elif r.get("event") == "eval":
                run.history["eval"].append((r["tokens"], r["val_loss"]))


def _evaluate(run: _Run, step: int) -> dict:
    c, d = run.c, run.d
    if d.world_size > 1 and not c.fsdp and not _ranks_agree(run.model, run.device):
        # Fail fast: ranks that drifted apart (different random blocks or subspaces) waste the rest of the run.
        raise RuntimeError(f"data-parallel ranks hold different parameters at step {step}: the method's "
                           f"choices (blocks, subspaces, random projections) differ between ranks")
    # FSDP's forward is a collective: every rank scores every block (the same batches on all ranks)
    micro = c.batch_size // d.world_size // c.grad_accum
    r = evaluate(run.model, run.val_blocks, c.eval_batch_size or 2 * micro, run.device, run.autocast_dtype,
                 *((0, 1) if c.fsdp else (d.rank, d.world_size)))
    run.logger.log("eval", step=step, tokens=run.tokens, **r)
    run.history["eval"].append((run.tokens, r["val_loss"]))
    return r


def _save(run: _Run) -> None:
    position = {"format": 1, "step": run.step, "tokens": run.tokens, "train_time": run.train_time,
                "resume_key": _resume_key(run.c, run.total_steps), "scheduler": run.scheduler.state_dict(),
                "sampler": run.sampler.state_dict()}
    extra = {"baseline": run.baseline_hook.state_dict()} if run.baseline_hook is not None else {}
    if _placement(run.c) is not None:
        run.optimizer.synchronize()  # the model's weights are read first: every update must have landed
    run.checkpoint.save(position, run.model, run.optimizer, extra)


def _optimizer_step(run: _Run, net: torch.nn.Module, params: list[torch.Tensor]) -> tuple[float, Any, float]:
    """One optimizer step on the next global batch: its micro-batches' backward passes (DDP and FSDP2 reduce
    gradients on the last only), the loss averaged over ranks, clipping, the step and the schedule. Returns
    (mean loss, gradient norm or None, the lr the step used)."""
    c, d, model = run.c, run.d, run.model
    micro = c.batch_size // d.world_size // c.grad_accum
    ac = torch.autocast(run.device.type, dtype=run.autocast_dtype) if run.autocast_dtype is not None \
        else nullcontext()
    batch = run.sampler.next_batch()  # [batch_size // world_size, seq_len]
    chunks = batch.to(run.device, non_blocking=True).split(micro)
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    for i, x in enumerate(chunks):
        ctx = (fsdp.no_sync(model) if c.fsdp else net.no_sync()) if d.world_size > 1 and i < len(chunks) - 1 \
            else nullcontext()
        with ctx:
            with ac:
                loss = causal_lm_loss(net, x, c.vocab_slice) if c.vocab_slice else lm_loss(net, x)
            (loss / c.grad_accum).backward()
        loss_sum += loss.detach().float()
    loss_mean = loss_sum / c.grad_accum
    if d.world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(loss_mean)  # SUM (gloo has no AVG), then the mean over ranks
        loss_mean /= d.world_size
    if _placement(c) is not None:  # stepped and clipped during the backward passes (slimopt.weights.masters)
        grad_norm = run.optimizer.last_grad_norm
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, c.clip) if c.clip > 0 else None
    lr_now = run.optimizer.param_groups[0]["lr"]
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.baseline_hook is not None:
        run.baseline_hook.after_step(run.step + 1, run.optimizer)
    return loss_mean.item(), grad_norm, lr_now  # .item() waits for the device: the step's time is its real one


def _loop(run: _Run, callback, bar) -> float:
    """The steps from where the run stands to the end: logs, evaluations and checkpoints at their intervals.
    Returns the last step's loss."""
    c, d = run.c, run.d
    net = run.model
    if d.world_size > 1 and not c.fsdp:
        net = torch.nn.parallel.DistributedDataParallel(
            run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    run.model.train()
    params = [p for p in run.model.parameters() if p.requires_grad]
    eval_every = c.eval_every if c.eval_every is not None else max(1, math.ceil(run.total_steps / 8))
    step_tokens = c.batch_size * c.seq_len
    start_step, loss_val = run.step, float("nan")
    window_t, window_tokens = time.perf_counter(), 0
    for step in range(start_step, run.total_steps):
        t0 = time.perf_counter()
        loss_val, grad_norm, lr_now = _optimizer_step(run, net, params)
        run.train_time += time.perf_counter() - t0
        run.tokens += step_tokens
        window_tokens += step_tokens
        run.step = done = step + 1
        if run.checkpoint is not None and (c.save_every > 0 or c.resume) and d.main and done == start_step + 1 \
                and not c.fsdp:
            # Optimizer state is created lazily; once it exists, make sure a resume will be able to load it.
            bad = ckpt.check_weights_only_safe(run.optimizer.state_dict(), "optimizer state")
            if bad is not None:
                raise ValueError(f"method {c.method!r} cannot be checkpointed for a weights_only resume: {bad}; "
                                 f"run it without --save-every/--resume")
        rec = {"step": done, "tokens": run.tokens, "loss": loss_val, "lr": lr_now}
        run.history["train"].append((run.tokens, loss_val))
        if done % c.log_every == 0 or done == run.total_steps:
            now = time.perf_counter()
            tps = window_tokens / max(now - window_t, 1e-9)
            window_t, window_tokens = now, 0
            mem = run.probe.now()
            rec.update(tokens_per_s=tps, mem_bytes=mem,
                       **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}))
            run.logger.log("train", **rec)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tps:,.0f}", mem=f"{mem / 2**20:,.0f}MiB",
                                refresh=False)
        if eval_every and done % eval_every == 0 and done != run.total_steps:
            _evaluate(run, done)
            window_t = time.perf_counter()  # evaluation time is not training throughput
        if c.save_every and done % c.save_every == 0 and done != run.total_steps and run.checkpoint is not None:
            _save(run)
            window_t = time.perf_counter()
        if bar is not None:
            bar.update(1)
        if not math.isfinite(loss_val):
            run.logger.log("diverged", step=done, loss=loss_val)
            break
        if callback is not None:
            callback(done, rec)
    return loss_val


def _summary(run: _Run, loss_val: float, last_eval: dict, start_eval: dict | None, t_start: float,
             cpu_start: float) -> dict:
    c, d = run.c, run.d
    # with FSDP: the sum over ranks (slimopt.state_nbytes per rank by default)
    state_bytes = slimopt_state_nbytes(run.optimizer, total=True) if c.fsdp else optimizer_state_nbytes(run.optimizer)
    n_trainable = run.n_trainable
    summary = {
        "method": c.method, "model": c.model, "data": c.data, "params": run.n_params,
        "trainable_params": n_trainable, "steps": run.step, "tokens": run.tokens, "lr": run.peak_lr,
        "val_loss": last_eval["val_loss"], "val_ppl": last_eval["val_ppl"], "val_tokens": last_eval["val_tokens"],
        "start_val_loss": start_eval["val_loss"] if start_eval else None,
        "start_val_ppl": start_eval["val_ppl"] if start_eval else None,
        "final_train_loss": loss_val,
        "state_bytes": state_bytes, "state_bytes_per_param": state_bytes / max(1, n_trainable),
        "peak_mem_bytes": run.probe.peak_delta(), "peak_mem_kind": run.probe.kind,
        "tokens_per_s": run.tokens / run.train_time if run.train_time > 0 else float("nan"),
        "train_time_s": run.train_time, "device": str(run.device), "world_size": d.world_size, "rank": d.rank,
    }
    if d.world_size > 1:
        summary["ranks_agree"] = True  # checked at every evaluation, the last one included
    summary["wall_time_s"] = time.perf_counter() - t_start
    summary["cpu_time_s"] = time.process_time() - cpu_start  # all threads of this process; load-independent
    return summary


def _train(c: TrainConfig, d: _Dist, callback, t_start: float, cpu_start: float) -> dict:
    run = _build(c, d)
    _open_log(run, _resume(run) if run.checkpoint is not None else None)  # from here on the run writes (rank 0)
    bar = None
    if c.progress and d.main:
        from tqdm.auto import tqdm
        bar = tqdm(total=run.total_steps, initial=run.step, desc=c.method, unit="step", dynamic_ncols=True,
                   leave=True)
    # a loaded model (not a size built from scratch) starts somewhere worth knowing: continued pretraining is
    # judged by its held-out perplexity before and after
    from slimopt.models.llama import LLAMA_SIZES
    start_eval = _evaluate(run, 0) if run.step == 0 and c.model.lower() not in LLAMA_SIZES else None
    try:
        loss_val = _loop(run, callback, bar)
        # a collective the last step left running (a sharded factored moment's column sums) ends here, not at the
        # interpreter's exit, where a pending gloo work aborts the process
        settle = getattr(run.optimizer, "settle", None)
        if callable(settle):
            settle()
        if bar is not None:
            bar.close()
            bar = None
        last_eval = _evaluate(run, run.step)
        if run.checkpoint is not None and (c.save_every > 0 or c.resume):
            _save(run)
        summary = _summary(run, loss_val, last_eval, start_eval, t_start, cpu_start)
        run.logger.log("final", step=run.step, **summary)
    finally:
        if bar is not None:
            bar.close()
        run.logger.close()
    out = Path(c.out) if c.out is not None else None
    full = fsdp.full_model_state_dict(run.model) if c.fsdp and out is not None and c.save_model else None
    if out is not None and d.main and c.save_model:
        target = run.baseline_hook.export(run.model) if run.baseline_hook is not None else run.model
        if _placement(c) is not None:  # the model as transformers knows it: each int8 weight from its master
            full = run.optimizer.plain_state_dict(run.model, next(p.dtype for p in run.model.parameters()))
        target.save_pretrained(out / "final", **({"state_dict": full} if full is not None else {}))
        run.tokenizer.save_pretrained(out / "final")
    summary["history"] = run.history
    return summary
