"""A small real corpus and a fast training configuration shared by the pretraining tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slimopt.train.loop import TrainConfig

VOCAB = 512


def write_corpus(folder: Path, chapters: int = 120) -> Path:
    """The first `chapters` KJV chapters (in the data layer's fixed order) as a local .txt file, one paragraph each.

    ~400 KB of real text: enough for a 512-token BPE and a held-out split of a few thousand tokens.
    """
    from slimopt.train.data import iter_documents
    docs = []
    for i, doc in enumerate(iter_documents("kjv")):
        if i == chapters:
            break
        docs.append(doc.replace("\n\n", "\n"))
    path = Path(folder) / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def fast_config(corpus: Path, cache: Path, **overrides) -> TrainConfig:
    """Tiny LLaMA, 512-token BPE, 8 x 32-token batches: a step takes milliseconds."""
    base = TrainConfig(model="tiny", data=str(corpus), vocab_size=VOCAB, seq_len=32, batch_size=8, max_steps=8,
                       eval_tokens=1024, eval_every=0, progress=False, tensorboard=False, save_model=False,
                       threads=1, cache_dir=str(cache))
    return replace(base, **overrides)


class Crash(Exception):
    """What ``crash_at`` raises: a run stopped mid-way, as a kill would stop it."""


def crash_at(step_to_die: int):
    """A train() callback that stops the run after step `step_to_die` (its checkpoints up to then are written)."""
    def callback(step, record):
        if step == step_to_die:
            raise Crash(f"killed after step {step}")
    return callback


def train_losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every train record in a run's metrics.jsonl."""
    from slimopt.train.logger import read_jsonl
    return [(r["step"], r["loss"]) for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]


def eval_losses(out: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every eval record in a run's metrics.jsonl."""
    from slimopt.train.logger import read_jsonl
    return [(r["step"], r["val_loss"]) for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"]


def killed_and_resumed(args: list[str], tmp_path: Path, after_steps: int = 7) -> tuple[Path, Path]:
    """`slimopt train ARGS` run whole into tmp_path/whole, and into tmp_path/broken killed with SIGKILL once a
    checkpoint exists and `after_steps` steps are logged, then resumed there with --resume: (whole, broken)."""
    import signal
    import subprocess
    import sys
    import time

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    cmd = [sys.executable, "-m", "slimopt", "train", *args]
    subprocess.run(cmd + ["--out", str(whole)], check=True, capture_output=True, timeout=900)
    proc = subprocess.Popen(cmd + ["--out", str(broken)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # kill once a few checkpoints exist
        if (broken / "checkpoint.pt").exists() and len(train_losses(broken)) >= after_steps:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    subprocess.run(cmd + ["--out", str(broken), "--resume"], check=True, capture_output=True, timeout=900)
    return whole, broken
