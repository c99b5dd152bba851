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

__all__ = ["csv_cell", "write_csv_and_markdown"]


def csv_cell(v: Any) -> Any:
    """One value as a CSV cell: dicts as sorted JSON, floats exactly (repr; "nan" for any non-finite), None empty."""
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan"
    return "" if v is None else v


def write_csv_and_markdown(out: str | os.PathLike, columns: Iterable[str], rows: Iterable[dict[str, Any]],
                           markdown: str) -> Path:
    """Write `rows` (their `columns`, in order) to out/results.csv and `markdown` to out/results.md; return `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    columns = tuple(columns)
    with open(out / "results.csv.tmp", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([csv_cell(r.get(c)) for c in columns])
    os.replace(out / "results.csv.tmp", out / "results.csv")
    (out / "results.md.tmp").write_text(markdown)
    os.replace(out / "results.md.tmp", out / "results.md")
    return out
