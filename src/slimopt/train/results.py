"""The results files of ``slimopt compare`` and ``slimopt finetune``: results.csv (one row per run, for programs)
and results.md (the tables a person reads).

Both commands rewrite the files after every run so that a crash keeps the runs already done. Each file is written
under a temporary name and renamed into place, so a reader (or a run killed while writing) never sees half a table.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slimopt.atomic import atomic_file, write_atomic

__all__ = ["check_out_dir", "csv_cell", "write_csv", "write_json", "write_csv_and_markdown"]


def check_out_dir(out: str | os.PathLike, option: str = "--out") -> None:
    """Raise ValueError, before any work, when `out` cannot be an output folder: it, or a folder above it, is a file.

    Every command checks its output folder once at the start, so that a file where a folder goes stops a run in one
    line instead of a traceback after training.
    """
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {out} is a file; give a folder (it is created if missing)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{option} {out}: {parent} is a file, so no folder can be made under it")
            break


def csv_cell(v: Any) -> Any:
    """One value as a CSV cell: dicts as sorted JSON, floats exactly (repr; "nan" for any non-finite), None empty."""
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan"
    return "" if v is None else v


def write_csv(path: str | os.PathLike, columns: Iterable[str], rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` (their `columns`, in order) to the CSV file `path`, atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = tuple(columns)
    with atomic_file(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([csv_cell(r.get(c)) for c in columns])
    return path


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN or infinity
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path`, atomically; non-finite floats become null. Return the path."""
    return write_atomic(path, json.dumps(_json_safe(obj), indent=1, sort_keys=True) + "\n")


def write_csv_and_markdown(out: str | os.PathLike, columns: Iterable[str], rows: Iterable[dict[str, Any]],
                           markdown: str) -> Path:
    """Write `rows` (their `columns`, in order) to out/results.csv and `markdown` to out/results.md; return `out`."""
    out = Path(out)
    write_csv(out / "results.csv", columns, rows)
    write_atomic(out / "results.md", markdown)
    return out
