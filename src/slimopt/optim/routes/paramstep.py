"""One parameter's step: its work, its route (``choice.py``), run.

``step`` is all ``SlimOptimizer.step`` does for a parameter, plain or an FSDP2 shard (``sharded.Target``):

    count the step;  work = full | taco | free | frozen | projected  (``work_of``: the block turn happens here)
    route = the parameter's route, chosen anew only when what it depends on changed (``signature``)
    run the route  (a multi-tensor or Triton route queues the tensor in the optimizer's batch, run at the end)

A route keeps what it prepared between steps (a ``kernel_plan`` plan: the kernel's arguments, replayed while the
weight, its gradient's layout, its state tensors and its settings hold). ``explain`` says which route a parameter
took and why each faster one declined; the ``slimopt.routes`` logger prints that at DEBUG when it is chosen.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES, Counter, advance, comp_of, rounding_of
from slimopt.optim.distributed import sharded_taco
from slimopt.optim.distributed.shardcomm import chunks_of
from slimopt.optim.distributed.sharded import (
    Target,
    effective_rank,
    local_selection,
    local_shape,
    moment_codecs,
    space_of,
    target_of,
)
from slimopt.optim.distributed.sharded_bases import basis_rows, gather_bases, whole_of_basis
from slimopt.optim.routes import choice, kernel_plan, refresh_batch, taco_routes, windowed
from slimopt.optim.routes.reference import reference
from slimopt.optim.routes.subspace import count_moment_step, init_moments, refresh_if_due, refresh_phase
from slimopt.optim.routes.torch import compiled, muon_batch
from slimopt.optim.routes.torch.multi_tensor import Batch  # what a step queues: the optimizer's, run at its end

__all__ = ["step", "group_key", "work_of", "explain", "prefetch_taco", "Route", "ROUTE_SETTINGS", "Batch"]

log = logging.getLogger("slimopt.routes")

# The settings a route depends on (lr, betas, eps, weight decay, momentum and the scales are read every step)
ROUTE_SETTINGS = ("rule", "projector", "codec", "m_codec", "v_codec", "state_bits", "eps_placement",
                  "param_rounding", "fused", "compile", "rank", "density", "proj_side", "proj_dtype", "free_rule",
                  "update_gap", "taco_k", "on_refresh", "block_order")


class Route:
    """A parameter's route: its name, what it was chosen for (``signature``), why each faster route declined, and
    what it keeps between steps (``plan``; ``counter``: its ``step`` counter's numpy view)."""

    __slots__ = ("name", "key", "why", "plan", "counter")

    def __init__(self, name: str, key: tuple, why: dict[str, str]) -> None:
        self.name, self.key, self.why, self.plan, self.counter = name, key, why, None, Counter()


def _count_step(state: dict[str, Tensor], route: Route | None) -> int:
    """``state["step"] += 1`` (made where missing), returning the new count, through the route's kept view."""
    counter = state.get("step")
    if counter is None:
        counter = state["step"] = torch.zeros((), dtype=torch.float32)
    return route.counter.advance(counter) if route is not None else advance(counter)


def group_key(group: dict[str, Any]) -> tuple:
    """The group's part of ``signature``: its identity and the settings a route depends on (asked once a step a
    group, not a parameter)."""
    return (id(group), *[group[k] for k in ROUTE_SETTINGS])


def signature(t: Target, settings: tuple, work: str) -> tuple:
    """What a parameter's route depends on: while it holds, the route stands. settings: ``group_key``."""
    p, g = t.p, t.grad
    return (work, settings, p.dtype, p.device, g.dtype, type(g), p.is_contiguous(), g.is_contiguous(),
            g.shape == p.shape, t.rows.distributed)


def step(opt, param: Tensor, group: dict[str, Any], settings: tuple | None = None, grad: Tensor | None = None) -> None:
    """One step of `param` from its gradient (see the module docstring); settings: ``group_key(group)``, where the
    caller has it; grad: the gradient where it is not param.grad."""
    t = target_of(opt, param, grad)
    state = opt.state[param]
    route = opt._routes.get(param)
    n = _count_step(state, route)  # a CPU tensor, as in torch.optim: no device sync
    work = work_of(opt, t, group, state, n)
    key = signature(t, group_key(group) if settings is None else settings, work)
    if route is None or route.key != key:
        name, why = choice.choose(opt, t, group, work)
        route = opt._routes[param] = Route(name, key, why)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("parameter %d %s (%s work): %s%s", t.index, tuple(t.shape), work, name,
                      "".join(f"; not {k}: {v}" for k, v in why.items()))
    _RUNS[route.name](opt, route, t, group, state, n, work)


def prefetch_taco(opt) -> dict[int, dict[str, Tensor]]:
    """The histories of the row-split TACO weights this ``step()`` steps, gathered at once (``sharded_taco.prefetch``:
    one all-gather, not one a weight): weights stepped whole (no projector) with a gradient and their chunks."""
    items = []
    for group in opt.param_groups:
        if group["rule"] != "taco" or group["taco_k"] < 1:
            continue
        for p in group["params"]:
            state, known = opt.state.get(p), opt._geometry.get(p)  # rows known from an earlier step
            if p.grad is None or p.dim() != 2 or opt._layout(p, group) != "none" or not state or \
                    "taco_rows" not in state or known is None:
                continue
            rows = known[0]
            if rows.distributed and tuple(state["taco_rows"].shape) == (group["taco_k"],
                                                                         chunks_of(rows, p.shape[1]).local):
                items.append((state, rows, p.shape[1]))
    return sharded_taco.prefetch(items) if items else {}


def prefetch_bases(opt) -> dict[int, tuple[Tensor, int, Tensor]]:
    """The right bases of the row-split weights this ``step()`` projects without refreshing them, gathered at once
    (``sharded_bases.gather_bases``: one all-gather, not one a weight); a basis refreshed in the step is gathered
    where the refresh makes it, as before."""
    items = []
    for group in opt.param_groups:
        projector = group["projector"]
        if projector not in P.ORTHO_PROJECTORS:
            continue
        for p in group["params"]:
            state, known = opt.state.get(p), opt._geometry.get(p)  # rows known from an earlier step
            if p.grad is None or p.dim() != 2 or not state or "proj" not in state or known is None or \
                    not known[0].distributed or opt._layout(p, group) != projector:
                continue
            side = P.side_for(p.shape, group["proj_side"])
            step = int(state["step"]) + 1 if "step" in state else 1  # what _count_step will make it
            if side != "left" and not P.refresh_due(step, group["update_gap"], refresh_phase(opt, p, group)):
                items.append((state["proj"], basis_rows(side, p.shape, known[0])))
    return gather_bases(items) if items else {}


def explain(opt, param: Tensor) -> tuple[str, dict[str, str]] | None:
    """(the route `param` took at its last step, {each faster route of its work: why it declined}), or None
    before its first step."""
    route = opt._routes.get(param)
    return None if route is None else (route.name, dict(route.why))


# ----------------------------------------------------------------------------------------------------------------
# the work


def work_of(opt, t: Target, group: dict[str, Any], state: dict[str, Tensor], step: int) -> str:
    """What this step of `t` does (``choice.py`` lists the works), the block turn of a ``block`` projector done:
    an inactive block holds nothing but its ``step``; an active one restarts its moments at a refresh under
    ``on_refresh="reset"``."""
    layout = opt._layout(t.param, group)
    if layout == "none":
        return "taco" if taco.owns(group, t.shape) else "full"
    if layout == "block":
        if not opt._block_active(t.param, group, step):
            for key in [k for k in state if k != "step"]:
                del state[key]
            return "free" if group["free_rule"] != "none" else "frozen"
        if P.refresh_due(step, group["update_gap"]) and step > 1 and group["on_refresh"] == "reset":
            if taco.owns(group, t.shape):
                taco.reset(state)
            else:
                init_moments(state, moment_codecs(opt, group, t.space(), t.p.dtype), t.p.shape, t.p.device)
        return "taco" if taco.owns(group, t.shape) else "full"
    side = P.side_for(t.shape, group["proj_side"]) if layout in P.ORTHO_PROJECTORS else None
    if P.subspace_rank(t.shape, layout, side, group["rank"], group["density"]) == 0:
        return "free" if group["free_rule"] != "none" else "frozen"
    return "projected"


# ----------------------------------------------------------------------------------------------------------------
# the routes' runs


def _full_codecs(opt, t: Target, group: dict[str, Any], work: str) -> list[tuple[str, Any]]:
    return moment_codecs(opt, group, t.space(), t.p.dtype) if work == "full" else []


def _multi_tensor_adamw(opt, route, t, group, state, step, work) -> None:
    codecs = _full_codecs(opt, t, group, work)
    count_moment_step(state, codecs, t.p.shape, t.p.device)
    opt._batch.adamw(group, t.p, t.grad, state)


def _multi_tensor_free(opt, route, t, group, state, step, work) -> None:
    opt._batch.residual(group, t.p, t.grad)


def _compiled(opt, route, t, group, state, step, work) -> None:
    codecs = _full_codecs(opt, t, group, work)
    age = count_moment_step(state, codecs, t.p.shape, t.p.device)
    g = t.grad if t.grad.dtype in (torch.float32, torch.float64) else t.grad.float()
    compiled.adamw_step(t.p, g, state, codecs, group, age)


def _replay(opt, route, t, group, state, step) -> bool:
    """Run the route's plan where it still matches (its moments' age counted here)."""
    plan = route.plan
    if plan is None:
        return False
    if not plan.holds(t.p, state, step):
        route.plan = None  # prepared for something else: the general path prepares it anew
        return False
    if not plan.replays:
        return False
    stream = t.streams(group, step) if plan.needs_stream else None
    plan.run(t.p, t.grad, state, group, plan.age.advance(state["moment_step"]) if plan.ages else 0, opt._batch, stream)
    return True


def _elementwise(kind: str) -> Callable[..., None]:
    """The run of the routes that step the weight element by element: ``triton``, ``c_kernel``,
    ``eager_windows``."""

    def run(opt, route, t, group, state, step, work) -> None:
        if work == "full" and _replay(opt, route, t, group, state, step):
            return
        codecs = _full_codecs(opt, t, group, work)
        age = count_moment_step(state, codecs, t.p.shape, t.p.device) if codecs else 0
        stream = t.streams(group, step)
        if kind == "triton":
            windowed.launch(t.p, t.grad, state, group, codecs, age, stream, opt._batch)
        else:
            rounding = rounding_of(group, t.p)
            windowed.in_windows(t.p, t.grad, state, group, codecs, age, stream, rounding,
                                comp_of(state, t.p, rounding), one_pass=kind == "c_kernel", batch=opt._batch)
        if work == "full" and route.plan is None:  # the next steps replay the kernel's arguments where they hold
            build = {"triton": kernel_plan.build_launch, "c_kernel": kernel_plan.build_cpu}.get(kind)
            route.plan = build(t.p, t.grad, state, group, codecs) if build and not group["compile"] else \
                kernel_plan.Plan(group, t.p, t.grad, [])

    return run


def _muon(opt, route, t, group, state, step, work) -> None:
    muon_batch.queue_step(opt, t, group, state, step, opt._batch.whole)


def _taco_c_kernel(opt, route, t, group, state, step, work) -> None:
    taco_routes.c_kernel_step(t.p, t.grad, state, group)


def _taco_triton(opt, route, t, group, state, step, work) -> None:
    if _replay(opt, route, t, group, state, step):
        return
    taco_routes.queue_triton(t.p, t.grad, state, group, opt._batch)
    if route.plan is None and all(k in state for k in taco.KEYS):
        route.plan = kernel_plan.build_taco(t.p, t.grad, state, group)


def _taco_sharded(opt, route, t, group, state, step, work) -> None:
    taco_routes.sharded_step(t.p, t.grad, state, group, t.shape, t.rows, opt._batch)


def _taco_sparse(opt, route, t, group, state, step, work) -> None:
    rounding = rounding_of(group, t.p)
    taco_routes.sparse_step(t.p, t.grad, state, group, reference.weight_stream(group, t, step),
                            comp_of(state, t.p, rounding))


def _eager(opt, route, t, group, state, step, work) -> None:
    reference.step(opt, t, group, state, step, work)


def _frozen(opt, route, t, group, state, step, work) -> None:
    pass


def _projected(opt, route, t, group, state, step, work, decomposed=None) -> None:
    """A subspace projector's step (``windowed.projected``): the refresh where due, then the step in windows of
    slices, its element-wise parts in the kernels ``choice.subspace_rule`` and ``choice.lifted_write`` pick. A row
    shard's decomposition is queued for an owner rank (``refresh_batch.py``), the step finished when its basis
    (`decomposed`) is there."""
    if _replay(opt, route, t, group, state, step):  # between refreshes, where planned
        return
    projector, shape = group["projector"], t.shape
    ortho = projector in P.ORTHO_PROJECTORS
    side = P.side_for(shape, group["proj_side"]) if ortho else None
    r = P.subspace_rank(shape, projector, side, group["rank"], group["density"])
    if decomposed is None and refresh_batch.due(opt, t, group, state, step, projector):
        refresh_batch.queue(opt, t, group, step, side, r, opt._batch.whole, lambda d: _projected(
            opt, route, t, group, state, step, work, d))
        return
    basis = refresh_if_due(opt, t, group, state, step, projector, side, r, decomposed)
    # what the products use: a rows projector's local rows; a right basis whole (each rank keeps a chunk)
    local = local_selection(basis, t.rows)[0] if projector == "rows" else \
        whole_of_basis(basis, side, shape, t.rows, opt._batch.bases) if ortho else basis
    # a subspace that spans the whole side leaves an exactly zero residual: computing it would leave rounding
    # noise, which sign() would blow up to a full step
    whole = effective_rank(projector, r, shape, state) == (shape[0] if side == "left" or projector == "rows"
                                                           else shape[1])
    residual = group["free_rule"] != "none" and not whole
    space = space_of(group, projector, side, shape, r, t.rows, state)
    stream = t.streams(group, step, moment_offset=space.offset)
    codecs, age, whole_rule = [], 0, None
    if group["rule"] in ELEMENTWISE_RULES:
        codecs = moment_codecs(opt, group, space, t.p.dtype)
        age = count_moment_step(state, codecs, local_shape(space), t.p.device)
    else:  # Muon's iteration and TACO's column search need the whole subspace matrix (small)
        def whole_rule(low: Tensor) -> tuple[Tensor, float]:
            return reference.stateful(opt, t, group, state, low, step, space)
    reduce, split = None, None
    if side == "left" and t.split:
        # Q^T G sums over rows: this rank's partial product summed while the step goes on with the other
        # parameters, the rest of this one's step once the sum is there (at the end of the step). Where the
        # moments are split by the subspace's rows, the rule needs only this rank's rows of the sum (a
        # reduce-scatter), unless FRUGAL's residual needs all of it (an all-reduce)
        split = space.rows if space.split else None

        def reduce(low: Tensor, rest: Callable[[], None]) -> None:
            if split is not None and not residual:
                opt._batch.sum_rows_async(split, low, rest)
            else:
                opt._batch.reduce_async(t.rows, low, rest)
    windowed.projected(t.p, t.grad, local, projector, side, residual, state, group, codecs, age, stream,
                       float(group["scale"]), whole_rule, reduce, split)
    if whole_rule is None and route.plan is None and split is None:
        # the steps to the next refresh replay the kernels' arguments (a split subspace takes the general path)
        route.plan = kernel_plan.build_projected(t.p, t.grad, state, group, projector, side,
                                                 "proj" if ortho else "proj_index", residual, codecs, reduce,
                                                 refresh_phase(opt, t.param, group), t.rows, shape, local)


_RUNS: dict[str, Callable[..., None]] = {
    "multi_tensor_adamw": _multi_tensor_adamw, "multi_tensor_free": _multi_tensor_free, "compiled": _compiled,
    "triton": _elementwise("triton"), "c_kernel": _elementwise("c_kernel"),
    "eager_windows": _elementwise("eager_windows"), "muon": _muon, "taco_c_kernel": _taco_c_kernel,
    "taco_triton": _taco_triton, "taco_sharded": _taco_sharded, "taco_sparse": _taco_sparse, "projected": _projected,
    "eager": _eager, "frozen": _frozen,
}
