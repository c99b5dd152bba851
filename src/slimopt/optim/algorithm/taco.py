"""TACO: a ternary, column-wise one-sparse update with a compact per-column history.

TACO (Jiang, McGee, Bergou, Cai, Dutta; arXiv 2610.02199) is steepest descent under a dimension-normalized
1->1 operator norm, for full-parameter fine-tuning with almost no optimizer state. This module holds all of it:
the direction, the dimension normalization, the per-column state and its update. ``SlimOptimizer`` dispatches to
``update`` for 2-D tensors of a group with ``rule="taco"``; other tensors of such a group take AdamW's rule and
moments, stored through the group's codecs (``rules.py``).

The direction. The 1->1 operator norm of a matrix is its largest column l1 norm, so its unit ball is the
product of one l1 ball per column and the linear maximiser of <G, D> splits into columns: for a gradient G (m x n)
the steepest direction D puts sign(G_ij) at i = argmax_k |G_kj| and zero elsewhere (ternary, exactly one nonzero
per column), and <G, D> = sum_j max_i |G_ij| (the dual norm). ``ternary_direction`` computes it; a zero column
gives a zero column (sign(0) = 0).

Details: docs/modules.md, ``slimopt.optim.algorithm.taco``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, MutableMapping

import torch
from torch import Tensor

from slimopt.optim.algorithm.budget import ROUNDING_SCRATCH, window_elems
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.algorithm.rules import decay, rounded, rounding_of, value_of, write

# a kernel's one-candidate column search: (g (m, n), rows hidden (n,) or None) -> (rows (1, n), |g| (1, n)) or None
Search = Callable[[Tensor, "Tensor | None"], "tuple[Tensor, Tensor] | None"]

__all__ = [
    "FORMATS",
    "SCALE_DTYPES",
    "NORMS",
    "KEYS",
    "DEFAULTS",
    "ternary_direction",
    "dual_norm",
    "row_dtype",
    "dimension_factor",
    "state_nbytes",
    "owns",
    "reset",
    "init_state",
    "decode",
    "update",
    "validate",
]

FORMATS = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}  # storage dtype, largest code
SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NORMS = ("m/n", "none")
KEYS = ("taco_rows", "taco_values", "taco_absmax")

DEFAULTS: dict[str, Any] = dict(
    taco_k=1,  # measured: docs/taco.md (MiniLM-L6 fine-tuning: k = 1 and 4 equal at decay 0.5; 0.078 bit/param)
    taco_decay=0.5,  # measured there too: 0.9 lost 1.7 points of accuracy in 60 steps, 0.3 - 0.5 the best
    taco_format="fp8",
    taco_scale_dtype="bf16",
    taco_norm="m/n",
    taco_alpha=30.0,  # measured: docs/taco.md (MiniLM-L6 fine-tuning, with the AdamW fallback at the same lr)
)


# ----------------------------------------------------------------------------------------------------------------
# the direction and its scale


def ternary_direction(g: Tensor) -> Tensor:
    """The steepest direction of g (m, n) over the 1->1 unit ball: (m, n), in each column j the value sign(g_ij)
    at i = argmax_k |g_kj| (the smallest such i on a tie) and zero elsewhere."""
    if g.dim() != 2:
        raise ValueError(f"ternary_direction needs a 2-D tensor, got shape {tuple(g.shape)}")
    rows = g.abs().argmax(dim=0, keepdim=True)  # (1, n); argmax returns the first maximum
    d = torch.zeros_like(g)
    return d.scatter_(0, rows, g.gather(0, rows).sign())


def dual_norm(g: Tensor) -> Tensor:
    """sum_j max_i |g_ij| for g (m, n): the dual of the 1->1 norm, the value <g, ternary_direction(g)>."""
    return g.abs().amax(dim=0).sum()


def row_dtype(m: int) -> torch.dtype:
    """The narrowest integer dtype that holds every row index of an m-row matrix."""
    if m <= 256:
        return torch.uint8
    if m <= 2 ** 15:
        return torch.int16
    if m <= 2 ** 31:
        return torch.int32
    return torch.int64


def dimension_factor(shape: torch.Size | tuple[int, ...], norm: str) -> float:
    """The dimension normalization of a step on a (m, n) weight: m / n for ``"m/n"``, 1 for ``"none"``."""
    if norm == "m/n":
        m, n = shape
        return m / n
    if norm == "none":
        return 1.0
    raise ValueError(f"taco_norm must be one of {', '.join(NORMS)}; got {norm!r}")


def state_nbytes(shape: torch.Size | tuple[int, ...], k: int, fmt: str = "fp8", scale_dtype: str = "bf16",
                 step: bool = True) -> int:
    """Exact bytes of TACO's state for a (m, n) weight: n * (k * (b_row + 1) + b_scale), plus the 4-byte
    ``step`` counter when ``step``. k = 0 keeps only the counter."""
    m, n = shape
    per_column = 0
    if k > 0:
        b_row = torch.empty((), dtype=row_dtype(m)).element_size()
        b_value = torch.empty((), dtype=FORMATS[fmt][0]).element_size()
        b_scale = torch.empty((), dtype=SCALE_DTYPES[scale_dtype]).element_size()
        per_column = k * (b_row + b_value) + b_scale
    return n * per_column + (4 if step else 0)


# ----------------------------------------------------------------------------------------------------------------
# settings


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(group: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first invalid ``taco_*`` setting of a parameter group and what is allowed."""
    k = group["taco_k"]
    if not _is_int(k) or k < 0:
        raise ValueError(f"taco_k (the per-column history size) must be an integer >= 0, got {k!r}")
    decay = group["taco_decay"]
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"taco_decay must be a number in [0, 1), got {decay!r}")
    for name, allowed in (("taco_format", tuple(FORMATS)), ("taco_scale_dtype", tuple(SCALE_DTYPES)),
                          ("taco_norm", NORMS)):
        if group[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {group[name]!r}")
    alpha = group["taco_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 < float(alpha) < math.inf):
        raise ValueError(f"taco_alpha must be a finite number > 0, got {alpha!r}")


def owns(group: Mapping[str, Any], shape: torch.Size | tuple[int, ...]) -> bool:
    """True when TACO's own state (not the AdamW fallback) holds the tensor of `shape` in `group`."""
    return group["rule"] == "taco" and len(shape) == 2


def reset(state: MutableMapping[str, Tensor]) -> None:
    """Forget the history (it starts empty again at the next update)."""
    for key in KEYS:
        state.pop(key, None)


# ----------------------------------------------------------------------------------------------------------------
# the state


def init_state(shape: torch.Size | tuple[int, ...], k: int, fmt: str, scale_dtype: str, device) -> dict[str, Tensor]:
    """An empty history for a (m, n) weight: every slot's value is 0."""
    m, n = shape
    return {
        "taco_rows": torch.zeros((k, n), dtype=row_dtype(m), device=device),
        "taco_values": torch.zeros((k, n), dtype=FORMATS[fmt][0], device=device),
        "taco_absmax": torch.zeros((n,), dtype=SCALE_DTYPES[scale_dtype], device=device),
    }


def decode(state: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(rows, values): (k, n) int64 row indices and (k, n) fp32 values of the stored components."""
    codes = state["taco_values"]
    top = 448.0 if codes.dtype == torch.float8_e4m3fn else 127.0
    step = state["taco_absmax"].float() / top  # (n,)
    return state["taco_rows"].long(), codes.float() * step


def _encode(state: MutableMapping[str, Tensor], rows: Tensor, values: Tensor) -> None:
    """Store rows (k, n) and fp32 values (k, n) into the existing state tensors in place."""
    codes_t = state["taco_values"]
    top = 448.0 if codes_t.dtype == torch.float8_e4m3fn else 127.0
    absmax = values.abs().amax(dim=0).to(state["taco_absmax"].dtype)  # (n,), rounded as stored
    scale = absmax.float()
    normed = torch.where(scale > 0, values / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    normed = normed.clamp_(-1.0, 1.0).mul_(top)  # a bf16 scale may round below the absmax
    if codes_t.dtype == torch.int8:
        normed = normed.round_()
    state["taco_values"].copy_(normed.to(codes_t.dtype))
    state["taco_absmax"].copy_(absmax)
    state["taco_rows"].copy_(rows.to(state["taco_rows"].dtype))


def _candidates(a: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each column of a (m, n) (non-negative, -1 marks rows not to take), largest first,
    the smaller row first on ties. Returns rows (k, n) int64 and valid (k, n) bool (False once a column has
    fewer than k rows left). Overwrites a."""
    m, n = a.shape
    rows = torch.empty((k, n), dtype=torch.long, device=a.device)
    valid = torch.empty((k, n), dtype=torch.bool, device=a.device)
    for t in range(k):
        r = a.argmax(dim=0, keepdim=True)  # (1, n): first maximum, deterministic
        rows[t] = r[0]
        valid[t] = a.gather(0, r)[0] >= 0
        a.scatter_(0, r, -1.0)
    return rows, valid


def _keep_larger(rows: Tensor, values: Tensor, cand_rows: Tensor, cand_values: Tensor) -> tuple[Tensor, Tensor]:
    """Step 4 at k = 1: what the stable descending sort of [stored, candidate] by |value| keeps first, without
    the sort: the candidate where its |value| is larger, or NaN (the sort puts NaN first) while the stored one's
    is not; the stored one on ties."""
    stored, cand = values.abs(), cand_values.abs()
    take = (cand > stored) | (cand.isnan() & ~stored.isnan())
    return torch.where(take, cand_rows, rows), torch.where(take, cand_values, values)


def update(state: MutableMapping[str, Tensor], g: Tensor, group: Mapping[str, Any],
           shape: torch.Size | tuple[int, ...] | None = None, search: Search | None = None) -> tuple[Tensor, float]:
    """One TACO step for a 2-D gradient; returns (d, c): the update is lr * c * d.

    g: (m, n) fp32 gradient (or its projection); state: the tensor's optimizer state (history created on first
    use); shape: the parameter's (m, n) for the dimension normalization (default g's shape). d is (m, n), ternary,
    one nonzero per column (zero columns stay zero).
    """
    rows, signs, c = sparse_update(state, g, group, shape, search)
    return torch.zeros_like(g).scatter_(0, rows, signs), c


def sparse_update(state: MutableMapping[str, Tensor], g: Tensor, group: Mapping[str, Any],
                  shape: torch.Size | tuple[int, ...] | None = None,
                  search: Search | None = None) -> tuple[Tensor, Tensor, float]:
    """``update`` with the direction as its one entry a column: (rows, signs, c), rows (1, n) int64 and signs
    (1, n) fp32 in {-1, 0, +1}; d = zeros (m, n) with d[rows[0, j], j] = signs[0, j]. Applying it costs O(n)
    instead of a pass over the weight (``apply_sparse``).

    g may be narrower than fp32 (a bf16 gradient): it is read in windows of rows, each taken to fp32 on its own,
    and the candidates of step 3 are the best of each window's best (``_window_candidates``), so what the step
    allocates stays under ``windowed.WINDOW_BYTES`` whatever the weight's size; the result is the whole-tensor
    search's. search: a kernel's one-candidate search (``taco_routes.search_for``: (rows, |g| there) of the
    largest |g| of each column, a row hidden per column, or None where it failed), used at one candidate."""
    if g.dim() != 2:
        raise ValueError(f"TACO's update needs a 2-D gradient, got shape {tuple(g.shape)}")
    c = float(group["taco_alpha"]) * dimension_factor(shape if shape is not None else g.shape, group["taco_norm"])
    k = group["taco_k"]
    m, n = g.shape
    if k == 0:
        best = search(g, None) if search is not None else None
        if best is not None:
            rows = best[0]
        else:
            no_rows = torch.zeros((0, n), dtype=torch.long, device=g.device)
            rows, _ = _window_candidates(g, no_rows, no_rows.bool(), 1)  # (1, n); the first maximum
        return rows, g.gather(0, rows).float().sign(), c
    if "taco_rows" not in state or state["taco_rows"].shape != (k, n):
        state.update(init_state(g.shape, k, group["taco_format"], group["taco_scale_dtype"], g.device))
    beta = float(group["taco_decay"])

    rows, values = decode(state)  # (k, n), (k, n)
    live = values != 0
    # 2. stored components follow the EMA of their own entry; empty slots stay empty
    values = torch.where(live, values.mul_(beta).add_(g.gather(0, rows).float(), alpha=1.0 - beta), 0.0)
    # 3. candidates among the rows not stored
    kc = min(k, m)
    best = search(g, torch.where(live[0], rows[0], -1)) if k == 1 and search is not None else None
    if best is not None:  # the one stored row of each column hidden, in one pass
        cand_rows, cand_abs = best
        valid = cand_abs >= 0
    else:
        cand_rows, valid = _window_candidates(g, rows, live, kc)
    cand_values = g.gather(0, cand_rows).float().mul_(1.0 - beta).masked_fill_(~valid, 0.0)
    # 4. keep the k largest |value| of stored + candidates (stable: stored first, earlier slots first)
    if k == 1 and kc == 1:
        kept_rows, kept_values = _keep_larger(rows, values, cand_rows, cand_values)
    else:
        all_rows = torch.cat([rows, cand_rows])  # (k + kc, n)
        all_values = torch.cat([values, cand_values])
        order = all_values.abs().sort(dim=0, descending=True, stable=True).indices[:k]
        kept_rows, kept_values = all_rows.gather(0, order), all_values.gather(0, order)
    # 5. the direction: the sign of the largest kept component (slot 0 after the sort), at its row
    rows, signs = kept_rows[:1], kept_values[:1].sign()
    # 6. store
    _encode(state, kept_rows, kept_values)
    return rows, signs, c


# Bytes per element of a window of rows in the candidate search (the window's |g| in fp32), and per column and
# stored component (the candidates, their merge with the best so far and the k-slot selection of step 4). Measured
# with torch's MemTracker on CPU (tests/test_windowed.py): a 2048 x 2048 step allocates 4.02 bytes per element
# whole and 2 MiB plus 100 bytes a column (k = 1; 376 at k = 4) in 2 MiB windows.
_CANDIDATE_SCRATCH = 4
_COLUMN_SCRATCH = 96
# The decay pass of a bf16 weight written with Kahan compensation or stochastic rounding (``apply_sparse``): bytes
# per element of its window of rows (the fp32 value, the rounding's temporaries) and per column (the chosen
# entries' indices and values, alive across it); MemTracker on CPU, 1024- and 2048-wide weights (2026-12-02).
_DECAY_SCRATCH = {"kahan": 10, "stochastic": 19}
_DECAY_COLUMN_SCRATCH = 20


def _window_candidates(g: Tensor, rows: Tensor, live: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Step 3 over row windows: the kc rows of largest |g| in each column among the rows not stored (rows (k, n)
    where live), largest first, the smaller row first on ties; returns rows (kc, n) int64 and valid (kc, n) bool.

    Each window's own kc best (``_candidates`` on its |g|, stored rows hidden) are merged with the best so far by
    a stable sort on |g|: the order of the whole-tensor search (value descending, then row ascending), since
    earlier windows hold smaller rows. Every window but a lone whole one holds at least 2 kc + 1 rows, so at least
    kc + 1 rows of it are not stored (k <= kc of them can be) and its candidates are all valid, as the
    whole-tensor search's are for such a tensor."""
    m, n = g.shape
    size = max(2 * kc + 1, window_elems(m * n, n, _CANDIDATE_SCRATCH) // n)
    starts = list(range(0, m, size))
    if len(starts) > 1 and m - starts[-1] < 2 * kc + 1:
        starts.pop()  # the short last window joins the one before it
    bounds = list(zip(starts, starts[1:] + [m]))
    best_rows = best_abs = None
    for r0, r1 in bounds:
        cand, cand_abs = _window_best(g, r0, r1, rows, live, kc)
        if best_rows is None:
            best_rows, best_abs = cand, cand_abs
            continue
        both_rows, both_abs = torch.cat([best_rows, cand]), torch.cat([best_abs, cand_abs])
        order = both_abs.sort(dim=0, descending=True, stable=True).indices[:kc]
        best_rows, best_abs = both_rows.gather(0, order), both_abs.gather(0, order)
    return best_rows, best_abs >= 0


def _window_best(g: Tensor, r0: int, r1: int, rows: Tensor, live: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """The candidates of rows [r0, r1) of g: (rows (kc', n) int64, |g| there (kc', n) fp32, -1 where not valid).
    A function of its own so that the window's |g| is freed before the next window allocates its own."""
    a = g[r0:r1].float() if g.dtype != torch.float32 else g[r0:r1].clone()
    a.abs_()
    mine = live & (rows >= r0) & (rows < r1)  # stored rows inside this window: hidden
    # amin is order-independent, so duplicate rows of empty slots are harmless; rows outside the window scatter
    # +inf onto row 0, which changes nothing
    a.scatter_reduce_(0, torch.where(mine, rows - r0, 0), torch.where(mine, -1.0, math.inf), reduce="amin")
    cand, valid = _candidates(a, min(kc, r1 - r0))
    del a
    cand_abs = g[r0:r1].gather(0, cand).float().abs_().masked_fill_(~valid, -1.0)
    return cand + r0, cand_abs


def apply_sparse(p: Tensor, rows: Tensor, signs: Tensor, coef: float, group: Mapping[str, Any],
                 comp: Tensor | None = None, generator: CounterStream | None = None) -> None:
    """``rules.apply_update(p, d, coef, None, group)`` for TACO's one-entry-a-column d, touching n entries.

    p: (m, n); rows, signs: (1, n) as ``sparse_update`` returns them. The same arithmetic as the dense form on
    every entry: the decay multiplies all of p in place; the chosen entries get p + (-lr c) sign in fp32, rounded
    once to p's dtype (the dense add computes p + (-lr c) d in fp32 too, and adds exactly 0 elsewhere). Under
    ``param_rounding`` ``stochastic`` or ``kahan`` (comp: p's compensation; generator: the rounding's stream) the
    decay, when there is one, is a pass over p in row windows, and the chosen entries are written as
    ``rules.write`` writes."""
    lr = float(group["lr"])
    cols = torch.arange(p.shape[1], device=p.device)
    r = rows[0]
    rounding = rounding_of(group, p)
    if rounding == "nearest":
        decay(p, group)
        p[r, cols] = p[r, cols].float().add_(signs[0], alpha=-lr * coef).to(p.dtype)
        return
    if float(group["weight_decay"]) != 0.0:
        step_rows = max(1, window_elems(p.numel(), p.shape[1], ROUNDING_SCRATCH[rounding]) // p.shape[1])
        for a in range(0, p.shape[0], step_rows):
            part = comp[a:a + step_rows] if comp is not None else None
            y = value_of(p[a:a + step_rows], part)
            decay(y, group)
            write(p[a:a + step_rows], y, rounding, part, generator.at(a * p.shape[1]) if generator else None)
    y = p[r, cols].float()
    if comp is not None:
        y.add_(comp[r, cols])
    if generator is not None and float(group["weight_decay"]) != 0.0:
        generator = generator.fork(1)  # the decay's pass read the stream of every element: the entries' own
    new, lost = rounded(y.add_(signs[0], alpha=-lr * coef), p.dtype, rounding, generator)
    p[r, cols] = new
    if lost is not None:
        comp[r, cols] = lost
