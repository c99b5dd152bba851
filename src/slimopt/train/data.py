"""Pretraining data: text sources, a held-out split, tokenization, sequence packing, cached arrays, batches.

The built-in corpora install with pip and work offline, any local text or hub dataset works too, and the packed
arrays are cached so that a second run memory-maps them.

Details: docs/modules.md, ``slimopt.train.data``.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers

from slimopt import corpora
from slimopt.atomic import atomic_dir
from slimopt.cache import cache_root
from slimopt.models.hub import hub_offline
from slimopt.train.tokenizer import DEFAULT_MAX_CHARS, load_tokenizer, tokenizer_fingerprint

BUILTIN_SOURCES = ("kjv", "bbc", "c4")
SOURCES_HELP = ("kjv (built-in), bbc (built-in), c4, hf:NAME[:CONFIG], or a path to a .txt/.jsonl/.json/.parquet "
                "file or a directory of them")
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_VAL_TOKENS = 2**19
TXT_SPLITS = ("paragraph", "line", "file")
_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
_PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
_CHUNK_DOCS = 512  # documents tokenized per batch call: big enough for the Rust batch encoder, small in memory
_FORMAT = "slimopt-packed-v1"


# --------------------------------------------------------------------------------------------------------------
# Text sources


@dataclass(frozen=True)
class TextSource:
    """A named stream of documents. `identity` changes whenever the documents could."""

    spec: str
    identity: str
    finite: bool  # False: a stream that may never end (needs a token budget)
    documents: Callable[[], Iterator[str]]


def _stable_hash(text: str, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=person).digest(), "little")


def is_held_out(text: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> bool:
    """Whether a document belongs to the validation split (see the module docstring)."""
    return _stable_hash(text, b"slimopt-val") < val_fraction * 2.0**64


def _kjv_documents() -> Iterator[str]:
    titled = corpora.kjv_chapters()
    titled.sort(key=lambda kv: _stable_hash(kv[0], b"slimopt-order"))
    for _, doc in titled:
        yield doc


def _bbc_documents() -> Iterator[str]:
    articles = sorted(corpora.bbc_articles(), key=lambda kv: _stable_hash(kv[0], b"slimopt-order"))
    for _, text in articles:
        yield text


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def check_text_file(path: Path) -> None:
    """Raise ValueError when a .txt source is not text (NUL bytes in its first 64 KiB, as binary files have)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(65536)
    if b"\0" in head:
        raise ValueError(f"data file {str(path)!r} is not text (it holds NUL bytes, as binary files do); "
                         f"give UTF-8 text")


def _txt_documents(path: Path, txt_split: str) -> Iterator[str]:
    with _open_text(path) as f:
        if txt_split == "line":
            for line in f:
                yield line.rstrip("\n")
        elif txt_split == "file":
            yield f.read()
        else:  # paragraph: runs of blank lines separate documents
            para: list[str] = []
            for line in f:
                if line.strip():
                    para.append(line.rstrip("\n"))
                elif para:
                    yield "\n".join(para)
                    para = []
            if para:
                yield "\n".join(para)


def _field(row: dict, text_field: str, where: str):
    if text_field not in row:
        raise ValueError(f"{where}: no text field {text_field!r} (fields: {', '.join(map(str, row))}); "
                         f"set text_field")
    return row[text_field]


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    with _open_text(path) as f:
        head = f.read(1)
        while head and head.isspace():
            head = f.read(1)
        if head == "[":  # a JSON array of records rather than JSON lines
            rows = json.loads(head + f.read())
            for i, row in enumerate(rows):
                value = _field(row, text_field, f"{path}[{i}]")
                if value is not None:
                    yield str(value)
            return
        first = True
        for lineno, line in enumerate(f, start=1):
            if first:
                line, first = head + line, False
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
            value = _field(row, text_field, f"{path}:{lineno}")
            if value is not None:
                yield str(value)


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set text_field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def _file_documents(path: Path, text_field: str, txt_split: str) -> Iterator[str]:
    name = path.name.lower()
    if name.endswith((".txt", ".txt.gz")):
        return _txt_documents(path, txt_split)
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return _json_documents(path, text_field)
    if name.endswith(".parquet"):
        return _parquet_documents(path, text_field)
    raise ValueError(f"unsupported data file {str(path)!r}: expected one of {', '.join(_SUFFIXES)}")


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(_SUFFIXES))
    if not files:
        raise ValueError(f"data directory {str(path)!r} holds no {', '.join(_SUFFIXES)} files")
    return files


def _hf_documents(name: str, config: str | None, text_field: str, data_files: str | None = None,
                  split: str = "train") -> Iterator[str]:
    """Stream documents of a Hugging Face dataset (or of local files through a packaged builder)."""
    if data_files is None and not Path(name).expanduser().exists() and hub_offline():
        raise ConnectionError(
            f"streaming the Hugging Face dataset {name!r} needs the hub, which is unreachable; use a local copy "
            f"instead (a directory of .jsonl/.json.gz/.parquet files, or hf:json:<glob>)")
    import datasets

    ds = datasets.load_dataset(name, config, split=split, streaming=True, data_files=data_files)
    for i, row in enumerate(ds):
        value = _field(row, text_field, f"dataset {name!r} row {i}")
        if value is not None:
            yield str(value)


def resolve_source(source: str, text_field: str = "text", txt_split: str = "paragraph") -> TextSource:
    """Turn a source string into a TextSource; raises for unknown names and missing paths."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"data source must be a non-empty string: {SOURCES_HELP}")
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"txt_split must be one of {', '.join(TXT_SPLITS)}, got {txt_split!r}")
    key = source.lower()
    if key == "kjv":
        ident = f"kjv|{corpora.KJV}=={corpora.version(corpora.KJV)}|chapters-v1"
        return TextSource(source, ident, True, _kjv_documents)
    if key == "bbc":
        ident = f"bbc|{corpora.BBC}=={corpora.version(corpora.BBC)}|articles-v1"
        return TextSource(source, ident, True, _bbc_documents)
    if key == "c4":
        return TextSource(source, f"hf|allenai/c4|en|train|{text_field}", False,
                          lambda: _hf_documents("allenai/c4", "en", text_field))
    if key.startswith("hf:"):
        rest = source[3:]
        name, _, config = rest.partition(":")
        if not name:
            raise ValueError(f"data source {source!r}: expected hf:NAME[:CONFIG]")
        if name in _PACKAGED_BUILDERS:
            if not config:
                raise ValueError(f"data source {source!r}: the {name} builder needs files, "
                                 f"e.g. hf:{name}:/path/*.{name}")
            files = sorted(Path(f) for f in glob.glob(os.path.expanduser(config), recursive=True)
                           if Path(f).is_file())
            if not files:
                raise FileNotFoundError(f"data source {source!r}: no files match {config!r}")
            ident = f"hf|{name}|{config}|{_files_identity(files)}|{text_field}"
            pattern = os.path.expanduser(config)
            return TextSource(source, ident, True, lambda: _hf_documents(name, None, text_field, data_files=pattern))
        local = Path(name).expanduser()
        if local.exists():  # a dataset folder (or script) on disk: finite, and its files are its identity
            files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
            ident = f"hf|{local.resolve()}|{config}|{_files_identity(files)}|{text_field}"
            return TextSource(source, ident, True, lambda: _hf_documents(str(local), config or None, text_field))
        return TextSource(source, f"hf|{name}|{config}|train|{text_field}", False,
                          lambda: _hf_documents(name, config or None, text_field))

    path = Path(source).expanduser()
    if path.exists():
        files = _local_files(path)  # validates suffixes / emptiness now, before any work
        if path.is_file():
            _file_documents(path, text_field, txt_split)  # raises on an unsupported suffix
        for f in files:
            if f.name.lower().endswith((".txt", ".txt.gz")):
                check_text_file(f)
        ident = f"files|{path.resolve()}|{_files_identity(files)}|{text_field}|{txt_split}"

        def docs() -> Iterator[str]:
            for f in files:
                yield from _file_documents(f, text_field, txt_split)

        return TextSource(source, ident, True, docs)
    looks_like_path = any(c in source for c in "/\\") or source.startswith((".", "~")) or \
        source.lower().endswith(_SUFFIXES)
    if looks_like_path:
        raise FileNotFoundError(f"data path {source!r} does not exist")
    raise ValueError(f"unknown data source {source!r}; sources are: {SOURCES_HELP}")


def _files_identity(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def iter_documents(source: str | TextSource, split: str = "all", val_fraction: float = DEFAULT_VAL_FRACTION,
                   text_field: str = "text", txt_split: str = "paragraph") -> Iterator[str]:
    """Non-empty documents of a source; split "train" / "val" applies the held-out rule, "all" does not."""
    if split not in ("all", "train", "val"):
        raise ValueError(f"split must be 'all', 'train' or 'val', got {split!r}")
    _check_fraction(val_fraction)
    src = source if isinstance(source, TextSource) else resolve_source(source, text_field, txt_split)
    for doc in src.documents():
        if not doc or not doc.strip():
            continue
        if split == "all" or (split == "val") == is_held_out(doc, val_fraction):
            yield doc


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")


def tokenizer_for_source(
    source: str,
    name: str | None = None,
    vocab_size: int = 8192,
    *,
    text_field: str = "text",
    txt_split: str = "paragraph",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | Path | None = None,
    fallback: bool = False,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> transformers.PreTrainedTokenizerFast:
    """`load_tokenizer` for a data source: a named tokenizer, or a BPE trained on the training documents only
    (the first `max_chars` characters of them)."""
    src = resolve_source(source, text_field, txt_split)
    return load_tokenizer(
        name,
        lambda: iter_documents(src, "train", val_fraction),
        vocab_size,
        cache_dir,
        corpus_id=f"{src.identity}|train|vf={float(val_fraction)!r}",
        fallback=fallback,
        max_chars=max_chars,
    )


# --------------------------------------------------------------------------------------------------------------
# Packing


@dataclass
class PackedData:
    """Packed token blocks. train: [num_train_blocks, seq_len], val: [num_val_blocks, seq_len] (numpy uint16 or
    int32, memory-mapped when read from the cache); labels are the inputs (the model shifts)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    seq_len: int
    eos_token_id: int
    source: str
    meta: dict = field(default_factory=dict)

    @property
    def train_tokens(self) -> int:
        return int(self.train.shape[0] * self.train.shape[1])

    @property
    def val_tokens(self) -> int:
        return int(self.val.shape[0] * self.val.shape[1])

    def describe(self) -> str:
        m = self.meta
        docs = ""
        if "train_documents" in m:
            docs = f"{m['train_documents']:,} train / {m['val_documents']:,} held-out documents, "
        origin = "cache hit" if m.get("cache_hit") else "tokenized"
        return (f"{self.source}: {docs}train {self.train_tokens:,} tokens = {self.train.shape[0]:,} blocks x "
                f"{self.seq_len}, val {self.val_tokens:,} tokens = {self.val.shape[0]:,} blocks; vocab "
                f"{self.vocab_size:,} ({self.train.dtype}); {origin} in {m.get('seconds', 0.0):.2f} s"
                + (f" [{m['cache_path']}]" if m.get("cache_path") else ""))

    def save(self, folder: str | Path) -> Path:
        """Write train.npy, val.npy and meta.json into a new `folder`, atomically (written aside, then renamed).

        Raises FileExistsError when `folder` already holds packed data.
        """
        folder = Path(folder)
        if (folder / "meta.json").exists():
            raise FileExistsError(f"{folder} already holds packed data")
        # The rename replaces only an empty folder: when another process (another rank, a parallel run) finished
        # first, FileExistsError, and its data is what we would have written.
        with atomic_dir(folder) as tmp:
            np.save(tmp / "train.npy", np.ascontiguousarray(self.train))
            np.save(tmp / "val.npy", np.ascontiguousarray(self.val))
            meta = {k: v for k, v in self.meta.items() if k not in ("cache_hit", "cache_path", "seconds")}
            header = dict(format=_FORMAT, vocab_size=self.vocab_size, seq_len=self.seq_len,
                          eos_token_id=self.eos_token_id, source=self.source, meta=meta)
            (tmp / "meta.json").write_text(json.dumps(header, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> PackedData:
        folder = Path(folder)
        header = json.loads((folder / "meta.json").read_text())
        if header.get("format") != _FORMAT:
            raise ValueError(f"{folder} holds packed data of format {header.get('format')!r}, expected {_FORMAT!r}")
        return cls(
            train=np.load(folder / "train.npy", mmap_mode="r"),
            val=np.load(folder / "val.npy", mmap_mode="r"),
            vocab_size=int(header["vocab_size"]),
            seq_len=int(header["seq_len"]),
            eos_token_id=int(header["eos_token_id"]),
            source=header["source"],
            meta=dict(header.get("meta", {})),
        )


def _encode(tokenizer, docs: list[str]) -> list[list[int]]:
    backend = tokenizer.backend_tokenizer
    # encode_batch_fast skips character offsets, which packing never needs (tokenizers >= 0.21).
    enc = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in enc(docs, add_special_tokens=False)]


class _Stream:
    """Accumulates token ids of one split (each document + EOS) up to a cap."""

    def __init__(self, cap: float, dtype):
        self.cap = cap
        self.dtype = dtype
        self.parts: list[np.ndarray] = []
        self.tokens = 0
        self.documents = 0

    @property
    def full(self) -> bool:
        return self.tokens >= self.cap

    def add(self, ids_per_doc: list[list[int]], eos: int) -> None:
        for ids in ids_per_doc:
            if self.full:
                return
            arr = np.empty(len(ids) + 1, dtype=self.dtype)
            arr[:-1] = ids
            arr[-1] = eos
            self.parts.append(arr)
            self.tokens += arr.size
            self.documents += 1

    def blocks(self, seq_len: int, max_blocks: float) -> np.ndarray:
        flat = np.concatenate(self.parts) if self.parts else np.empty(0, dtype=self.dtype)
        n = int(min(flat.size // seq_len, max_blocks))
        return np.ascontiguousarray(flat[: n * seq_len].reshape(n, seq_len))


def prepare_data(
    source: str,
    tokenizer: transformers.PreTrainedTokenizerFast,
    seq_len: int,
    max_train_tokens: int | None = None,
    val_tokens: int = DEFAULT_VAL_TOKENS,
    text_field: str = "text",
    cache_dir: str | Path | None = None,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    txt_split: str = "paragraph",
    use_cache: bool = True,
) -> PackedData:
    """Tokenize and pack a source into train/validation blocks of seq_len tokens (cached on disk).

    max_train_tokens: cap on training tokens (rounded down to whole blocks); None takes the whole source, and is
        refused for unbounded streams such as "c4". Streams are read only until both caps are met.
    val_tokens: cap on validation tokens (whole blocks) taken from the held-out documents.
    val_fraction: share of documents held out (by content hash; see the module docstring).
    """
    t0 = time.perf_counter()
    seq_len = int(seq_len)
    eos = _check_packing(tokenizer, seq_len, max_train_tokens, val_tokens, val_fraction)
    src = resolve_source(source, text_field, txt_split)
    if max_train_tokens is None and not src.finite:
        raise ValueError(f"data source {source!r} is an unbounded stream: set max_train_tokens")

    vocab_size = len(tokenizer)
    key_fields = [_FORMAT, src.identity, text_field, txt_split, tokenizer_fingerprint(tokenizer), seq_len,
                  None if max_train_tokens is None else int(max_train_tokens), int(val_tokens), float(val_fraction)]
    key = hashlib.sha256(json.dumps(key_fields).encode()).hexdigest()[:20]
    folder = cache_root(cache_dir) / "data" / key
    if use_cache and (folder / "meta.json").is_file():
        data = PackedData.load(folder)
        data.meta.update(cache_hit=True, cache_path=str(folder), seconds=time.perf_counter() - t0)
        return data

    train_cap = float("inf") if max_train_tokens is None else (int(max_train_tokens) // seq_len) * seq_len
    val_cap = (int(val_tokens) // seq_len) * seq_len
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    train, val = _Stream(train_cap, dtype), _Stream(val_cap, dtype)
    read = _fill(src, tokenizer, eos, val_fraction, train, val)
    if read == 0:
        raise ValueError(f"data source {source!r} contains no non-empty documents")
    train_blocks = train.blocks(seq_len, train_cap // seq_len)
    val_blocks = val.blocks(seq_len, val_cap // seq_len)
    if train_blocks.shape[0] == 0:
        raise ValueError(f"data source {source!r} yields {train.tokens:,} training tokens, fewer than one block of "
                         f"seq_len={seq_len}: lower seq_len or use a larger corpus")
    if val_blocks.shape[0] == 0:
        raise ValueError(_no_held_out_message(source, read, val.tokens, val.documents, seq_len, val_fraction,
                                              txt_split))
    meta = dict(
        documents_read=read,
        train_documents=train.documents,
        val_documents=val.documents,
        train_tokens_packed=train.tokens,  # including the dropped tail of the last partial block
        val_tokens_packed=val.tokens,
        val_fraction=float(val_fraction),
        text_field=text_field,
        txt_split=txt_split,
        identity=src.identity,
        tokenizer=tokenizer_fingerprint(tokenizer),
    )
    data = PackedData(train_blocks, val_blocks, vocab_size, seq_len, int(eos), source, meta)
    if use_cache:
        try:
            data.save(folder)
        except FileExistsError:
            pass  # written meanwhile by a concurrent run with the same key, hence the same arrays
        data.meta["cache_path"] = str(folder)
    data.meta.update(cache_hit=False, seconds=time.perf_counter() - t0)
    return data


def _check_packing(tokenizer, seq_len: int, max_train_tokens: int | None, val_tokens: int,
                   val_fraction: float) -> int:
    """Refuse settings that cannot pack a block, before any document is read; -> the EOS id that separates
    packed documents."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (a block needs a next token to predict), got {seq_len}")
    if max_train_tokens is not None and int(max_train_tokens) < seq_len:
        raise ValueError(f"max_train_tokens ({max_train_tokens}) must be at least seq_len ({seq_len})")
    if int(val_tokens) < seq_len:
        raise ValueError(f"val_tokens ({val_tokens}) must be at least seq_len ({seq_len}) for one validation block")
    _check_fraction(val_fraction)
    if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer must be a transformers.PreTrainedTokenizerFast, got {type(tokenizer).__name__}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token, which separates packed documents")
    return eos


def _fill(src: TextSource, tokenizer, eos: int, val_fraction: float, train: _Stream, val: _Stream) -> int:
    """Tokenize the source's non-empty documents into the two streams, each to its cap, a chunk of documents at a
    time (the batch encoder's unit); a stream is read only until both are full. -> documents read."""
    read = 0
    chunk: list[str] = []

    def flush() -> None:
        held = [is_held_out(d, val_fraction) for d in chunk]
        tr = [d for d, h in zip(chunk, held) if not h]
        va = [d for d, h in zip(chunk, held) if h]
        if tr and not train.full:
            train.add(_encode(tokenizer, tr), eos)
        if va and not val.full:
            val.add(_encode(tokenizer, va), eos)
        chunk.clear()

    for doc in src.documents():
        if not doc or not doc.strip():
            continue
        read += 1
        chunk.append(doc)
        if len(chunk) >= _CHUNK_DOCS:
            flush()
            if train.full and val.full:
                break
    flush()
    return read


# --------------------------------------------------------------------------------------------------------------
# Batches


def _no_held_out_message(source: str, documents: int, tokens: int, held_docs: int, seq_len: int,
                         val_fraction: float, txt_split: str) -> str:
    """Why a source gave no held-out block, and the option that helps: the held-out split takes whole documents
    (about val_fraction of them), so a source read as a few documents holds none out."""
    what = (f"data source {source!r} holds {documents:,} document(s), of which {held_docs} ({tokens:,} tokens) "
            f"fall in the held-out split (about {val_fraction:.0%} of documents, chosen by content)")
    if documents < 10 / val_fraction:
        if source.lower().endswith((".txt", ".txt.gz")) and txt_split != "line":
            unit = "blank lines separate documents" if txt_split == "paragraph" else "the whole file is one document"
            return (f"{what}: too few documents for a held-out block of --seq-len {seq_len} ({unit} with "
                    f"--txt-split {txt_split}); --txt-split line makes each line a document")
        return f"{what}: too few documents for a held-out block of --seq-len {seq_len}; give more documents"
    return f"{what}: fewer than one block of --seq-len {seq_len}; lower --seq-len or give a larger corpus"


def _as_blocks(data) -> np.ndarray | torch.Tensor:
    if isinstance(data, PackedData):
        raise ValueError("pass data.train or data.val (a [num_blocks, seq_len] array), not the PackedData")
    if not hasattr(data, "shape") or len(data.shape) != 2 or data.shape[0] == 0:
        shape = getattr(data, "shape", None)
        raise ValueError(f"data must be a non-empty [num_blocks, seq_len] array, got shape {shape}")
    return data


def _rows(data, idx: np.ndarray) -> torch.Tensor:
    # -> LongTensor [len(idx), seq_len]; uint16 has no torch counterpart on older versions, so widen in numpy.
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(idx)].long()
    return torch.from_numpy(np.asarray(data[idx], dtype=np.int64))


def _mix(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{epoch}".encode(), digest_size=8, person=b"slimopt-epoch").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class BatchSampler:
    """Seeded, resumable batches of packed blocks for one rank of a data-parallel run.

    The global batch stream is the concatenation of per-epoch permutations of all blocks (each epoch reshuffled
    with a seed derived from (seed, epoch)); global batch i is stream items [i*B, (i+1)*B), so every block is seen
    exactly once per epoch and a batch may span two epochs. Rank r receives rows [r*B/W, (r+1)*B/W) of each global
    batch: the ranks together see exactly the single-process batch. The state (epoch, position) is global, so a run
    may resume on a different number of ranks with the same global batch size.
    """

    def __init__(self, data, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.data = _as_blocks(data)  # [N, seq_len]
        batch_size, world_size, rank = int(batch_size), int(world_size), int(rank)
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
        self.num_blocks = int(self.data.shape[0])
        self.batch_size = batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.local_batch_size = batch_size // world_size
        self.epoch = 0
        self.position = 0  # index of the next block within this epoch's permutation
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            self._perm = torch.randperm(self.num_blocks, generator=g).numpy()
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> np.ndarray:
        """Block indices of this rank's part of the next global batch (advances the state)."""
        picked = []
        need = self.batch_size
        while need:
            perm = self._permutation(self.epoch)
            take = min(need, self.num_blocks - self.position)
            picked.append(perm[self.position:self.position + take])
            self.position += take
            need -= take
            if self.position == self.num_blocks:
                self.epoch += 1
                self.position = 0
        global_idx = np.concatenate(picked)
        lo = self.rank * self.local_batch_size
        return global_idx[lo:lo + self.local_batch_size]

    def next_batch(self) -> torch.Tensor:
        """-> LongTensor [batch_size // world_size, seq_len]."""
        return _rows(self.data, self.next_indices())

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return dict(seed=self.seed, epoch=self.epoch, position=self.position, num_blocks=self.num_blocks,
                    batch_size=self.batch_size)

    def load_state_dict(self, sd: dict) -> None:
        def as_int(k):
            v = sd[k]
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)

        missing = {"seed", "epoch", "position", "num_blocks", "batch_size"} - set(sd)
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(sorted(missing))}")
        if as_int("num_blocks") != self.num_blocks:
            raise ValueError(f"sampler state is for {as_int('num_blocks')} blocks, this data has {self.num_blocks}")
        if as_int("batch_size") != self.batch_size:
            raise ValueError(f"sampler state is for global batch_size {as_int('batch_size')}, "
                             f"this sampler has {self.batch_size}")
        if not 0 <= as_int("position") < self.num_blocks:
            raise ValueError(f"sampler state position {as_int('position')} out of range")
        self.seed, self.epoch, self.position = as_int("seed"), as_int("epoch"), as_int("position")


def val_batches(data, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[torch.Tensor]:
    """Every validation block exactly once, in order, as LongTensors [<= batch_size, seq_len].

    With world_size > 1, rank r takes blocks r, r+W, r+2W, ...: the ranks partition the set (sum the token losses
    and counts across ranks for the true mean).
    """
    data = _as_blocks(data)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if not 0 <= int(rank) < int(world_size):
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    idx = np.arange(int(rank), int(data.shape[0]), int(world_size))
    for lo in range(0, idx.size, int(batch_size)):
        yield _rows(data, idx[lo:lo + int(batch_size)])
