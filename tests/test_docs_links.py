"""What README.md and docs/*.md point to exists in the repository: every relative link (and the heading its anchor
names), every file path they mention, and nothing refers to a file the repository does not ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHIPPED = ("src", "tests", "benchmarks", "docs")

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
EXT = r"(?:py|md|json|csv|png|sh|c|h|txt|toml|ya?ml|jsonl|log)"
# a path: words joined by slashes, optionally ../ first (a bare file name is a name, not a path; see SOURCE_NAME)
PATH = re.compile(r"(?<![\w$./~:@-])(?:\.\./)*[A-Za-z0-9_][\w.+-]*(?:/[\w.+-]+)+/?")
SOURCE_NAME = re.compile(r"(?<![\w$./~:@-])[A-Za-z0-9_][\w+-]*\.(?:py|c|sh)(?![\w/])")
REPO_DIRS = ("docs/", "tests/", "benchmarks/", "src/", "slimopt/", "results/", "bench/", "img/")


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _files() -> list[str]:
    files = [p.name for p in ROOT.iterdir() if p.is_file()]
    for d in SHIPPED:
        files += [str(p.relative_to(ROOT)) for p in (ROOT / d).rglob("*") if "__pycache__" not in p.parts]
    return files


FILES = _files()


def _exists(mention: str, doc: Path) -> bool:
    """A path exists relative to the document, the repository, src/ or src/slimopt/, or as the tail of a file's
    path (docs name modules by their package path: `routes/choice.py`)."""
    m = mention.rstrip("/")
    if any((base / m).exists() for base in (doc.parent, ROOT, ROOT / "src", ROOT / "src" / "slimopt")):
        return True
    return any(f == m or f.endswith("/" + m) for f in FILES)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _prose(text: str) -> str:
    """The text without its links' targets and URLs (checked by test_relative_links, or not local)."""
    text = re.sub(r"\]\([^)]*\)", "]()", text)
    return re.sub(r"https?://\S+", "", text)


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_relative_links(doc):
    broken = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{_ids(doc)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_mentioned_paths_exist(doc):
    text = _prose(doc.read_text())
    missing = []
    for m in PATH.finditer(text):
        mention = m.group(0).rstrip(".")
        if not (re.search(rf"\.{EXT}/?$", mention) or mention.startswith(REPO_DIRS) or mention.startswith("../")):
            continue  # "B/param", "x1/4", "owner/repo": not paths
        if re.search(r"--out[ =]$", text[max(0, m.start() - 6):m.start()]):
            continue  # where a command writes
        if not _exists(mention, doc):
            missing.append(mention)
    for m in SOURCE_NAME.finditer(text):
        if not _exists(m.group(0), doc):
            missing.append(m.group(0))
    assert not missing, f"{_ids(doc)} mentions paths the repository does not hold: {sorted(set(missing))}"


def test_the_checks_see_what_they_should(tmp_path):
    """The extraction finds a broken link, a missing path and a wrong anchor, and passes the usual forms."""
    doc = tmp_path / "x.md"
    doc.write_text("# A title: with `code`, and more\n")
    assert anchors(doc) == {"a-title-with-code-and-more"}
    text = "see [t](docs/nowhere.md), tests/test_nowhere.py, B/param, x1/4, `--out runs/x`, routes/choice.py"
    found = [m.group(0) for m in PATH.finditer(_prose(text))]
    assert "tests/test_nowhere.py" in found and "routes/choice.py" in found and "docs/nowhere.md" not in found
    assert not _exists("tests/test_nowhere.py", ROOT / "README.md")
    assert _exists("routes/choice.py", ROOT / "README.md")
    assert [m.group(1) for m in LINK.finditer(text)] == ["docs/nowhere.md"]
