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
