"""The table of benchmarks/torchtitan_gpu.sh: one row per torchtitan log (tokens/s, peak memory, loss), read from
the lines torchtitan's MetricsProcessor prints every log-freq steps.

    python benchmarks/torchtitan_report.py gpu-bench/torchtitan --md gpu-bench/torchtitan.md \
        --json gpu-bench/torchtitan.json

tokens/s is the median of the logged intervals after the first (which holds compilation and warm-up); memory is
the largest peak of reserved device memory over the logged intervals (torchtitan resets the peak at each log).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([-\d.naif]+)\s+.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


def read_log(path: Path) -> dict:
    """The logged steps of one run, or why there are none (the last error line)."""
    text = ANSI.sub("", path.read_text(errors="replace"))
    steps = [(int(m[1]), float(m[2]), float(m[3]), int(m[4].replace(",", ""))) for m in STEP.finditer(text)]
    row: dict = {"run": path.stem, "logged_steps": len(steps)}
    if not steps:
        errors = [line.strip() for line in text.splitlines() if "Error" in line or "error:" in line]
        row["failed"] = errors[-1][:200] if errors else "no step was logged"
        return row
    rates = [s[3] for s in steps[1:]] or [steps[0][3]]
    row.update(step=steps[-1][0], loss=steps[-1][1], tokens_per_s=statistics.median(rates),
               peak_reserved_gib=max(s[2] for s in steps))
    return row


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["run"] == "torch-adamw" and "failed" not in r), None)
    lines = ["| run | steps | final loss | tokens/s | vs torch AdamW | peak reserved GiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['run']} | failed: {r['failed']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""
        lines.append(f"| {r['run']} | {r['step']} | {r['loss']:.4f} | {r['tokens_per_s']:,.0f} | {ratio} | "
                     f"{r['peak_reserved_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", help="folder of <run>.log files")
    ap.add_argument("--md", help="write the table here (else print it)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    logs = sorted(Path(args.logs).glob("*.log"), key=lambda p: (p.stem != "torch-adamw", p.stem))
    if not logs:
        raise SystemExit(f"no .log files in {args.logs}")
    rows = [read_log(p) for p in logs]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(table(rows))
    else:
        print(table(rows), end="")


if __name__ == "__main__":
    main()
