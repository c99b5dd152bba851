"""The benchmark harness behind `slimopt bench`: optimizer step time, state bytes and peak memory, side by side.

One model and one set of seeded gradients for every method, so the rows differ by the optimizer alone.

Details: docs/modules.md, ``slimopt.bench.harness``.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Callable

import torch

from slimopt.options import split_variant

__all__ = ["BenchConfig", "CHECK_METHODS", "NEEDS_CUDA", "split_variant", "run_bench", "bench_method", "check_planner", "environment", "goals",
           "planned_goal_bytes"]


def _default_methods() -> list[str]:
    import slimopt
    from slimopt.peers import PEERS

    return list(slimopt.methods()) + list(PEERS)



@dataclass
class BenchConfig:
    """Settings of one `slimopt bench` run (the command's options map one to one onto these)."""

    model: str = "small"
    methods: list[str] | None = None  # None: every slimopt method and every peer
    device: str = "cpu"
    dtype: str = "bf16"
    steps: int = 10
    warmup: int = 2
    seed: int = 0
    vocab_size: int | None = None
    method_opts: dict[str, dict[str, Any]] = field(default_factory=dict)
    refresh: bool = True
    refresh_shape: tuple[int, int] = (2048, 5461)
    refresh_rank: int = 512
    refresh_reps: int = 3
    max_minutes: float | None = None  # skip the methods left once this much time has passed


def environment(device: str) -> dict[str, Any]:
    """Device, date and the versions of everything measured."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "slimopt", "bitsandbytes", "torchao", "galore-torch", "apollo-torch"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, " \
               f"{torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() != 1 else ''})"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None  # other work on a shared machine slows timings
    return {"device": name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "versions": versions,
            "load_average": [round(x, 2) for x in load] if load else None}


# ----------------------------------------------------------------------------------------------------------------
# one method


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# peers whose step cannot run without a GPU, and why
NEEDS_CUDA = {"galore-torch-8bit": "needs CUDA: galore-torch's 8-bit step calls torch.cuda.synchronize()"}


def _kind(method: str) -> str:
    from slimopt.peers import PEERS

    return "peer" if split_variant(method)[0] in PEERS else "slimopt"


def _state_bytes(opt, params: list[torch.Tensor] | None = None) -> int:
    from slimopt.peers import optimizer_state_nbytes

    if params is None:
        return optimizer_state_nbytes(opt)
    return optimizer_state_nbytes(SimpleNamespace(state={p: opt.state[p] for p in params if p in opt.state}))


def _time_step(opt, dev: torch.device, set_grads: Callable[[], None]) -> float:
    """Milliseconds of one ``opt.step()``; gradients are re-attached first (some peers replace ``.grad``)."""
    set_grads()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize(dev)
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    opt.step()
    return (time.perf_counter() - t0) * 1e3


def _paired(opt, params: list[torch.Tensor], dev: torch.device, set_grads: Callable[[], None],
            cfg: BenchConfig) -> dict[str, float]:
    """The method's step against torch's fused AdamW on the same weights, step for step in alternation (after the
    measured steps, so the state and memory figures are the method's alone): the median of the per-pair ratios.
    A shared CPU's speed drifts by tens of percent within a minute (other tenants, clocks), which moves the ratio
    of steps timed a minute apart; two steps timed a few milliseconds apart see the same machine."""
    ref = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for _ in range(cfg.warmup):
        _time_step(ref, dev, set_grads)
    ratios, mine, theirs = [], [], []
    for _ in range(max(cfg.steps, 5)):
        a = _time_step(opt, dev, set_grads)
        b = _time_step(ref, dev, set_grads)
        mine.append(a)
        theirs.append(b)
        ratios.append(a / b)
    del ref
    return {"paired_ratio": statistics.median(ratios), "paired_ms": statistics.median(mine),
            "paired_ref_ms": statistics.median(theirs)}


def _has_refresh(method: str, opt) -> bool:
    """Whether the method chooses subspaces (so its first step includes a refresh of every projected weight)."""
    if method in ("galore-torch", "galore-torch-8bit", "apollo", "apollo-mini"):
        return True
    return any(g.get("projector") in ("svd", "randomized_svd", "random", "columns", "rows")
               for g in getattr(opt, "param_groups", []))


def bench_method(method: str, model: torch.nn.Module, grads: list[torch.Tensor], cfg: BenchConfig,
                 projectable: list[torch.Tensor]) -> dict[str, Any]:
    """One row: build `method`'s optimizer over `model`, time its steps on the fixed `grads`, count its state."""
    from slimopt.bench.planner import state_plan
    from slimopt.peers import PEERS, available_peers
    from slimopt.train.logger import MemoryProbe
    from slimopt.factory import make_optimizer

    dev = torch.device(cfg.device)
    row: dict[str, Any] = {"method": method, "kind": _kind(method)}
    base, variant = split_variant(method)
    if base in PEERS:
        why = available_peers().get(base)
        if why is not None:
            return {**row, "status": "not installed", "detail": why}
    if base in NEEDS_CUDA and dev.type != "cuda":
        return {**row, "status": NEEDS_CUDA[base]}
    params = [p for p in model.parameters() if p.requires_grad]
    opts = {**cfg.method_opts.get(method, {}), **variant}
    row["settings"] = dict(opts)  # what this row ran with, besides the method's defaults

    def set_grads() -> None:
        for p, g in zip(params, grads):
            p.grad = g

    _free(dev)
    probe = MemoryProbe(dev)
    opt = None
    try:
        opt = make_optimizer(model, base, **opts)
        probe.start()
        base_now = probe.now()
        times = [_time_step(opt, dev, set_grads) for _ in range(cfg.warmup + cfg.steps)]
        _sync(dev)
        peak = probe.peak_total() if dev.type == "cuda" else probe.peak_delta() + base_now
        state = _state_bytes(opt)
        n_params = sum(p.numel() for p in params)
        n_proj = sum(p.numel() for p in projectable)
        timed = times[cfg.warmup:]
        median = statistics.median(timed)
        row.update(
            status="ok", steps=cfg.steps, warmup=cfg.warmup, step_ms=median, step_ms_min=min(timed),
            step_ms_max=max(timed), first_step_ms=times[0],
            refresh_ms=max(0.0, times[0] - median) if _has_refresh(base, opt) else None,
            state_bytes=state, state_bytes_per_param=state / n_params,
            state_bytes_projectable=_state_bytes(opt, projectable),
            state_bytes_per_param_projectable=_state_bytes(opt, projectable) / max(1, n_proj),
            peak_bytes=peak, peak_kind=probe.kind, memory_before_bytes=base_now,
        )
        try:  # the planner's state for the same optimizer after the same number of steps
            planned = state_plan(model, base, step=cfg.warmup + cfg.steps, **opts)
            row["planned_state_bytes"] = sum(s.total for s in planned)
        except ValueError:  # no formula for this peer (apollo)
            row["planned_state_bytes"] = None
        if dev.type == "cpu":
            row.update(_paired(opt, params, dev, set_grads, cfg))
    except Exception as err:  # a row that says why, and the other methods still run
        row.update(status=f"failed: {type(err).__name__}: {err}"[:300])
    finally:
        for p in params:
            p.grad = None
        del opt
        _free(dev)
    return row


# ----------------------------------------------------------------------------------------------------------------
# the run


def _build(cfg: BenchConfig):
    from slimopt.bench.planner import DTYPES, load_config
    from slimopt.optim.algorithm.partition import classify
    from slimopt.models.llama import build_model

    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {cfg.dtype!r}")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {cfg.device!r}")
    load_config(cfg.model, cfg.vocab_size)  # a clear error for an unknown model before anything is allocated
    # no forward pass runs, so the sequence length (which only sizes rotary tables) is the smallest allowed
    model = build_model(cfg.model, cfg.vocab_size, 1, dtype=DTYPES[cfg.dtype], seed=cfg.seed, device=dev)
    kinds = classify(model)
    projectable = [p for _, (p, kind) in kinds.items() if kind == "projectable"]
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    grads = [torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32).to(p.dtype)
             for p in model.parameters() if p.requires_grad]
    return model, grads, projectable


def _check(cfg: BenchConfig) -> list[str]:
    import slimopt
    from slimopt.peers import PEERS

    for name in ("steps", "warmup"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "steps" else 0):
            raise ValueError(f"{name} must be an integer >= {1 if name == 'steps' else 0}, got {v!r}")
    known = list(slimopt.methods()) + list(PEERS)
    methods = _default_methods() if not cfg.methods else list(cfg.methods)
    unknown = [m for m in methods if split_variant(m)[0] not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(known)}")
    stray = sorted(set(cfg.method_opts) - set(methods))
    if stray:
        raise ValueError(f"settings given for method(s) {', '.join(stray)} that are not benchmarked")
    return methods


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Benchmark every method of `cfg` on one model; returns {environment, config, model, rows, refresh}."""
    from slimopt.bench.refresh import time_refresh

    methods = _check(cfg)
    t_start = time.perf_counter()
    model, grads, projectable = _build(cfg)
    info = {"params": sum(p.numel() for p in model.parameters()),
            "projectable_params": sum(p.numel() for p in projectable)}
    rows = []
    for method in methods:
        if cfg.max_minutes is not None and time.perf_counter() - t_start > 60 * cfg.max_minutes:
            rows.append({"method": method, "kind": _kind(method),
                         "status": f"skipped: the {cfg.max_minutes:g}-minute budget was spent"})
            continue
        row = bench_method(method, model, grads, cfg, projectable)
        rows.append(row)
        if progress:
            progress(_progress_line(row))
    refresh = []
    if cfg.refresh:
        refresh = time_refresh(tuple(cfg.refresh_shape), cfg.refresh_rank, cfg.device, cfg.refresh_reps, cfg.seed)
        if progress:
            for r in refresh:
                progress(f"refresh {r['name']}: " + (f"{r['ms']:.1f} ms" if r["status"] == "ok" else r["status"]))
    del model, grads
    _free(torch.device(cfg.device))
    return {"environment": environment(cfg.device), "config": _config_dict(cfg), "model": info, "rows": rows,
            "refresh": refresh, "seconds": time.perf_counter() - t_start}


def _config_dict(cfg: BenchConfig) -> dict[str, Any]:
    out = asdict(cfg)
    out["refresh_shape"] = list(cfg.refresh_shape)
    return out


def _progress_line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row['method']}: {row['status']}"
    return (f"{row['method']}: {row['step_ms']:.2f} ms/step, {row['state_bytes_per_param']:.3f} B/param state"
            + (f", refresh {row['refresh_ms']:.0f} ms" if row.get("refresh_ms") is not None else ""))


# ----------------------------------------------------------------------------------------------------------------
# the planner against a real training step


CHECK_METHODS = ("torch-adamw-fused", "bnb-adamw8bit", "adamw", "adamw8bit", "galore_rsvd", "frugal", "taco")


def check_planner(model: str, methods: list[str], batch: int, seq: int, device: str = "cuda", dtype: str = "bf16",
                  seed: int = 0, vocab_size: int | None = None) -> list[dict[str, Any]]:
    """For each method: two real training iterations (forward, backward, step) on random tokens; the second one's
    peak memory against the planner's peak for the same model, batch and state.

    CUDA: ``max_memory_allocated`` over the second iteration. CPU: every tensor storage counted
    (``iteration_peak.measure_peak``: exact, but slow: small models only). A method that cannot run here, or that
    the planner has no formula for, gets a status saying why.
    """
    from slimopt.bench.iteration_peak import measure_peak
    from slimopt.bench.planner import DTYPES, plan
    from slimopt.peers import available_peers
    from slimopt.factory import make_optimizer
    from slimopt.models.llama import build_model

    dev = torch.device(device)
    out = []
    for method in methods:
        base, opts = split_variant(method)
        row: dict[str, Any] = {"method": method, "model": model, "batch": batch, "seq": seq, "dtype": dtype}
        why = available_peers().get(base) if _kind(method) == "peer" else None
        if why is not None or (base in NEEDS_CUDA and dev.type != "cuda"):
            out.append({**row, "status": "not installed" if why else NEEDS_CUDA[base]})
            continue
        _free(dev)
        net = build_model(model, vocab_size, seq, dtype=DTYPES[dtype], seed=seed, device=dev)
        try:
            planned = plan(net, base, dtype=dtype, batch=batch, seq=seq, step=2, **opts)
        except ValueError as err:  # no state formula (apollo)
            out.append({**row, "status": f"no planner formula: {err}"[:200]})
            continue
        opt = make_optimizer(net, base, **opts)
        gen = torch.Generator(device=dev).manual_seed(seed)
        ids = torch.randint(0, net.config.vocab_size, (batch, seq), generator=gen, device=dev)

        batch_in = {"input_ids": ids, "labels": ids}
        measure_peak(net, opt, batch_in)  # creates the state
        measured = measure_peak(net, opt, batch_in)
        how = "cuda max_memory_allocated" if dev.type == "cuda" else "every tensor counted (CPU)"
        out.append({**row, "status": "ok", "measured_peak_bytes": int(measured), "planned_peak_bytes": planned.peak,
                    "ratio": planned.peak / measured, "measured_by": how, "planned_parts": planned.peak_parts})
        del opt, net, ids
    _free(dev)
    return out


# ----------------------------------------------------------------------------------------------------------------
# the goals


def goals(rows: list[dict], device: str, planned_1b: dict[str, dict] | None = None) -> list[dict[str, str]]:
    """The benchmark's goals (LLaMA-1B, bf16, on the GPU machine) with what this run measured.

    Speed goals need the GPU: on a CPU run they read "GPU run pending" (the CPU numbers are listed for reference).
    Byte goals are exact from the planner for LLaMA-1B (``planned_1b``: method -> {state B/param, projectable
    B/param}) and measured on this run's model.
    """
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    gpu = torch.device(device).type == "cuda"
    p1b = planned_1b or {}

    def ms(name):
        r = by.get(name)
        return r["step_ms"] if r else None

    def bpp(name, key="state_bytes_per_param"):
        r = by.get(name)
        return r[key] if r else None

    def fmt(v, unit=""):
        return "not run" if v is None else f"{v:.3f}{unit}" if unit == " B/param" else f"{v:.1f}{unit}"

    out = []

    def add(goal, measured, verdict):
        out.append({"goal": goal, "measured": measured, "verdict": verdict})

    def speed(cond_ok: bool | None, text: str) -> str:
        if not gpu:
            return "GPU run pending"
        if cond_ok is None:
            return "not measured"
        return "met" if cond_ok else f"missed: {text}"

    # 1. AdamW8bit: <= 2.04 B/param and faster than bitsandbytes
    b = p1b.get("adamw8bit", {}).get("state", bpp("adamw8bit"))
    a8, bnb = ms("adamw8bit"), ms("bnb-adamw8bit")
    add("slimopt AdamW8bit <= 2.04 B/param state", f"{fmt(b, ' B/param')} (1B, planner)" if "adamw8bit" in p1b
        else fmt(b, " B/param"), "met" if b is not None and b <= 2.04 else "missed")
    add("slimopt AdamW8bit step faster than bitsandbytes (52.6 ms on the H200)",
        f"{fmt(a8, ' ms')} vs bitsandbytes {fmt(bnb, ' ms')} on this device",
        speed(None if a8 is None or bnb is None else a8 < bnb,
              f"{a8 / bnb:.2f}x bitsandbytes" if a8 and bnb else ""))
    # 2. GaLore rank 512: <= 1.56 B/param; refresh < 1 s
    g = p1b.get("galore", {}).get("state", bpp("galore"))
    add("slimopt GaLore rank 512 <= 1.56 B/param", f"{fmt(g, ' B/param')}" + (" (1B, planner)" if p1b else ""),
        "met" if g is not None and g <= 1.56 else "missed")
    rr = by.get("galore_rsvd", {}).get("refresh_ms")
    rs = by.get("galore", {}).get("refresh_ms")
    gt = by.get("galore-torch", {}).get("refresh_ms")
    add("slimopt GaLore subspace refresh < 1 s (galore-torch: 39.6 s)",
        f"randomized {fmt(rr, ' ms')}, full SVD {fmt(rs, ' ms')}, galore-torch {fmt(gt, ' ms')} on this device",
        speed(None if rr is None else rr < 1000, f"{rr / 1000:.2f} s" if rr else ""))
    # 3. FRUGAL density 0.25 within 1.2x fused AdamW
    f, fa = ms("frugal"), ms("torch-adamw-fused")
    add("slimopt FRUGAL density 0.25 step <= 1.2x fused torch AdamW (10.0 ms)",
        f"{fmt(f, ' ms')} vs {fmt(fa, ' ms')} ({f / fa:.2f}x)" if f and fa else "not run",
        speed(None if f is None or fa is None else f <= 1.2 * fa, f"{f / fa:.2f}x" if f and fa else ""))
    # 4. TACO and FRUGAL density 0: <= 0.1 B/param on the projectable weights
    for name in ("taco", "frugal_rho0"):
        v = p1b.get(name, {}).get("projectable", bpp(name, "state_bytes_per_param_projectable"))
        add(f"{name} <= 0.1 B/param on the projectable weights",
            f"{fmt(v, ' B/param')}" + (" (1B, planner)" if name in p1b else ""),
            "met" if v is not None and v <= 0.1 else "missed")
    return out


# The step-time goals of a CPU run (`slimopt bench --model small --threads 1`): at most this many times fused torch
# AdamW's step on the same model (GaLore between refreshes).
CPU_STEP_GOALS = {"adamw": 1.5, "adamw8bit": 2.5, "adamw4bit": 3.0, "frugal": 1.5, "galore": 2.0, "taco": 1.5,
                  "ternary_adamw": 3.0}


def cpu_goals(rows: list[dict]) -> list[dict[str, str]]:
    """``CPU_STEP_GOALS`` against a CPU run's paired ratios (``_paired``), for the goal methods that ran."""
    out = []
    for r in rows:
        limit = CPU_STEP_GOALS.get(r["method"])
        if limit is None or r.get("status") != "ok" or r.get("paired_ratio") is None:
            continue
        ratio = r["paired_ratio"]
        out.append({"goal": f"{r['method']} <= {limit:g}x fused torch AdamW",
                    "measured": f"{ratio:.2f}x paired ({r['paired_ms']:.2f} vs {r['paired_ref_ms']:.2f} ms)",
                    "verdict": "met" if ratio <= limit else f"missed by {ratio / limit:.2f}x"})
    return out


def planned_goal_bytes(model: str = "1b", dtype: str = "bf16") -> dict[str, dict[str, float]]:
    """Exact state bytes per parameter (all, and on the projectable weights) of the goal methods on `model`."""
    from slimopt.bench.planner import load_config, meta_model, state_plan
    from slimopt.optim.algorithm.partition import classify

    label, config = load_config(model)
    out = {}
    for method in ("adamw8bit", "galore", "taco", "frugal_rho0"):
        net = meta_model(config, dtype)
        kinds = classify(net)
        proj_names = {n for n, (_, k) in kinds.items() if k == "projectable"}
        states = state_plan(net, method)
        n_all = sum(p.numel() for p in net.parameters())
        n_proj = sum(p.numel() for n, (p, k) in kinds.items() if k == "projectable")
        out[method] = {"state": sum(s.total for s in states) / n_all,
                       "projectable": sum(s.total for s in states if s.name in proj_names) / max(1, n_proj)}
    return out
