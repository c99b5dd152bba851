"""What `slimopt compare` checks before its first run: every option, and every method built on the meta device.

A bad hyperparameter of the fifth method fails before the first one trains, and before anything is written; the
meta build also finds the "low-rank" projections that keep every direction of a weight (analysis.py).

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from slimopt.catalog import method_kind
from slimopt.compare.analysis import baseline_full_rank_weights, full_rank_weights
from slimopt.compare.config import CompareConfig, _grid_for, _method_config, split_method
from slimopt.compare.protocol import CONTROL
from slimopt.train.loop import TrainConfig
from slimopt.train.results import check_out_dir

__all__ = []


def _validate(cfg: CompareConfig, methods: list[str]) -> None:
    from slimopt.peers import available_peers
    from slimopt.train.loop import _check_config
    if not methods:
        raise ValueError("no methods to compare")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise ValueError(f"methods listed twice: {', '.join(dup)}")
    if cfg.jobs is not None and (not isinstance(cfg.jobs, int) or isinstance(cfg.jobs, bool) or cfg.jobs < 1):
        raise ValueError(f"--jobs must be an integer >= 1 (runs at a time), got {cfg.jobs!r}")
    if not isinstance(cfg.seeds, int) or isinstance(cfg.seeds, bool) or cfg.seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1 (the number of seeds each method runs with), "
                         f"got {cfg.seeds!r}")
    for option, grid, used in (("--lr-grid", cfg.lr_grid, cfg.tune_lr),
                               ("--control-lr-grid", cfg.control_lr_grid, _grid_for(cfg, CONTROL) is not None
                                and CONTROL in methods)):
        if not used:
            continue
        grid = list(grid or ())
        if not grid:
            raise ValueError(f"{option} is empty: give multipliers of the default lr, e.g. "
                             + ("1/4,1/2,1,2,4" if option == "--lr-grid" else "1,3,10,30"))
        bad = [g for g in grid if not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0)]
        if bad:
            raise ValueError(f"{option} multipliers must be positive numbers, got {bad}")
        if len(set(grid)) != len(grid):
            raise ValueError(f"{option} lists a multiplier twice: {grid}")
    if not isinstance(cfg.lr_extensions, int) or isinstance(cfg.lr_extensions, bool) or cfg.lr_extensions < 0:
        raise ValueError(f"--lr-extensions must be an integer >= 0 (how many times a sweep whose best lr is on the "
                         f"grid's edge extends it), got {cfg.lr_extensions!r}")
    if any(_grid_for(cfg, m) for m in methods):
        if not (isinstance(cfg.tune_fraction, (int, float)) and 0 < cfg.tune_fraction <= 1):
            raise ValueError(f"--tune-fraction must be in (0, 1] (the tuning runs' share of the steps), "
                             f"got {cfg.tune_fraction!r}")
    peers = available_peers()
    for m in methods:
        name = split_method(m)[0]
        if method_kind(name) == "peer" and peers[name] is not None:
            raise ImportError(f"peer {name!r} cannot run here: {peers[name]}")
    unknown = sorted(set(cfg.method_opts) - set(methods))
    if unknown:
        raise ValueError(f"per-method options given for methods not compared: {', '.join(unknown)}")
    for m in methods:
        _check_config(replace(_method_config(cfg, m), out=None), world_size=1)
    check_out_dir(cfg.out)


def _dry_build(tc: TrainConfig, vocab_size: int) -> list[tuple[str, tuple[int, int], int]]:
    """Build the model on the meta device (no memory, no init cost) and the method's optimizer over it, so a bad
    hyperparameter of the 5th method fails before the 1st one trains. Returns the projectable weights on which
    the method keeps a full-rank subspace (analysis.full_rank_weights)."""
    import warnings

    from slimopt.factory import make_optimizer
    from slimopt.models import llama as models
    if tc.model.lower() not in models.LLAMA_SIZES:
        return []  # a checkpoint would have to be read; its method settings are checked when its run starts
    kind = method_kind(tc.method)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # libraries' deprecation notices say nothing about this run
            model = models.build_model(tc.model, vocab_size, tc.seq_len, seed=tc.seed, device="meta")
            if kind == "baseline":
                from slimopt import baselines
                original = model
                model, _ = baselines.prepare(models.build_model(tc.model, vocab_size, tc.seq_len, seed=tc.seed,
                                                                device="meta"), tc.method, seed=tc.seed, **tc.opt)
                optimizer = make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay)
            else:
                optimizer = make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay, **tc.opt)
    except ValueError as e:
        raise ValueError(f"method {tc.method!r}: {e}") from e
    except Exception:  # noqa: BLE001 - something meta tensors cannot do; the real run will tell
        return []
    try:
        if kind == "baseline":
            if tc.method == CONTROL:
                return []
            hidden = getattr(original.config, "hidden_size", None)
            rank = tc.opt.get("rank") or (max(1, hidden // 4) if hidden else None)
            return baseline_full_rank_weights(original, int(rank)) if rank else []
        return full_rank_weights(model, optimizer)
    except Exception:  # noqa: BLE001 - an optimizer whose groups say nothing about ranks
        return []

