"""What one rank holds of the optimizer state under FSDP2, planned for any model and world size.

Under FSDP2 slimopt splits every state tensor over the ranks by its dim 0, as torch.chunk splits it
(docs/distributed.md, section 3): moments by the parameter's rows, a left projection's by the rows of its (r x n)
subspace, bases by their rows (a left basis: the parameter's m, a right one: its n), a factored moment's column
means and TACO's per-column record by columns. What stays whole on every rank: the 0-D step counters, the
coordinates of a ``rows`` or ``columns`` projector, and the (r x n) state of a rule that needs the whole matrix
(Muon's momentum, TACO's record) under a left projection. The first rank holds the largest chunk of every tensor,
so it is the busiest.

    busiest, one = rank_state(model, "galore8bit", world=8)

``slimopt.state_nbytes(opt)`` measures the same on a running rank; benchmarks/fsdp_state.py and
tests/test_fsdp_state.py compare the two.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["rank_state", "rank_table", "DOC_METHODS"]

# The methods of the per-rank table in docs/distributed.md
DOC_METHODS = ("adamw", "adamw8bit", "frugal", "galore", "galore8bit", "muon8bit", "taco", "ternary_adamw")


def _share(d: int, world: int) -> float:
    """The first rank's part of a tensor of d rows split as torch.chunk splits them over `world` ranks."""
    return min(d, -(-d // world)) / d if d else 1.0


def rank_state(model: nn.Module, method: str, world: int, step: int | None = None,
               **hparams: Any) -> tuple[int, int]:
    """(bytes of `method`'s optimizer state on the busiest of `world` FSDP2 ranks, bytes in one process) for
    `model` (a meta model is enough), from the planner's per-parameter state (``planner.state_plan``; step: the
    state after that step, None: the block schedule's maximum for a block method) and the split above."""
    from slimopt.bench.fsdp_comm import split_space
    from slimopt.bench.planner import _COUNTER, state_plan
    from slimopt.factory import make_optimizer
    from slimopt.optim.algorithm import projectors as P
    from slimopt.optim.algorithm import taco

    if world < 1:
        raise ValueError(f"world must be >= 1; got {world}")
    opt = make_optimizer(model, method, **hparams)
    where = {id(p): (p, group) for group in opt.param_groups for p in group["params"]}
    params = {name: where[id(p)] for name, p in model.named_parameters() if id(p) in where}
    busiest = one = 0.0
    for ps in state_plan(model, method, step=step, **hparams):
        p, group = params[ps.name]
        one += ps.total
        layout = opt._layout(p, group)
        moments, proj = ps.moments - _COUNTER, ps.projections
        # the tensor the rule runs on, split by its rows (None: whole on every rank, as Muon's left momentum);
        # TACO's record by its columns
        space, _, side, _ = split_space(opt, p, group, world)
        if space is None:
            space = (p.shape[0] if p.dim() else 1,) if layout in ("none", "block") else None
        kept = moments if space is None else moments * _share(space[1] if taco.owns(group, space) else space[0],
                                                              world)
        if layout in ("none", "block"):
            busiest += _COUNTER + kept + proj
            continue
        if layout in P.ORTHO_PROJECTORS:
            proj *= _share(p.shape[0] if side == "left" else p.shape[1], world)  # a basis: by its rows
        busiest += _COUNTER + kept + proj  # a rows / columns projector's coordinates: on every rank
    return round(busiest), round(one)


def rank_table(sizes: tuple[str, ...] = ("1b", "7b"), worlds: tuple[int, ...] = (8, 64),
               methods: tuple[str, ...] = DOC_METHODS, dtype: str = "bf16") -> list[dict[str, Any]]:
    """Per LLaMA size and method: one process's state and the busiest rank's at each world size (GB), from meta
    models with `dtype` weights and the training command's defaults."""
    from slimopt.bench.planner import load_config, meta_model

    out = []
    for size in sizes:
        _, config = load_config(size)
        model = meta_model(config, dtype)
        for method in methods:
            row: dict[str, Any] = {"model": f"llama-{size}", "method": method}
            for world in worlds:
                busiest, one = rank_state(model, method, world)
                row["one_process_GB"] = one / 1e9
                row[f"W={world} GB"] = busiest / 1e9
                row[f"W={world} ratio"] = busiest / (one / world) if one else 1.0
            out.append(row)
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rank_table``'s rows as the table of docs/distributed.md."""
    worlds = [k.split()[0] for k in rows[0] if k.endswith(" GB") and k.startswith("W=")]
    head = "| model | method | one process (GB) | " + " | ".join(f"{w}: a rank (GB), x one / W" for w in worlds) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(worlds)]
    for r in rows:
        cells = [f"{r[f'{w} GB']:.3f}, {r[f'{w} ratio']:.2f}" for w in worlds]
        lines.append(f"| {r['model']} | {r['method']} | {r['one_process_GB']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
