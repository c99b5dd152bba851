"""TACO (arXiv 2610.02199) on a row-sharded 2-D tensor: the same step as one process, with O(n) communication.

TACO picks, per column, the entry of largest magnitude over all rows, and rows live on different ranks:

- the bare direction (``taco_k=0``) is one max-loc all-reduce: every rank packs its best entry of each column
  into an int64 key whose order is (|value|, then the smaller row) and whose low bit keeps the sign, and a MAX
  all-reduce of the n keys is torch.argmax's choice over all rows (the first row on ties);
- with a history of k components per column (``taco.update``), each rank keeps the history of its chunk of the
  columns (split as torch.chunk splits them, ``shardcomm.chunks_of``) and the step gathers every column's
  (``record``; ``prefetch``: one all-gather for all such weights of a step; k (row + value) + scale bytes a
  column, 5 at the defaults); the stored entries' gradients are all-reduced (k x n, each has one owner and the
  others add zeros, so the sum is exact) and the k best candidates of all ranks are merged by k max-loc
  all-reduces (8 k n bytes, independent of the world size).
  Steps 4-6 of ``taco.update`` then run on identical data on every rank, each rank applies the direction to the
  rows it holds and keeps its columns' new history (``keep_columns``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from slimopt.optim.algorithm import taco
from slimopt.optim.distributed.shardcomm import Rows, all_reduce, chunks_of, gather_equal

__all__ = ["pack_keys", "unpack_keys", "taco_direction", "merge_top_keys", "taco_update", "record", "keep_columns",
           "prefetch"]


_ROW_BITS = 31  # rows < 2**31 (taco.row_dtype covers int32 rows)


# ----------------------------------------------------------------------------------------------------------------
# the history: each rank keeps its chunk of the columns, the step sees them all


def record(state, group, m: int, n: int, k: int, rows: Rows, device, gathered=None) -> dict[str, Tensor]:
    """The stored components of every column of a (m, n) weight whose rows are split as `rows` (``taco.KEYS``,
    (k, n), (k, n) and (n,)): the state itself where this rank keeps every column, else gathered from the ranks'
    column chunks in one all-gather of their packed bytes (or taken from `gathered`, ``prefetch``'s result, where
    it holds them). This rank's chunk is created where missing; the step changes the gathered copy, and
    ``keep_columns`` writes this rank's columns of it back."""
    cols = chunks_of(rows, n)
    if "taco_rows" not in state or tuple(state["taco_rows"].shape) != (k, cols.local):
        state.update(taco.init_state((m, cols.local), k, group["taco_format"], group["taco_scale_dtype"], device))
    if not cols.distributed:
        return state
    if gathered is not None and id(state) in gathered:
        return gathered.pop(id(state))
    return _gathered([(state, cols, n)])[0]


def prefetch(items) -> dict[int, dict[str, Tensor]]:
    """The histories of several row-split weights gathered at once, one all-gather a process group instead of one
    a weight: items are (state, rows, n) of weights whose chunks exist; returns {id(state): every column's
    history} for ``record``."""
    by_group: dict[int, list] = {}
    for state, rows, n in items:
        by_group.setdefault(id(rows.group), []).append((state, chunks_of(rows, n), n))
    out: dict[int, dict[str, Tensor]] = {}
    for entries in by_group.values():
        for (state, _, _), whole in zip(entries, _gathered(entries)):
            out[id(state)] = whole
    return out


def _fields(state) -> list[tuple[Tensor, int]]:
    """The history's tensors as (k, c) each (the scales as (1, c)), in the order they are packed, each with its
    bytes a column."""
    fields = [state["taco_rows"], state["taco_values"], state["taco_absmax"].reshape(1, -1)]
    return [(t, t.shape[0] * t.element_size()) for t in fields]


def _gathered(entries) -> list[dict[str, Tensor]]:
    """Every column's history of each (state, column chunks, n) of `entries` (one process group): one all-gather of
    every rank's chunks, each weight's padded to its chunk size. A weight's columns travel as bytes, (c, bytes a
    column): its rows, values and scale side by side; torch.chunk pads only the last columns, so the first n of
    the ranks' stacked chunks are the weight's."""
    fields = [_fields(state) for state, _, _ in entries]
    widths = [sum(b for _, b in f) for f in fields]
    sizes = [cols.chunk * w for (_, cols, _), w in zip(entries, widths)]
    mine = torch.zeros(sum(sizes), dtype=torch.uint8, device=entries[0][0]["taco_rows"].device)
    at = 0
    for (_, cols, _), f, w, size in zip(entries, fields, widths, sizes):
        region, col = mine[at: at + cols.local * w].view(cols.local, w), 0
        for t, b in f:
            region[:, col: col + b].copy_(t.T.contiguous().reshape(-1).view(torch.uint8).view(cols.local, b))
            col += b
        at += size
    every = gather_equal(mine, entries[0][1])  # row r: rank r's chunks of every weight
    out, at = [], 0
    for (_, cols, n), f, w, size in zip(entries, fields, widths, sizes):
        stacked = every[:, at: at + size].reshape(cols.world * cols.chunk, w)[:n]  # (n, bytes a column)
        whole, col = {}, 0
        for key, (t, b) in zip(taco.KEYS, f):
            part = stacked[:, col: col + b].contiguous().reshape(-1).view(t.dtype).view(n, t.shape[0]).T  # (k, n)
            whole[key] = part.contiguous() if key != "taco_absmax" else part.reshape(n)
            col += b
        out.append(whole)
        at += size
    return out


def keep_columns(state, whole: dict[str, Tensor], rows: Rows) -> None:
    """Write this rank's chunk of the columns of a step's history (``record``) back into its state."""
    if whole is state:
        return
    cols = chunks_of(rows, whole["taco_absmax"].shape[0])
    for key in taco.KEYS:
        state[key].copy_(whole[key][..., cols.start: cols.stop])


# ----------------------------------------------------------------------------------------------------------------
# the columns' max-loc over ranks


def pack_keys(absval: Tensor, rows_global: Tensor, negative: Tensor) -> Tensor:
    """Order-preserving int64 keys of (|value|, row, sign): larger |value| first, then the smaller row.

    absval: fp32 >= 0 (its bit pattern orders like the value); rows_global: int64; negative: bool. Key layout:
    bits 32..62 |value|, bits 1..31 (2**31 - 1 - row), bit 0 the sign. A MAX over keys is a max-loc with
    torch.argmax's tie rule (the first row)."""
    bits = absval.float().contiguous().view(torch.int32).to(torch.int64)
    inv_row = (1 << _ROW_BITS) - 1 - rows_global
    return (bits << 32) | (inv_row << 1) | negative.to(torch.int64)


def unpack_keys(keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``pack_keys`` for keys >= 0: (signed fp32 value, int64 row, valid). Keys < 0 are empty
    (valid False, row 0, value 0)."""
    valid = keys >= 0
    k = keys.clamp_min(0)
    bits = (k >> 32).to(torch.int32)
    absval = bits.view(torch.float32)
    rows = (1 << _ROW_BITS) - 1 - ((k >> 1) & ((1 << _ROW_BITS) - 1))
    value = torch.where((k & 1).bool(), -absval, absval)
    return torch.where(valid, value, 0.0), torch.where(valid, rows, 0), valid


def taco_direction(g: Tensor, rows: Rows) -> Tensor:
    """``taco.ternary_direction`` of a row-sharded g: one max-loc all-reduce of n keys. Local (rows.local, n)."""
    n = g.shape[1]
    if g.shape[0]:
        a = g.abs()
        r = a.argmax(dim=0, keepdim=True)  # (1, n), first maximum
        v = g.gather(0, r)[0]
        keys = pack_keys(v.abs(), r[0] + rows.start, torch.signbit(v))
    else:
        keys = torch.full((n,), -1, dtype=torch.int64, device=g.device)
    all_reduce(keys, rows, op=dist.ReduceOp.MAX)
    value, row, valid = unpack_keys(keys)
    return _one_per_column(g, row, value.sign(), valid, rows)


def _one_per_column(g: Tensor, row: Tensor, sign: Tensor, valid: Tensor, rows: Rows) -> Tensor:
    """A local (rows.local, n) tensor with sign[j] at global row[j] of column j where this rank holds that row."""
    d = torch.zeros_like(g)
    mine = valid & (row >= rows.start) & (row < rows.stop)
    cols = torch.nonzero(mine).flatten()
    if cols.numel():
        d[row[cols] - rows.start, cols] = sign[cols].to(d.dtype)
    return d


def merge_top_keys(keys: Tensor, kc: int, rows: Rows) -> Tensor:
    """The kc largest keys per column over all ranks, largest first. keys: (kc, n), each rank's own, sorted
    descending, -1 for none. kc rounds of a max-loc all-reduce (n keys each): in round t every rank proposes its
    best key not yet taken, the maximum is the t-th global candidate, and the rank that proposed it moves on.
    8 kc n bytes a step whatever the world size (an all-gather of every rank's keys would send 8 W kc n)."""
    if not rows.distributed:
        return keys
    n = keys.shape[1]
    cols = torch.arange(n, device=keys.device)
    ptr = torch.zeros(n, dtype=torch.long, device=keys.device)
    out = torch.empty_like(keys)
    for t in range(kc):
        mine = torch.where(ptr < kc, keys[ptr.clamp(max=kc - 1), cols], -1)
        best = all_reduce(mine.clone(), rows, op=dist.ReduceOp.MAX)
        out[t] = best
        ptr += ((mine == best) & (best >= 0)).long()  # keys are unique (rows differ): one rank moves on
    return out


def taco_update(state, g: Tensor, group, shape, rows: Rows, gathered=None) -> tuple[Tensor, float]:
    """``taco.update`` for a row-sharded 2-D g (local rows of a (rows.total, n) tensor), each rank keeping the
    history of its chunk of the columns (``record``).

    Steps 2-6 of taco.py, with the rows of other ranks brought in exactly: stored entries' gradients by an
    all-reduce of (k, n) values (each entry is owned by one rank, the others add zeros), candidates by merging
    every rank's k best (packed keys, ``merge_top_keys``), which orders them as ``taco._candidates`` does
    (largest first, the smaller row on ties). Returns the local rows of d, and c.
    """
    if g.dtype != torch.float32:
        raise ValueError(f"TACO under FSDP needs fp32 (or bf16, computed in fp32) gradients, got {g.dtype}")
    c = float(group["taco_alpha"]) * taco.dimension_factor(shape, group["taco_norm"])
    k = group["taco_k"]
    if k == 0:
        return taco_direction(g, rows), c
    m, n = rows.total, g.shape[1]
    whole = record(state, group, m, n, k, rows, g.device, gathered)
    beta = float(group["taco_decay"])
    stored_rows, values = taco.decode(whole)  # (k, n) global rows, fp32 values: the same on every rank
    live = values != 0
    mine = (stored_rows >= rows.start) & (stored_rows < rows.stop)
    rel = (stored_rows - rows.start).clamp(0, max(0, rows.local - 1))
    if rows.local:
        at_stored = torch.where(mine, g.gather(0, rel), 0.0)
    else:
        at_stored = torch.zeros((k, n), dtype=g.dtype, device=g.device)
    all_reduce(at_stored, rows)  # exact: one owner per entry, zeros elsewhere
    # 2. stored components follow the EMA of their own entry (same arithmetic as taco.update)
    values = torch.where(live, values.mul_(beta).add_(at_stored, alpha=1.0 - beta), 0.0)
    # 3. candidates among the rows not stored: every rank's best, merged by packed keys
    kc = min(k, m)
    kl = min(kc, rows.local)
    keys = torch.full((kc, n), -1, dtype=torch.int64, device=g.device)
    if kl:
        a = g.abs()
        hide = torch.where(live & mine, -1.0, math.inf)
        a.scatter_reduce_(0, rel, hide, reduce="amin")
        cand_rel, ok = taco._candidates(a, kl)
        v = g.gather(0, cand_rel)
        keys[:kl] = torch.where(ok, pack_keys(v.abs(), cand_rel + rows.start, torch.signbit(v)), -1)
    keys = merge_top_keys(keys, kc, rows)  # (kc, n): the global candidates in taco._candidates' order
    cand_value, cand_rows, valid = unpack_keys(keys)
    cand_values = cand_value.mul_(1.0 - beta).masked_fill_(~valid, 0.0)
    # 4. keep the k largest |value| of stored + candidates (stable: stored first)
    all_rows = torch.cat([stored_rows, cand_rows])
    all_values = torch.cat([values, cand_values])
    order = all_values.abs().sort(dim=0, descending=True, stable=True).indices[:k]
    kept_rows, kept_values = all_rows.gather(0, order), all_values.gather(0, order)
    # 5. the direction at the largest kept component, on the rank that holds its row
    d = _one_per_column(g, kept_rows[0], kept_values[0].sign(), torch.ones_like(kept_rows[0], dtype=torch.bool),
                        rows)
    # 6. store: every rank its columns
    taco._encode(whole, kept_rows, kept_values)
    keep_columns(state, whole, rows)
    return d, c


# ----------------------------------------------------------------------------------------------------------------
# the fast path at one component a column: one collective a weight


# The keys of the fast path travel as float64 (what gloo reduces fastest on a CPU; int64 reductions there are several
# times slower): every key is a non-negative int64 whose bits, read as a float64, are a finite non-negative number
# that orders like the integer, so a float64 MAX is the integer MAX. A candidate's key is ``pack_keys``' (its |g|
# bits at most those of inf: no NaN pattern), 0 for none; a stored entry's gradient is its order-preserving
# integer (``_float_keys``) shifted above 0 by _SHIFT, 0 from a rank that does not hold its row.
_SHIFT = (1 << 31) + 1


def _float_keys(x: Tensor) -> Tensor:
    """Order-preserving int64 keys of fp32 values: a MAX over keys is a MAX over the values (negative values' bits
    reversed), and ``_float_values`` inverts it."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _float_values(keys: Tensor) -> Tensor:
    bits = keys ^ ((keys >> 31) & 0x7FFFFFFF)
    return bits.to(torch.int32).view(torch.float32)


def local_keys(whole, g: Tensor, rows: Rows, search=None) -> Tensor:
    """What this rank sends for ``taco.sparse_update`` at taco_k 1 of its rows g (fp32 or bf16) of a
    (rows.total, n) gradient, from every column's history (``record``): (2, n) keys as float64 (above) whose MAX
    over ranks (``finish_k1``) is each column's best candidate (``pack_keys``; this rank searches its rows, the
    stored row of each column hidden where it holds it: search is a kernel's one-candidate search,
    ``taco_routes.search_for``, else row windows as tensor operations) and its stored entry's gradient (from the
    rank that holds it). 16 n bytes a weight."""
    n = g.shape[1]
    stored_rows, values = taco.decode(whole)  # (1, n) global rows, fp32 values: the same on every rank
    mine = (values != 0) & (stored_rows >= rows.start) & (stored_rows < rows.stop)
    keys = torch.zeros((2, n), dtype=torch.int64, device=g.device)
    if rows.local:
        rel = (stored_rows - rows.start).clamp(0, rows.local - 1)
        best = search(g, torch.where(mine[0], rel[0], -1)) if search is not None else None
        if best is not None:
            cand_rel, cand_abs = best
            valid = cand_abs >= 0
        else:
            cand_rel, valid = taco._window_candidates(g, rel, mine, 1)
        v = g.gather(0, cand_rel).float()
        keys[0] = torch.where(valid, pack_keys(v.abs(), cand_rel + rows.start, torch.signbit(v)), 0)[0]
        keys[1] = torch.where(mine, _float_keys(g.gather(0, rel)) + _SHIFT, 0)[0]
    return keys.view(torch.float64)


def finish_k1(whole, keys: Tensor, group, shape) -> tuple[Tensor, Tensor, float]:
    """Steps 2, 4-6 of ``taco.sparse_update`` at taco_k 1 from the keys MAX-reduced over ranks (``local_keys``),
    on identical data on every rank, the new history stored into `whole` (``record``; ``keep_columns`` keeps this
    rank's columns of it): (kept rows (1, n), global row numbers; their signs (1, n); c)."""
    c = float(group["taco_alpha"]) * taco.dimension_factor(shape, group["taco_norm"])
    beta = float(group["taco_decay"])
    stored_rows, values = taco.decode(whole)
    live = values != 0
    keys = keys.view(torch.int64)
    cand_value, cand_rows, valid = unpack_keys(torch.where(keys[:1] > 0, keys[:1], -1))
    at_stored = _float_values(keys[1:] - _SHIFT)
    # 2. the stored component follows the EMA of its own entry (taco.sparse_update's arithmetic)
    values = torch.where(live, values.mul_(beta).add_(at_stored, alpha=1.0 - beta), 0.0)
    cand_values = cand_value.mul_(1.0 - beta).masked_fill_(~valid, 0.0)
    # 4. keep the larger; 5. the direction; 6. store
    kept_rows, kept_values = taco._keep_larger(stored_rows, values, cand_rows, cand_values)
    taco._encode(whole, kept_rows, kept_values)
    return kept_rows, kept_values.sign(), c


def apply_local(p: Tensor, kept_rows: Tensor, signs: Tensor, coef: float, group, rows: Rows) -> None:
    """``taco.apply_sparse`` at nearest rounding on this rank's rows p: the decay of every local row, and the one
    entry of each column whose kept row this rank holds."""
    from slimopt.optim.algorithm.rules import decay
    decay(p, group)
    r = kept_rows[0]
    cols = torch.nonzero((r >= rows.start) & (r < rows.stop)).flatten()
    if cols.numel():
        local = r[cols] - rows.start
        lr = float(group["lr"])
        p[local, cols] = p[local, cols].float().add_(signs[0, cols], alpha=-lr * coef).to(p.dtype)
