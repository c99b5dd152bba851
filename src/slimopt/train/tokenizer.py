"""Tokenizers for pretraining: any Hugging Face tokenizer, or a byte-level BPE trained locally and cached.

The GaLore and FRUGAL experiments (arXiv 2403.03507, 2411.07837) tokenize C4 with "t5-base". Offline, or for a
corpus of one's own, `load_tokenizer(None, texts, vocab_size)` trains a byte-level BPE (Sennrich et al.,
arXiv 1508.07909; byte-level alphabet as in GPT-2) with the `tokenizers` library: a few MB of text take about a
second. The result is cached under `<cache root>/tokenizers/<key>/tokenizer.json`, the key hashing the corpus
identity, the vocabulary size and the training settings, so a second run loads it instantly.

Cache root: the `cache_dir` argument, else ``slimopt.cache.cache_root()``.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from slimopt.atomic import write_atomic
from slimopt.cache import cache_root
from slimopt.models.hub import from_hub
from slimopt.models.smollm2 import SMOLLM2, load_smollm2_tokenizer

EOS_TOKEN = "<|endoftext|>"
# Training text beyond this many characters adds little to a BPE vocabulary of <= 64k and costs minutes.
DEFAULT_MAX_CHARS = 64 * 2**20
_FORMAT = "slimopt-bpe-v1"  # bump when the trained tokenizer's recipe changes, so stale caches are not reused

Texts = Iterable[str] | Callable[[], Iterable[str]]


def tokenizer_fingerprint(tokenizer: transformers.PreTrainedTokenizerFast) -> str:
    """A short hash of everything that decides token ids (vocab, merges, normalizer, special tokens)."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    h.update(f"|eos={tokenizer.eos_token_id}|n={len(tokenizer)}".encode())
    return h.hexdigest()[:16]


def load_tokenizer(
    name: str | None,
    texts: Texts | None,
    vocab_size: int,
    cache_dir: str | Path | None = None,
    *,
    corpus_id: str | None = None,
    fallback: bool = False,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> transformers.PreTrainedTokenizerFast:
    """Load a Hugging Face tokenizer by name/path, or train (and cache) a byte-level BPE on `texts`.

    name: a hub name ("t5-base"), a local tokenizer directory or tokenizer.json file, or None to train a BPE.
    texts: training documents for the BPE (an iterable, or a zero-argument callable returning one so that a
        cache hit never reads the corpus). Needed when name is None or fallback applies.
    vocab_size: target BPE vocabulary including the EOS token (ignored for a named tokenizer).
    corpus_id: a stable identity of `texts` (e.g. "kjv|train"). With it the cache key needs no pass over the
        texts; without it the texts are read and their content hashed.
    fallback: when the named tokenizer cannot be loaded (offline hub), train a BPE on `texts` with a warning
        instead of raising.
    max_chars: at most this many characters of `texts` train the BPE (documents are not cut; the last one that
        crosses the limit is the last one used).
    The returned tokenizer always has an EOS token (documents are joined with it when packing).
    """
    if name is not None:
        try:
            return _load_named(name)
        except (OSError, ValueError) as err:
            if not fallback or texts is None:
                raise
            warnings.warn(f"{err}; training a byte-level BPE with vocab_size={vocab_size} on the corpus instead",
                          stacklevel=2)
    if texts is None:
        raise ValueError("texts are required to train a byte-level BPE tokenizer (name is None)")
    return _train_or_load_bpe(texts, vocab_size, cache_dir, corpus_id, max_chars)


def _load_named(name: str) -> transformers.PreTrainedTokenizerFast:
    path = Path(name).expanduser()
    if name == SMOLLM2:  # the offline pretrained decoder's own tokenizer (slimopt.models.smollm2)
        tok = load_smollm2_tokenizer()
    elif path.is_file():
        if path.suffix != ".json":
            raise ValueError(f"tokenizer file {str(path)!r} must be a tokenizers JSON file (tokenizer.json)")
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        if tok.eos_token is None and EOS_TOKEN in tok.get_vocab():
            tok.eos_token = EOS_TOKEN
    elif path.is_dir():
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
    elif name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"tokenizer path {name!r} does not exist")
    else:
        tok = from_hub(
            lambda offline: transformers.AutoTokenizer.from_pretrained(name, local_files_only=offline),
            lambda where, err: f"tokenizer {name!r} is not a local path and could not be loaded from {where}; "
                               f"pass no tokenizer name to train a byte-level BPE on the corpus ({err})")
    if not isinstance(tok, transformers.PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer {name!r} has no fast (Rust tokenizers) implementation, which packing needs")
    if tok.eos_token is None:
        # Encoders such as BERT have no EOS; their SEP token separates segments and serves the same purpose.
        if tok.sep_token is None:
            raise ValueError(f"tokenizer {name!r} has neither an EOS nor a SEP token to separate documents")
        tok.eos_token = tok.sep_token
    return tok


def _wrap(raw: Tokenizer, source: str) -> transformers.PreTrainedTokenizerFast:
    # pad = eos: packed blocks never need padding, but collators and generate() expect a pad id to exist.
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.name_or_path = source
    return tok


def _limited(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for t in texts:
        if total >= max_chars:
            return
        total += len(t)
        yield t


def _train_or_load_bpe(texts: Texts, vocab_size: int, cache_dir, corpus_id: str | None,
                       max_chars: int) -> transformers.PreTrainedTokenizerFast:
    vocab_size = int(vocab_size)
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 byte symbols + EOS) for a byte-level BPE, "
                         f"got {vocab_size}")
    if int(max_chars) < 1:
        raise ValueError(f"max_chars must be positive, got {max_chars}")

    def fresh() -> Iterable[str]:
        return texts() if callable(texts) else texts

    materialized: list[str] | None = None
    if corpus_id is None:
        # No identity given: the content is the identity. Keep the texts to train on after hashing them.
        materialized = list(_limited(fresh(), max_chars))
        h = hashlib.sha256()
        for t in materialized:
            h.update(hashlib.sha256(t.encode("utf-8")).digest())
        corpus_key = "sha256:" + h.hexdigest()
    else:
        corpus_key = "id:" + corpus_id
    key = hashlib.sha256(json.dumps([_FORMAT, corpus_key, vocab_size, int(max_chars)]).encode()).hexdigest()[:20]
    folder = cache_root(cache_dir) / "tokenizers" / key
    path = folder / "tokenizer.json"
    if path.is_file():
        return _wrap(Tokenizer.from_file(str(path)), str(folder))

    docs = materialized if materialized is not None else _limited(fresh(), max_chars)
    counted = _Counted(docs)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a merge seen once is noise, and would make the vocabulary depend on a single document
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    raw.train_from_iterator(counted, trainer=trainer)
    if counted.docs == 0 or counted.chars == 0:
        raise ValueError("cannot train a tokenizer on an empty corpus (no non-empty documents)")

    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, raw.to_str())  # a concurrent reader (another rank, another run) never sees half a file
    meta = dict(format=_FORMAT, corpus=corpus_key, vocab_size_requested=vocab_size,
                vocab_size=raw.get_vocab_size(), documents=counted.docs, chars=counted.chars)
    write_atomic(folder / "meta.json", json.dumps(meta, indent=1))
    return _wrap(raw, str(folder))


class _Counted:
    """Iterates documents, skipping empty ones and counting what the trainer saw."""

    def __init__(self, docs: Iterable[str]):
        self._docs = docs
        self.docs = 0
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        for d in self._docs:
            if d:
                self.docs += 1
                self.chars += len(d)
                yield d

