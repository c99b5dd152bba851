"""Markdown tables of the memory planner's plans and of benchmark rows."""

from __future__ import annotations

from typing import Iterable, Sequence

from slimopt.bench.units import fmt_gib

__all__ = ["markdown", "memory_table", "bench_table", "refresh_table"]


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]], align: Sequence[str] | None = None) -> str:
    """A GitHub markdown table; align: one of "l" / "r" per column (default: first left, others right)."""
    header = [str(h) for h in header]
    align = align or ["l"] + ["r"] * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_table(plans: Sequence, budget: int | None = None, max_batches: dict[str, int] | None = None) -> str:
    """One row per plan, sizes in GiB: state bytes per parameter, each part of the peak, the peak, and (with a
    budget) whether it fits and the largest batch that does."""
    header = ["method", "state B/param", "weights", "grads", "opt. state", "projections", "activations", "peak"]
    if budget:
        header.append(f"fits {fmt_gib(budget, 1)} GiB")
    if max_batches is not None:
        header.append("max batch")
    rows = []
    for p in plans:
        row = [p.method, f"{p.state_bytes_per_param:.3f}", fmt_gib(p.weights), fmt_gib(p.grads), fmt_gib(p.state),
               fmt_gib(p.projections), fmt_gib(p.activations) if p.batch and p.seq else "-", fmt_gib(p.peak)]
        if budget:
            row.append("yes" if p.peak <= budget else f"no (+{fmt_gib(p.peak - budget)})")
        if max_batches is not None:
            row.append(str(max_batches.get(p.method, "-")))
        rows.append(row)
    return markdown(header, rows)


def _ratio(value, base) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def bench_table(rows: Sequence[dict], baseline: str = "torch-adamw-fused") -> str:
    """One row per method: step time, state bytes (total, per parameter, on the projectable weights), peak
    memory, and ratios to torch AdamW measured in the same run (on a CPU also paired: the median ratio of the
    method's steps to fused AdamW steps timed in alternation with them); rows that did not run say why."""
    base = next((r for r in rows if r["method"] == baseline and r.get("status") == "ok"), None)
    if base is None:
        base = next((r for r in rows if r["method"] == "torch-adamw" and r.get("status") == "ok"), None)
    paired = any(r.get("paired_ratio") is not None for r in rows)  # CPU runs (harness._paired)
    header = ["method", "kind", "settings", "step ms (median)", "x AdamW time"] + (["x AdamW paired"] if paired else [])
    header += ["state MiB", "state B/param", "x AdamW state", "B/param projectable", "planner = measured", "peak MiB",
               "refresh ms"]
    out = []
    for r in rows:
        settings = ", ".join(f"{k}={v}" for k, v in (r.get("settings") or {}).items()) or "-"
        if r.get("status") != "ok":
            out.append([r["method"], r.get("kind", ""), settings, r["status"]] + ["-"] * (len(header) - 4))
            continue
        planned = r.get("planned_state_bytes")
        match = "-" if planned is None else ("yes" if planned == r["state_bytes"] else
                                             f"no ({planned} vs {r['state_bytes']})")
        refresh = r.get("refresh_ms")
        pair = [f"{r['paired_ratio']:.2f}x" if r.get("paired_ratio") is not None else "-"] if paired else []
        out.append([
            r["method"], r.get("kind", ""), settings, f"{r['step_ms']:.2f}",
            _ratio(r["step_ms"], base and base["step_ms"]), *pair,
            f"{r['state_bytes'] / 2**20:.2f}", f"{r['state_bytes_per_param']:.3f}",
            _ratio(r["state_bytes"], base and base["state_bytes"]),
            f"{r['state_bytes_per_param_projectable']:.3f}", match,
            f"{r['peak_bytes'] / 2**20:.1f}" if r.get("peak_bytes") is not None else "-",
            f"{refresh:.1f}" if refresh is not None else "-",
        ])
    return markdown(header, out, ["l", "l", "l"] + ["r"] * (len(header) - 3))


def refresh_table(rows: Sequence[dict]) -> str:
    """One subspace refresh of one matrix per row: time and the share of the best rank-r energy captured."""
    header = ["refresh", "shape", "rank", "ms (median)", "captured energy / optimal"]
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append([r["name"], r.get("shape", "-"), r.get("rank", "-"), r["status"], "-"])
            continue
        out.append([r["name"], "x".join(map(str, r["shape"])), r["rank"], f"{r['ms']:.1f}",
                    f"{r['energy_ratio']:.4f}"])
    return markdown(header, out, ["l", "l", "r", "r", "r"])
