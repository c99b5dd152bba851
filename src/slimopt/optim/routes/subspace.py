"""A projected step's subspace: chosen anew every ``update_gap`` steps, and what its moments do then.

GaLore (arXiv 2403.03507) takes the top-r singular vectors of the gradient (``svd``, or a randomized range finder,
``randomized_svd``); FRUGAL (arXiv 2411.07837) a random basis (``random``) or random coordinates (``columns``,
``rows``). The choice is a pure function of (seed, parameter index, refresh index) or of the gradient, so every
rank of a sharded run makes the same one: a decomposition of a row-sharded gradient gathers it or runs the range
finder on its rows (``sharded_bases.py``), and a left basis is kept by rows like the parameter. At a refresh the
moments are kept (GaLore), reset (FRUGAL) or rotated into the new basis (LDAdam, arXiv 2410.16103:
``on_refresh``). A failed or non-finite decomposition keeps the previous subspace (one warning).

Every parameter of a group refreshes at the same steps, or, under ``stagger_refresh``, each at its own phase of
the gap (``refresh_phase``: phases balanced by the refresh's cost), so that no step pays every decomposition.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.rules import MOMENTS
from slimopt.optim.distributed.owners import Job, plan_owners, randomized_svd_cost, svd_cost
from slimopt.optim.distributed.shardcomm import Rows, all_reduce, chosen_per_rank, gather_rows, gather_var_rows
from slimopt.optim.distributed.sharded import Target, local_selection, local_shape, moment_codecs, space_of
from slimopt.optim.distributed.sharded_bases import randomized_basis, rows_of_basis, svd_basis, whole_of_basis

__all__ = ["basis_key", "refresh_if_due", "init_moments", "count_moment_step", "refresh_phase", "refresh_cost"]


def refresh_cost(group: dict[str, Any], shape) -> float:
    """About the multiply-adds of one refresh of a `shape` weight under the group's projector (``owners.py``'s
    models; a seeded basis or coordinate draw: m n)."""
    m, n = shape[0], shape[1]
    projector = group["projector"]
    side = P.side_for(shape, group["proj_side"]) if projector in P.ORTHO_PROJECTORS else None
    r = P.subspace_rank(shape, projector, side, group["rank"], group["density"])
    if projector == "svd":
        return svd_cost(m, n)
    if projector == "randomized_svd":
        return randomized_svd_cost(m, n, min(r + group["oversample"], m, n), group["power_iters"])
    return float(m * n)


def refresh_phase(opt, param: Tensor, group: dict[str, Any]) -> int:
    """The step offset of `param`'s refreshes within each ``update_gap``: 0, or under ``stagger_refresh`` a phase
    in [0, update_gap) given by longest-processing-time-first over the gap's steps on the refreshes' costs
    (``owners.plan_owners``), made once per group from the parameters' whole shapes: alike on every rank."""
    gap = group["update_gap"]
    if not group["stagger_refresh"] or gap == 1:
        return 0
    key = (id(group), gap, group["projector"], len(group["params"]))
    phases = opt._phases.get(key)
    if phases is None:
        jobs = [Job(opt._where[p][2], tuple(p.shape), 0, refresh_cost(group, p.shape)) for p in group["params"]
                if opt._layout(p, group) == group["projector"]]
        plan = plan_owners(jobs, gap)
        phases = opt._phases[key] = {job.index: phase for job, phase in zip(plan.jobs, plan.owners)}
    return phases.get(opt._where[param][2], 0)


def basis_key(projector: str) -> str:
    """The state key of a projector's choice: an orthonormal basis, or coordinates."""
    return "proj" if projector in P.ORTHO_PROJECTORS else "proj_index"


def init_moments(state: dict[str, Tensor], codecs, shape: torch.Size, device) -> None:
    """Zero moments; ``moment_step`` counts the rule's updates since then, for Adam's bias correction (a reset or
    newly active block starts from zero moments, and must not be corrected as if it were old)."""
    for key, codec in codecs:
        state.update(codec.init(key, shape, device))
    state["moment_step"] = torch.zeros((), dtype=torch.float32)


def count_moment_step(state: dict[str, Tensor], codecs, shape: torch.Size, device) -> int:
    """Before a state-full update: zero moments (of the local `shape`) where there are none yet, and count this
    update in their age (returned)."""
    from slimopt.optim.algorithm.rules import advance
    if codecs[0][0] not in state:
        init_moments(state, codecs, shape, device)
    return advance(state["moment_step"])


def refresh_if_due(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int, projector: str,
                   side: str | None, r: int, decomposed: tuple[Tensor | None, str] | None = None) -> Tensor:
    """The subspace choice of this step (state's ``proj`` or ``proj_index``), chosen anew first where it is due;
    decomposed: (this rank's part of the new basis or None, status), where an owner rank decomposed it
    (``refresh_batch.py``)."""
    key = basis_key(projector)
    if key not in state or P.refresh_due(step, group["update_gap"], refresh_phase(opt, t.param, group)):
        g = t.grad if t.grad.dtype in (torch.float32, torch.float64) else t.grad.float()
        _refresh(opt, t, group, state, g, step, projector, side, r, key, decomposed)
    return state[key]


def _refresh(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], g: Tensor, step: int, projector: str,
             side: str | None, r: int, key: str, decomposed: tuple[Tensor | None, str] | None = None) -> None:
    """Choose the subspace anew, identically on every rank; keep / reset / rotate the moments."""
    rows = t.rows
    gen = P.generator(t.p.device, group["seed"], t.index,
                      P.refresh_index(step, group["update_gap"], refresh_phase(opt, t.param, group)))
    m, n = t.shape
    old = state.get(key)
    new = None
    if projector in ("svd", "randomized_svd"):
        if decomposed is not None:
            new, status = decomposed
            if new is not None and side != "left":  # an owner sends a right basis whole: this rank keeps its chunk
                new = rows_of_basis(new, side, rows)
        elif projector == "svd":
            new, status = svd_basis(g, r, side, rows)
        else:
            new, status = randomized_basis(g, r, side, gen, group["oversample"], group["power_iters"], rows)
        if status == "nonfinite":
            opt._warn_once("nonfinite", "slimopt: a non-finite gradient reached a subspace refresh; keeping the "
                           "previous subspace (warned once)")
        elif status != "ok":
            opt._warn_once("svd", f"slimopt: the subspace decomposition failed ({status}); keeping the previous "
                           "subspace (warned once)")
        if new is None and old is None:
            new = rows_of_basis(P.random_basis(m if side == "left" else n, r, gen, g.device, g.dtype), side, rows)
    elif projector == "random":
        new = rows_of_basis(P.random_basis(m if side == "left" else n, r, gen, g.device, g.dtype), side, rows)
    else:
        new = P.random_coordinates(n if projector == "columns" else m, r, gen, g.device)
    if new is None:
        return
    if projector in P.ORTHO_PROJECTORS and t.p.dtype in (torch.bfloat16, torch.float16):
        new = new.to(t.p.dtype)  # stored like the weights, as galore-torch does; used in fp32
    if old is not None:
        _carry_moments(opt, t, group, state, projector, side, r, old, new, step)
    state[key] = new


def _role(group: dict[str, Any], key: str) -> str:
    return dict(MOMENTS[group["rule"]])[key]


def _carry_moments(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], projector: str,
                   side: str | None, r: int, old: Tensor, new: Tensor, step: int) -> None:
    """on_refresh: keep, reset or rotate the moments into the new subspace."""
    rows: Rows = t.rows
    shape, dtype, device = t.shape, t.p.dtype, t.p.device
    key = basis_key(projector)
    old_space = space_of(group, projector, side, shape, r, rows, {key: old})
    new_space = space_of(group, projector, side, shape, r, rows, {key: new})
    if taco.owns(group, old_space.shape):
        if group["on_refresh"] != "keep":
            taco.reset(state)  # sparse (row, value) pairs cannot be rotated into a new subspace
        return
    old_codecs = moment_codecs(opt, group, old_space, dtype)
    if old_codecs[0][0] not in state:
        return
    new_codecs = moment_codecs(opt, group, new_space, dtype)
    mode = group["on_refresh"]
    if mode == "reset":
        init_moments(state, new_codecs, local_shape(new_space), device)
        return
    split_rows = projector == "rows" and rows.distributed
    if mode == "keep" and not split_rows:
        return  # the same local rows: nothing moves
    rot = None
    if mode == "project" and projector in P.ORTHO_PROJECTORS and side == "left" and rows.distributed:
        # R = Q_new^T Q_old sums over the rows of both bases, which are split like the parameter's: (r, r)
        rot = all_reduce(new.float().transpose(0, 1) @ old.float(), rows)
    moved = split_rows and (old_space.rows.start, old_space.rows.stop) != (new_space.rows.start,
                                                                         new_space.rows.stop)
    moments = {}
    old_whole, new_whole = old, new
    if mode == "project" and projector in P.ORTHO_PROJECTORS and side != "left":  # rotated by both bases whole
        old_whole, new_whole = whole_of_basis(old, side, shape, rows), whole_of_basis(new, side, shape, rows)
    for key_m, codec in old_codecs:
        # the codec's best estimate (an error-feedback residual included)
        x = codec.estimate(key_m, state, local_shape(old_space))
        if mode == "keep":
            # rows: moment row j stays at position j of the (r, n) subspace tensor, and position j now sits on
            # the rank that holds the newly chosen row: gather the (r, n) moment, keep the new local part.
            x = gather_var_rows(x, rows, chosen_per_rank(old, rows))[new_space.rows.start: new_space.rows.stop]
        elif rot is not None:
            rotation = rot * rot if _role(group, key_m) == "v" else rot
            if old_space.split:  # moments split by the subspace's rows: this rank's rows of R times all of them
                x = rotation[new_space.rows.start: new_space.rows.stop] @ gather_rows(x, old_space.rows)
            else:
                x = rotation @ x
        elif split_rows:
            old_sel, _ = local_selection(old, rows)
            new_sel, _ = local_selection(new, rows)
            x = P.rotate("rows", None, old_sel, new_sel, x, squared=False) if old_sel.numel() else \
                x.new_zeros((new_sel.numel(), x.shape[1]))
        else:
            x = P.rotate(projector, side, old_whole, new_whole, x, squared=_role(group, key_m) == "v")
        moments[key_m] = x.contiguous()
    if mode == "keep" and not moved:
        return  # this rank's part did not move: its stored moments stand as they are
    for key_m, codec in new_codecs:
        if moved:
            state.update(codec.init(key_m, local_shape(new_space), device))
        else:
            codec.clear_feedback(key_m, state)  # the carried residual was in the old coordinates
    for i, (key_m, codec) in enumerate(new_codecs):
        gen = P.stream(group["seed"], t.index, step, i, 1).at(new_space.offset) if codec.needs_generator else None
        codec.encode(key_m, moments[key_m], state, generator=gen)
