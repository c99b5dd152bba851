"""House rules that hold across the repository (docs/design.md, section 5): module docstrings say what and why in
a few lines, no docstring carries a date (dated figures live in docs/, next to how they were measured), nothing
points to design notes the repository does not hold, no two modules import each other (directly or around a
circle, lazy imports included), no folder holds more than 15 modules and no function runs over 100 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "slimopt"
MAX_MODULE_DOCSTRING_LINES = 15
MAX_FILES_PER_FOLDER = 15  # .py and .c files directly in one folder of src/slimopt
MAX_FUNCTION_LINES = 100  # Python functions in src/ (the C kernel is one pass by design and exempt)

# A date: 2026-12-04, 2026-12, "4 December 2026", "Dec 2026", or a bare recent year. Older years stay allowed:
# papers are cited with theirs ("Gorodkin 2004"), and a later paper by its arXiv number.
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(rf"\b\d{{4}}-\d{{2}}(?:-\d{{2}})?\b|\b{_MONTH} (?:\d{{1,2}},? )?\d{{4}}\b|\b20(?:2[5-9]|3\d)\b")
UNSHIPPED_NOTES = re.compile(r"\bDESIGN\.md\b")


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "name", "<module>"), doc


def test_module_docstrings_are_short():
    long = {}
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        name = str(path.relative_to(SRC))
        if doc and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long[name] = len(doc.splitlines())
    assert not long, (f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the detail to docs/): "
                      f"{long}")


def test_no_docstring_holds_a_date():
    dated = [f"{path.relative_to(SRC)}: {name}: {m.group(0)!r}"
             for path in _modules() for name, doc in _docstrings(path) for m in DATE.finditer(doc)]
    assert not dated, f"dated docstrings (dated figures belong in docs/): {dated}"


def test_nothing_points_to_notes_the_repository_does_not_hold():
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for folder in ("src", "tests", "benchmarks"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md", ".c", ".toml")]
    hits = [str(p.relative_to(ROOT)) for p in files if UNSHIPPED_NOTES.search(p.read_text(errors="replace"))]
    assert not hits, f"these cite design notes the repository does not hold (cite docs/design.md): {hits}"


def test_the_date_check_sees_dates_and_spares_citations():
    for dated in ("measured 2026-12-04", "on 2026-11", "4 December 2026", "Dec 2026", "in 2026"):
        assert DATE.search(dated), dated
    for fine in ("Gorodkin 2004", "arXiv 2602.23349", "dim 2048", "SC 2011", "2048 x 5461", "Jordan et al. 2024"):
        assert not DATE.search(fine), fine


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """slimopt module -> the slimopt modules it imports anywhere in its file (a function-level import counts: a
    circle closed lazily is still a circle a reader must hold)."""
    paths = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    assert not circles(import_graph()), "modules that import each other (directly or around a circle)"


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert not circles({"a": {"b"}, "b": set()})


def test_no_folder_is_crowded():
    crowded = {}
    for folder in [SRC, *(p for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        files = [p for p in folder.iterdir() if p.suffix in (".py", ".c")]
        if len(files) > MAX_FILES_PER_FOLDER:
            crowded[str(folder.relative_to(SRC.parent))] = len(files)
    assert not crowded, f"folders over {MAX_FILES_PER_FOLDER} modules (split them by what they do): {crowded}"


def test_no_function_is_too_long():
    long = [f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in _modules() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into parts a reader can hold): {long}"
