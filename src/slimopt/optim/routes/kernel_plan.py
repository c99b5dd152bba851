"""A weight's one-pass element-wise step, its kernel arguments prepared once and replayed every step.

Reaching a kernel through the general path costs some 40-55 us of Python a tensor a step: the route through
``paramstep.step``, the moments' windows opened, each argument set one by one (the C kernel's struct on a
CPU, ``native.py``; the Triton launch's row of addresses and its key on CUDA, ``triton_step.py``). On the small
benchmark model that was 2.2 ms of 8-bit AdamW's 13-16 ms CPU step (39 tensors), more than the step's margin over
its goal; on a GPU, where launches are asynchronous, host time a step is the step time wherever it exceeds the
kernels' (LLaMA-1B: ~180 tensors). For most weights nothing in those arguments changes between steps but the
gradient's address and a few scalars (lr, the bias corrections, the decay), so ``build`` keeps them after a step
took a kernel (``CpuPlan``, ``LaunchPlan``), and each later step checks that the weight, its gradient's layout,
its state tensors and its group's settings are the ones planned (``Plan.matches``), refreshes the scalars the
way the general path sets them (``native.set_scalars``; ``triton_step.run`` reads them at launch) and calls the
kernel, or queues the launch. Anything else, or anything changed, takes the general path, which plans again.

Details: docs/modules.md, ``slimopt.optim.routes.kernel_plan``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm.codecs import FactoredRows
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.algorithm.rules import PARAM_STREAM, Counter, apply_update, comp_of, rounding_of
from slimopt.optim.distributed.sharded_bases import whole_of_basis
from slimopt.optim.routes import abi, choice, taco_routes, windowed
from slimopt.optim.routes.cpu import native
from slimopt.optim.routes.triton import triton_step, triton_taco

__all__ = ["Plan", "CpuPlan", "LaunchPlan", "ProjectedPlan", "ProjectedLaunchPlan", "TacoLaunchPlan",
           "build_launch", "build_cpu", "build_projected", "build_taco"]

class Plan:
    """What one weight's kernel step was prepared for: the weight's address and shape and the state tensors the
    kernel arguments point into. A plan lives on its parameter's route (``paramstep.Route``), which stands only
    while the group, its settings and the tensors' dtypes and layout are the ones it was chosen for; ``holds``
    checks the rest. A plain Plan replays nothing: it marks a weight whose step is not planned, so that while the
    same holds no step asks again."""

    replays = False
    needs_stream = False  # whether ``run`` draws from the step's random streams (``stream``)
    ages = True  # whether ``run`` takes the moments' age (advanced by the caller): TACO keeps no moment_step

    def __init__(self, group: dict[str, Any], p: Tensor, grad: Tensor, refs: list[tuple[str, Tensor, int]]) -> None:
        self.param_ptr, self.shape = p.data_ptr(), p.shape
        self.refs = refs
        self.age = Counter()  # the moments' age, advanced by the caller where ``ages``

    def holds(self, p: Tensor, state: dict[str, Tensor], step: int) -> bool:
        """Whether this step (number `step`) would take the planned arguments."""
        if p.data_ptr() != self.param_ptr or p.shape != self.shape:
            return False
        for key, t, ptr in self.refs:
            if state.get(key) is not t or t.data_ptr() != ptr:
                return False
        return True

    def run(self, p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], age: int,
            batch: Any, stream: Any = None) -> None:
        """The step, the moments `age` steps old (their ``moment_step`` already advanced); stream(i, start): the
        random stream of moment i (or of the weight, ``rules.PARAM_STREAM``) at a window, as the general path's."""
        raise NotImplementedError


class CpuPlan(Plan):
    """The C kernel's calls: (struct, window start) each. What a step changes besides the scalars is set again
    each step the way ``native.prepare`` sets it: the random streams of stochastic codecs and of a stochastically
    rounded weight (keyed by the step), and a factored moment's window of row means (opened and closed anew)."""

    replays = True

    def __init__(self, group, p, grad, refs, steps: list[tuple[Any, int]], windows: list, stochastic: bool) -> None:
        super().__init__(group, p, grad, refs)
        self.steps, self.windows = steps, windows
        self.noisy = [i for i, _, codec, _ in windows if codec.needs_generator]
        self.factored = [(i, key, codec) for i, key, codec, w in windows if isinstance(w, FactoredRows)]
        self.stochastic = stochastic
        self.needs_stream = bool(self.noisy) or stochastic

    def run(self, p, grad, state, group, age, batch, stream=None) -> None:
        address, size = grad.data_ptr(), grad.element_size()
        opened = [(i, codec.open(key, state, p.shape)) for i, key, codec in self.factored]
        for _, window in opened:
            window.defer_to(batch)
        for s, start in self.steps:
            s.grad = address + start * size
            native.set_scalars(s, group, age, True)
            for i in self.noisy:
                native.set_noise(s.codecs[i], stream(i, start))
            for i, window in opened:
                native.fill_factored(s.codecs[i], window, start)
            if self.stochastic:
                native.set_weight_noise(s, stream(PARAM_STREAM, start))
            native.run(s, group, self.windows)
        for _, window in opened:
            window.close()


class LaunchPlan(Plan):
    """A Triton launch's part for the weight (``triton_step.Launch``) but the gradient's address, the age and,
    where a moment or the weight rounds stochastically, the step's random streams."""

    replays = True

    def __init__(self, group, p, grad, refs, launch: Any, codecs: list, comp: Tensor | None) -> None:
        super().__init__(group, p, grad, refs)
        self.launch, self.codecs, self.comp = launch, codecs, comp
        self.rounding = rounding_of(group, p)
        self.needs_stream = self.rounding == "stochastic" or any(c.needs_generator for _, c in codecs)

    def holds(self, p, state, step) -> bool:
        # a launch of these settings that failed sends the weight to the eager step, as triton_step.applies does
        return (super().holds(p, state, step) and triton_step.available()
                and not triton_step.failed(self.launch.key[1]))

    def run(self, p, grad, state, group, age, batch, stream=None) -> None:
        codecs, rounding, comp = self.codecs, self.rounding, self.comp
        stream = stream if self.needs_stream else _no_stream

        def eager() -> None:
            windowed.in_windows(p, grad, state, group, codecs, age, stream, rounding, comp, one_pass=False)

        launch = _relaunch(self.launch, group, codecs, age, grad.data_ptr())
        if self.needs_stream:
            launch.row = triton_step.with_streams(launch.row, stream(PARAM_STREAM, 0) if rounding == "stochastic"
                                                  else None, windowed.moment_streams(codecs, stream))
        batch.launch(launch, eager)


def _relaunch(x: Any, group: dict[str, Any], codecs: list, age: int, grad: int, param: int | None = None) -> Any:
    """Launch `x` (``triton_step.prepare``'s) again for this step: its group, age, and the addresses of the
    gradient and (where it is a step's buffer) of what it writes."""
    row = (x.row[0] if param is None else param, grad) + x.row[2:]
    return triton_step.Launch(group, codecs, age, x.direction, x.n, x.blocks, row,
                              (id(group),) + x.key[1:4] + (age,) + x.key[5:], x.device, x.factored)


class ProjectedPlan(Plan):
    """A subspace projector's step between refreshes (``windowed.projected`` in one window, no residual): the
    kernel's arguments for the rule on the subspace gradient and for the lifted update's write, prepared once; the
    products run every step, into buffers whose addresses the arguments take each time. A refresh step, which
    chooses a new basis, takes the general path (and plans again)."""

    replays = True

    def __init__(self, group, p, grad, refs, key: str, projector: str, side: str, mm, low_shape, rule, write,
                 windows: list, reduce=None, phase: int = 0, rows=None, shape=None) -> None:
        super().__init__(group, p, grad, refs)
        self.key, self.projector, self.side, self.mm, self.low_shape = key, projector, side, mm, low_shape
        self.rule, self.write, self.windows, self.reduce = rule, write, windows, reduce
        self.update_gap, self.phase = group["update_gap"], phase  # phase: subspace.refresh_phase
        self.rows, self.shape = rows, shape  # the parameter's rows and whole shape: a right basis is gathered

    def holds(self, p, state, step) -> bool:
        return super().holds(p, state, step) and not P.refresh_due(step, self.update_gap, self.phase)

    def run(self, p, grad, state, group, age, batch, stream=None) -> None:
        q = state[self.key]
        if self.rows is not None:
            q = whole_of_basis(q, self.side, self.shape, self.rows, batch.bases)
        q = q if q.dtype == self.mm else q.to(self.mm)
        low = torch.empty(self.low_shape, dtype=torch.float32, device=p.device)
        windowed.down_into(low, grad, self.projector, self.side, q, self.mm)

        def rest() -> None:
            c = self.direction(low, state, group, age, p.dtype)  # written over the subspace gradient
            full = P.up(self.projector, self.side, low.to(self.mm), q, p.shape)
            self.lifted_write(p, full, group, c * float(group["scale"]))

        if self.reduce is None:
            rest()
        else:  # a left projection of a row shard: summed over the ranks, the rest once the sum is there
            self.reduce(low, rest)

    def direction(self, low: Tensor, state, group, age: int, dtype) -> float:
        """The rule on the subspace gradient `low`, its direction written over it; returns its coefficient."""
        s = self.rule
        s.param = s.grad = low.data_ptr()
        c = native.set_scalars(s, group, age, True)
        native.run(s, group, self.windows)
        return c

    def lifted_write(self, p: Tensor, full: Tensor, group, coef: float) -> None:
        """Decay, the lifted update `full` times coef and the rounding in one pass (``native.add_update``)."""
        w = self.write
        w.grad = full.data_ptr()
        native.set_scalars(w, native.add_group(group, coef), 0, False)
        native.run(w, group, [])


class ProjectedLaunchPlan(ProjectedPlan):
    """``ProjectedPlan`` on CUDA: the Triton launches of the subspace rule (``windowed.directions``) and of the
    lifted write (``windowed._lift``) but the buffers' addresses and the age; a launch that fails runs the
    general path's fallback for that step (and the settings' failure sends later steps to the general path)."""

    def __init__(self, group, p, grad, refs, key, projector, side, mm, low_shape, rule, write, codecs: list,
                 comp: Tensor | None, held: int, reduce=None, phase: int = 0, rows=None, shape=None) -> None:
        super().__init__(group, p, grad, refs, key, projector, side, mm, low_shape, rule, write, [], reduce, phase,
                         rows, shape)
        self.codecs, self.comp, self.held = codecs, comp, held

    def holds(self, p, state, step) -> bool:
        return (super().holds(p, state, step) and triton_step.available()
                and not triton_step.failed(self.rule.key[1]) and not triton_step.failed(self.write.key[1]))

    def direction(self, low, state, group, age, dtype) -> float:
        address = low.data_ptr()
        launch = _relaunch(self.rule, group, self.codecs, age, address, address)
        c = triton_step.run([launch])
        if c is None:  # the kernel failed (one warning): this step's rule as the general path runs it then
            return windowed.directions(low, low, state, group, self.codecs, age, _no_stream, dtype, self.held)
        return c

    def lifted_write(self, p, full, group, coef) -> None:
        if triton_step.run([_relaunch(self.write, native.add_group(group, coef), [], 0, full.data_ptr())]) is None:
            apply_update(p, full.float(), coef, None, group, comp=self.comp)


class TacoLaunchPlan(Plan):
    """TACO's Triton step at one component a column (``taco_routes.queue_triton``): every check the general path makes
    before it is skipped while the weight, its gradient's layout, its stored component and the settings hold;
    each run makes the weight's launch row anew (the gradient's address, the step's scalars) and queues it."""

    replays = True
    ages = False

    def __init__(self, group, p, grad, refs) -> None:
        super().__init__(group, p, grad, refs)
        self.kind = triton_taco._kind(p, grad)

    def holds(self, p, state, step) -> bool:
        return super().holds(p, state, step) and triton_step.available() and not triton_step.failed(self.kind)

    def run(self, p, grad, state, group, age, batch, stream=None) -> None:
        taco_routes.queue_triton(p, grad, state, group, batch)


def build_taco(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> Plan:
    """The plan of p's TACO step as Triton kernels (``taco_routes.queue_triton``), which the route has just taken."""
    return TacoLaunchPlan(group, p, grad, [(k, t, t.data_ptr()) for k, t in state.items()])


def build_projected(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any], projector: str,
                    side: str | None, key: str, residual: bool, codecs: list[tuple[str, Any]],
                    reduce=None, phase: int = 0, rows=None, shape=None, basis: Tensor | None = None) -> Plan:
    """The plan of p's projected step with these subspace moment codecs, which the general path has just taken
    (``paramstep``'s projected route); a plain ``Plan`` where it is not one that is planned: an orthonormal
    projection without a residual, in one window, whose rule and write one kernel each runs (the C kernel on a
    CPU, Triton on CUDA), moments read in place and not drawn at random, and a nearest or Kahan write. reduce:
    what sums a row shard's left projection over the ranks (``windowed.projected``'s); phase: the parameter's
    refresh phase (``subspace.refresh_phase``), the plan replaying until its refresh; rows, shape: the parameter's
    rows and whole shape (a row shard's right basis is kept in chunks and gathered for each step); basis: the one
    the step that plans used (a right basis gathered whole), the state's by default."""
    unplanned = Plan(group, p, grad, [])
    rounding = rounding_of(group, p)
    if (projector not in P.ORTHO_PROJECTORS or residual or group["rule"] not in abi.ELEMENTWISE_KERNEL_RULES
            or rounding not in ("nearest", "kahan")):
        return unplanned
    if any(codec.needs_generator or not native.in_kernel(codec) for _, codec in codecs):
        return unplanned
    basis = state[key] if basis is None else basis
    axis, work, mm, q, low_shape, held, spans = windowed.projected_geometry(p, grad, basis, projector, side,
                                                                           False, group)
    low = torch.empty(low_shape, dtype=torch.float32, device=p.device)
    full = torch.empty(p.shape, dtype=mm, device=p.device)
    if len(spans) != 1 or work != torch.float32:
        return unplanned
    comp = comp_of(state, p, rounding)
    refs = [(k, t, t.data_ptr()) for k, t in state.items()]
    write_group = native.add_group(group, 1.0)
    rule_kernel, write_kernel = choice.subspace_rule(group, low, codecs), choice.lifted_write(group, p, grad, full,
                                                                                             False)
    if rule_kernel == write_kernel == "triton":  # the kernels the general path takes
        rule = triton_step.prepare(low, low, state, group, codecs, 1, direction=True)
        write = triton_step.prepare(p, full, {}, write_group, [], 0, comp=comp)
        return ProjectedLaunchPlan(group, p, grad, refs, key, projector, side, mm, low_shape, rule, write, codecs,
                                   comp, held, reduce, phase, rows, shape)
    if (rule_kernel != "c_kernel" or write_kernel != "c_kernel"
            or len(windowed.direction_spans(low_shape, codecs, group, p.dtype, held)) != 1):
        return unplanned
    windows = [(i, k, codec, codec.open(k, state, low.shape)) for i, (k, codec) in enumerate(codecs)]
    if any(isinstance(w, FactoredRows) for *_, w in windows):  # opened for the check only, never closed
        return unplanned
    rule, _, _ = native.prepare(low.view(-1), low.view(-1), state, windows, 0, _no_stream, group, direction=True)
    write, _, _ = native.prepare(p.view(-1), full.view(-1), {}, [], 0, _no_stream, write_group,
                                 comp=comp.view(-1) if comp is not None else None)
    return ProjectedPlan(group, p, grad, refs, key, projector, side, mm, low_shape, rule, write, windows, reduce,
                         phase, rows, shape)


def build_launch(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any],
                 codecs: list[tuple[str, Any]]) -> Plan:
    """The plan of p's full-space element-wise step as a Triton launch, which the route has just taken; a plain
    ``Plan`` where it is not one that is planned (the module docstring)."""
    if group["rule"] not in abi.ELEMENTWISE_KERNEL_RULES:
        return Plan(group, p, grad, [])
    rounding = rounding_of(group, p)
    comp = comp_of(state, p, rounding)
    # every state tensor, checked by identity and address before each replay (the kernel points into them)
    refs = [(k, t, t.data_ptr()) for k, t in state.items()]
    # stand-in streams where the weight or a moment rounds stochastically: every run sets the step's own
    launch = triton_step.prepare(p, grad, state, group, codecs, 1, comp=comp,
                                 gen=_any_stream(PARAM_STREAM, 0) if rounding == "stochastic" else None,
                                 streams=windowed.moment_streams(codecs, _any_stream))
    return LaunchPlan(group, p, grad, refs, launch, codecs, comp)


def build_cpu(p: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any],
              codecs: list[tuple[str, Any]]) -> Plan:
    """The plan of p's full-space element-wise step in the C kernel, which the route has just taken; a plain
    ``Plan`` where it is not one that is planned (the module docstring)."""
    if group["rule"] not in abi.ELEMENTWISE_KERNEL_RULES or not all(native.in_kernel(c) for _, c in codecs):
        return Plan(group, p, grad, [])
    rounding = rounding_of(group, p)
    comp = comp_of(state, p, rounding)
    refs = [(k, t, t.data_ptr()) for k, t in state.items()]
    windows = [(i, key, codec, codec.open(key, state, p.shape)) for i, (key, codec) in enumerate(codecs)]
    weight, gradient = p.view(-1), grad.view(-1)
    steps = []
    for start, stop in windowed.kernel_spans(p, group, codecs, rounding):
        s, _, buffers = native.prepare(weight[start:stop], gradient[start:stop], state, windows, start,
                                       _any_stream, group, comp=comp.view(-1)[start:stop] if comp is not None else None,
                                       gen=_any_stream(PARAM_STREAM, start) if rounding == "stochastic" else None)
        assert not buffers  # every codec the kernel reads in place (native.in_kernel)
        steps.append((s, start))
    # a factored moment's window was opened for its pointers only and is never closed: each run opens it anew
    return CpuPlan(group, p, grad, refs, steps, windows, rounding == "stochastic")


def _any_stream(i: int, start: int) -> CounterStream:
    """A stand-in stream while a plan is prepared: every run sets the step's own (``CpuPlan.run``)."""
    return CounterStream(0).at(start)


def _no_stream(i: int, start: int) -> CounterStream:
    raise AssertionError("a planned Triton step draws no random numbers (no stochastic codec or rounding)")
