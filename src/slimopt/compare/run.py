"""`slimopt compare`: train several methods on the same data, seed and token budget, and report what each costs.

The experiment of the GaLore (arXiv 2403.03507, Table 2) and FRUGAL (arXiv 2411.07837, Table 2) papers, at any
scale: every method pretrains the same model from the same initialisation on the same batches for the same number
of tokens, then the held-out perplexity, optimizer-state size, peak memory and speed go side by side into
`results.md` / `results.csv`, with loss curves and a memory chart as PNG; a control row, tuned rates and seeds keep
the comparison honest (docs/design.md, section 7).

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from slimopt.compare.analysis import aggregate_seeds
from slimopt.compare.checks import _dry_build, _validate
from slimopt.compare.config import (
    CompareConfig,
    _base_lr,
    _entries,
    _full_steps,
    _grid_for,
    _method_config,
    _run_dir,
    _seed_list,
    _tune_steps,
    split_method,
)
from slimopt.compare.notes import _annotate, _conclusions, _full_rank_note
from slimopt.compare.plan import plan_methods
from slimopt.compare.protocol import CONTROL
from slimopt.compare.report import write_results
from slimopt.compare.runner import _run_one, _summary_line, jobs_for
from slimopt.compare.sweep import _chosen_lr, _extend_sweeps, _extension_text, _sweep, _sweep_submit

__all__ = ["run_compare"]


def run_compare(cfg: CompareConfig, log=print) -> list[dict]:
    """Train every method (the control first), write the results into `cfg.out`, return one row per method
    (see CSV_COLUMNS; with several seeds the numbers are means and row["runs"] holds the per-seed rows)."""
    methods = _entries(cfg)
    _validate(cfg, methods)  # all checks before the first write or the first step
    planned = _planned(cfg, methods)
    from slimopt.train.loop import _prepare_data
    t0 = time.perf_counter()
    steps = _full_steps(cfg)
    _, packed = _prepare_data(cfg.base, steps)  # once, so every run hits the cache
    full_rank = {m: _dry_build(_method_config(cfg, m), packed.vocab_size) for m in methods}
    b = cfg.base
    seeds = _seed_list(cfg)
    jobs = jobs_for(cfg)
    log(f"slimopt compare: {len(methods)} methods x {steps} steps of {b.batch_size}x{b.seq_len} "
        f"tokens ({steps * b.batch_size * b.seq_len:,} tokens), model {b.model}, "
        f"data {b.data} ({packed.train.shape[0]:,} train blocks), "
        + (f"seed {b.seed}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}")
        + (f"; control: {CONTROL}" if CONTROL in methods else "; no control row")
        + (f"; {jobs} runs at a time" if jobs > 1 else ""))
    for m in methods:
        if full_rank[m]:
            log(f"warning: {_full_rank_note(full_rank[m], m)}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sweeps: dict[str, dict] = {}
    tuned = [m for m in methods if _grid_for(cfg, m)]
    if tuned:
        parts = []
        if CONTROL in tuned:
            parts.append(f"the control at x{', x'.join(f'{g:g}' for g in _grid_for(cfg, CONTROL))} of "
                         f"{_base_lr(cfg, CONTROL)[0]:g}")
        others = [m for m in tuned if m != CONTROL]
        if others:
            parts.append(f"{len(others)} method{'s' if len(others) > 1 else ''} at "
                         f"x{', x'.join(f'{g:g}' for g in cfg.lr_grid)} of each one's default")
        log(f"tuning learning rates on runs of {_tune_steps(cfg)} of {steps} steps, seed {b.seed}: "
            + "; ".join(parts))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            pending = {m: _sweep_submit(cfg, m, pool) for m in tuned}
            for m in tuned:
                _sweep(cfg, m, pending[m], sweeps, log)
            _extend_sweeps(cfg, tuned, sweeps, pool, log)
        for m in tuned:
            best, entry = sweeps[m]["chosen"], sweeps[m]
            log(f"  {m}: lr {best['lr']:.3g} (x{best['multiplier']:g}{_extension_text(entry)})" if best else
                f"  {m}: no grid point finished; the full runs use lr {entry['base_lr']:.3g}")
    rows: list[dict] = []
    pool = ThreadPoolExecutor(max_workers=jobs)  # each run is a process of its own: the threads only wait
    try:
        _full_runs(cfg, methods, seeds, sweeps, full_rank, planned, pool, jobs, rows, out, t0, log)
    finally:
        pool.shutdown(cancel_futures=True)
    _annotate(rows, cfg)
    write_results(rows, cfg, out, elapsed=time.perf_counter() - t0, sweeps=sweeps)
    for line in _conclusions(rows, cfg):
        log(line)
    log(f"results: {out / 'results.md'} ({time.perf_counter() - t0:.0f} s in all)")
    return rows


def _planned(cfg: CompareConfig, methods: list[str]) -> dict[str, dict | None]:
    """Each entry's planned memory at cfg.plan's size (plan.py), with the settings its runs use."""
    if cfg.plan is None:
        return {m: None for m in methods}
    entries = {}
    for m in methods:
        name, variant = split_method(m)
        entries[m] = (name, {**variant, **cfg.method_opts.get(m, {})})
    return plan_methods(cfg.plan, entries)


def _plan_columns(plan: dict | None) -> dict:
    if plan is None:
        return {"plan_model": None, "plan_state_gib": None, "plan_peak_gib": None, "plan_fits": None}
    return {"plan_model": plan["model"], "plan_state_gib": plan["state_gib"], "plan_peak_gib": plan["peak_gib"],
            "plan_fits": plan["fits"], "plan_command": plan["command"]}


def _full_runs(cfg: CompareConfig, methods: list[str], seeds: list[int], sweeps: dict, full_rank: dict,
               planned: dict, pool: ThreadPoolExecutor, jobs: int, rows: list[dict], out: Path, t0: float,
               log) -> None:
    """Start every method's full runs (all seeds; `jobs` at a time), then gather them in table order into `rows`,
    writing the results after each method so that partial results survive."""
    pending = {}
    for m in methods:
        lr = _chosen_lr(cfg, m, sweeps)[0]
        pending[m] = [pool.submit(_run_one, cfg, replace(_method_config(cfg, m, lr=lr, seed=seed,
                                                                         out=_run_dir(cfg, m, seed)),
                                                         progress=cfg.progress and jobs == 1), m)
                      for seed in seeds]
    for i, m in enumerate(methods, 1):
        lr, source, mult = _chosen_lr(cfg, m, sweeps)
        runs = []
        for seed, future in zip(seeds, pending[m]):
            run = future.result()
            run["role"] = "control" if m == CONTROL else "method"
            runs.append(run)
            tag = f"[{i}/{len(methods)}]" + (f" seed {seed}" if len(seeds) > 1 else "")
            log(f"{tag} {_summary_line(run)}")
        row = aggregate_seeds(runs)
        row.update(role="control" if m == CONTROL else "method", lr=lr, lr_source=source, lr_multiplier=mult,
                   full_rank=full_rank[m], lr_edge=bool(sweeps.get(m, {}).get("edge")),
                   lr_extended=list(sweeps.get(m, {}).get("extended", [])), **_plan_columns(planned[m]))
        rows.append(row)
        _annotate(rows, cfg)
        write_results(rows, cfg, out, elapsed=time.perf_counter() - t0, sweeps=sweeps)  # partial results survive

