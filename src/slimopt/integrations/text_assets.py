"""A tokenizer folder and a text-dataset folder in Hugging Face layouts, from any slimopt data source, for engines
that read those layouts offline: torchtitan takes the tokenizer as ``--hf-assets-path`` and the text as
``--dataloader.dataset c4_test --dataloader.dataset-path`` (a folder of JSON lines with a "text" field).

    python -m slimopt.integrations.text_assets --data kjv --out assets/kjv

The tokenizer is the one ``slimopt train --data SOURCE`` uses (a byte-level BPE trained on the training documents
only, cached), and the text holds the training documents only, so a held-out split stays held out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from slimopt.atomic import atomic_dir
from slimopt.train.data import iter_documents, tokenizer_for_source

__all__ = ["write_assets"]


def write_assets(out: str | os.PathLike, data: str = "kjv", vocab_size: int = 8192,
                 max_chars: int | None = None) -> tuple[Path, Path]:
    """Write ``out/tokenizer`` (tokenizer.json and its config) and ``out/text/train.jsonl`` (one training document
    of `data` per line, at most `max_chars` characters in all) and return the two folders. Each is written under a
    temporary name and renamed into place, so an interrupted call leaves no half folder."""
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be positive or None, got {max_chars!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, text_dir = out / "tokenizer", out / "text"
    for final in (tokenizer_dir, text_dir):
        if final.exists():
            raise FileExistsError(f"{final} exists: remove it or choose another --out")

    with atomic_dir(tokenizer_dir) as staged:
        tokenizer_for_source(data, vocab_size=vocab_size).save_pretrained(staged)

    chars = 0
    with atomic_dir(text_dir) as staged, open(staged / "train.jsonl", "w", encoding="utf-8") as f:
        for doc in iter_documents(data, "train"):
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            chars += len(doc)
            if max_chars is not None and chars >= max_chars:
                break
    return tokenizer_dir, text_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m slimopt.integrations.text_assets",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="kjv", help="a slimopt data source (`slimopt train --data`): kjv, bbc, a file, "
                                                  "a folder or a hub dataset")
    ap.add_argument("--out", required=True, help="folder to write tokenizer/ and text/ into")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-chars", type=int, default=None, help="stop the text after this many characters")
    args = ap.parse_args(argv)
    tokenizer_dir, text_dir = write_assets(args.out, args.data, args.vocab_size, args.max_chars)
    print(f"tokenizer: {tokenizer_dir}\ntext:      {text_dir}")


if __name__ == "__main__":
    main()
