"""The Triton kernels (slimopt/optim/routes/triton/triton_step.py) on CPU tensors under the interpreter, against the eager step.

Run by tests/test_triton.py in a process of its own, with TRITON_INTERPRET=1 and SLIMOPT_TRITON_CPU=1 set before
triton is imported (the interpreter is chosen when a kernel is defined); prints one JSON object: per case whether
weights and every state tensor match, and how many launches ran; and under "specializations" every distinct kernel
specialization the steps launched (argument types, constexprs, compile options), which
tests/triton_compile_worker.py compiles for a GPU.
"""

import inspect
import io
import json
import os
import sys
import warnings

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SLIMOPT_TRITON_CPU") == "1"

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from helpers import seeded_steps  # noqa: E402  (tests/ is this script's folder: sys.path[0])

import slimopt  # noqa: E402
from slimopt.optim.routes import kernel_plan  # noqa: E402
from slimopt.optim.routes.cpu import native  # noqa: E402
from slimopt.optim.routes.torch import multi_tensor  # noqa: E402
from slimopt.optim.routes.triton import triton_step, triton_taco  # noqa: E402

# 2-D with partial last blocks (the kernel), 1-D and small (fp32 moments: the kernel for bf16 weights, torch's fused
# AdamW for fp32 ones, whose v may differ by an ulp from the eager step's)
SHAPES = [(24, 300), (3000,), (30,)]
CASES = [  # (rule, m codec, v codec, settings)
    ("adamw", "fp32", "fp32", {}), ("adamw", "int8", "int8", {}), ("adamw", "int4", "int4", {}),
    ("adamw", "bf16", "int8", {}), ("adamw", "int8", "int4", dict(eps_placement="galore")),
    ("lion", "int8", None, {}), ("sgdm", "int4", None, dict(momentum=0.9)), ("sgdm", "bf16", None, dict(momentum=0.9)),
    # the state-free updates: signSGD everywhere, and FRUGAL's blocks (int8 moments on the active one, the sign step
    # on the others, turns every 2 steps) and an SGD residual
    ("adamw", "fp32", None, dict(projector="block", density=0.0, free_rule="sign")),
    ("adamw", "int8", "int8", dict(projector="block", density=0.5, free_rule="sign", update_gap=2)),
    ("adamw", "fp32", None, dict(projector="block", density=0.0, free_rule="sgd", free_scale=0.5)),
    # projected steps: the subspace rule writes its direction through the kernel (GaLore; FRUGAL's columns)
    ("adamw", "int8", "int8", dict(projector="svd", rank=8, update_gap=2)),
    ("adamw", "fp32", "fp32", dict(projector="columns", density=0.25, free_rule="sign", update_gap=2)),
    # bf16 weights written with stochastic rounding (the weight's stream hashed in the kernel) or a Kahan
    # compensation (rules whose arithmetic has no square root: bit for bit); fp32 weights write to nearest
    ("lion", "int8", None, dict(param_rounding="stochastic")),
    ("adamw", "fp32", None, dict(projector="block", density=0.0, free_rule="sign", param_rounding="stochastic")),
    ("sgdm", "int4", None, dict(momentum=0.9, param_rounding="kahan")),
    # moments rounded stochastically from their own streams (bf16_sr, ternary), a ternary m stored by the moment
    # pass (every form: rms, mean and absmax scales, bf16 and fp32 scales, error feedback), a factored v through
    # the rows layout (block codes of m then stored by the moment pass), GaLore's subspace moments ternary and
    # factored (ternary_adamw's), a stochastically rounded weight beside stochastically rounded moments
    ("adamw", "bf16_sr", "bf16_sr", {}), ("adamw", "ternary", "factored", {}), ("adamw", "ternary_ef", "int8", {}),
    ("adamw", "ternary_ef_mean64", "factored", {}), ("adamw", "ternary_sr", "fp32", dict(eps_placement="galore")),
    ("lion", "ternary", None, {}), ("sgdm", "ternary_sr_mean64", None, dict(momentum=0.9)),
    ("adamw", "int4", "factored", {}), ("adamw", "ternary", "factored", dict(projector="svd", rank=8, update_gap=2)),
    ("adamw", "bf16_sr", "factored", dict(param_rounding="stochastic")),
]
LRS = [1e-2, 6e-3, 4e-3]
LIFTED = [(torch.float32, "svd", "sign", "nearest"), (torch.bfloat16, "svd", "sign", "nearest"),
          (torch.bfloat16, "random", "sgd", "kahan"), (torch.bfloat16, "svd", "sgd", "stochastic"),
          (torch.bfloat16, "columns", "sign", "nearest")]
KERNELS = ("elementwise_step", "moment_step", "taco_columns", "column_best")
_POINTEE = {torch.float32: "fp32", torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32",
            torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}


class Recorder:
    """Stands in for a kernel: keeps each launch's argument types, constexprs and options, then runs it."""

    def __init__(self, name, fn, seen):
        self.name, self.fn, self.seen = name, fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            params = inspect.signature(self.fn.fn).parameters  # the Python function's
            names = list(params)
            values = dict(zip(names, args))
            values.update({k: v for k, v in kwargs.items() if k in names})
            options = {k: v for k, v in kwargs.items() if k not in names}
            signature, constexprs = {}, {}
            for name in names:
                value = values[name]
                if params[name].annotation in (tl.constexpr, "tl.constexpr"):
                    signature[name], constexprs[name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[name] = "*" + _POINTEE[value.dtype]
                elif isinstance(value, int):
                    signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                else:
                    signature[name] = "fp32"
            spec = {"kernel": self.name, "signature": signature, "constexprs": constexprs, "options": options}
            self.seen.setdefault(json.dumps(spec, sort_keys=True), spec)
            self.fn[grid](*args, **kwargs)
        return launch


class Counting:
    """triton_step.run, counting the launches that ran and the tensors they stepped."""

    def __init__(self):
        self.calls, self.tensors, self.lifts, self.inner = 0, 0, 0, triton_step.run

    def __call__(self, launches):
        ok = self.inner(launches)
        self.calls += ok is not None
        self.tensors += len(launches) if ok is not None else 0
        self.lifts += ok is not None and launches[0].key[1][0].startswith("lift")  # a write with a residual
        return ok


def params(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def run(ps, opt, first, last):
    seeded_steps(ps, opt, first, last, LRS)


def settings(rule, m, v, extra):
    kw = dict(lr=1e-2, weight_decay=0.1, rule=rule, m_codec=m, **extra)
    if v is not None:
        kw["v_codec"] = v
    return kw


def compare(a, b, oa, ob, dtype, steps=5):
    """Weights and state of two runs of at most `steps` steps, with test_native's criteria (the arithmetic is the C
    kernel's): "exact" whether every tensor is equal (it is on the machines tried), "weights" and "state" within
    what another processor's torch may round differently: fp32 weights an ulp (torch's CPU square root is not
    always correctly rounded), bf16 weights one bf16 step a step, float state 1e-6 relative, codes 1e-3 of them."""
    out = {"weights": True, "state": True, "exact": True, "max_weight_diff": 0.0}
    for pa, pb in zip(a, b):
        diff = (pa.float() - pb.float()).abs()
        out["max_weight_diff"] = max(out["max_weight_diff"], diff.max().item())
        out["exact"] &= torch.equal(pa, pb)
        if dtype == torch.bfloat16:
            ulp = torch.finfo(torch.bfloat16).eps * (pb.float().abs() + 2 * sum(LRS))
            out["weights"] &= bool((diff <= steps * ulp).all())
        else:
            out["weights"] &= bool(torch.allclose(pa, pb, rtol=1e-6, atol=1e-7))
        sa, sb = oa.state[pa], ob.state[pb]
        out["state"] &= sorted(sa) == sorted(sb)
        for k in sa:
            x, y = sa[k], sb[k]
            out["exact"] &= torch.equal(x, y)
            if x.is_floating_point():
                out["state"] &= bool(torch.allclose(x.float(), y.float(), rtol=1e-6, atol=1e-12))
            else:
                out["state"] &= x.shape == y.shape and (x != y).float().mean().item() <= 1e-3
    return out


def main():
    native._state["lib"] = None  # the C kernel would take CPU tensors first
    multi_tensor._DEVICES = ()  # and torch's fused AdamW and foreach residual step: route as on CUDA
    warnings.simplefilter("error", RuntimeWarning)  # a kernel failure must not pass silently here
    counting = Counting()
    triton_step.run = counting  # what windowed.py and multi_tensor.py call (the module's attribute)
    kernels = triton_step._triton()
    specializations = {}
    for name in KERNELS:
        setattr(kernels, name, Recorder(name, getattr(kernels, name), specializations))
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rule, m, v, extra in CASES:
            kw = settings(rule, m, v, extra)
            before = counting.calls
            a, b = params(dtype), params(dtype)
            fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
            run(a, fast, 0, 3)
            run(b, eager, 0, 3)
            tag = (extra.get("eps_placement") or extra.get("free_rule") or "") + extra.get("param_rounding", "")
            name = f"{rule}/{m}/{v}/{extra.get('projector', '')}{tag}{extra.get('density', '')}/{str(dtype)[6:]}"
            report[name] = {**compare(a, b, fast, eager, dtype), "launches": counting.calls - before}
    # FRUGAL's orthonormal projections with a residual: the write (decay, c L + free_scale free_rule(-up + g),
    # the rounding) as one launch a step; SGD momentum in the subspace (no square root): bit for bit
    for dtype, projector, free_rule, rounding in LIFTED:
        size = dict(density=0.25) if projector == "columns" else dict(rank=8)
        kw = settings("sgdm", "fp32", None, dict(momentum=0.9, projector=projector, update_gap=2, free_rule=free_rule,
                                                 free_scale=0.5, param_rounding=rounding, **size))
        a, b = params(dtype)[:1], params(dtype)[:1]
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        before = counting.lifts
        run(a, fast, 0, 3)
        run(b, eager, 0, 3)
        report[f"lift {projector} {free_rule} {rounding} {str(dtype)[6:]}"] = {
            **compare(a, b, fast, eager, dtype), "lifts": counting.lifts - before}
    # GaLore between refreshes replays its planned launches (kernel_plan.ProjectedLaunchPlan): one refresh, at step 1
    for dtype in (torch.float32, torch.bfloat16):
        kw = settings("adamw", "int8", "int4", dict(projector="svd", rank=8, update_gap=10, scale=0.25))
        a, b = params(dtype), params(dtype)
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        before = counting.calls
        run(a, fast, 0, 4)
        run(b, eager, 0, 4)
        report[f"galore planned/{str(dtype)[6:]}"] = {
            **compare(a, b, fast, eager, dtype, steps=4), "launches": counting.calls - before,
            "planned": type(getattr(fast._routes.get(a[0]), "plan", None)).__name__}
    # tensors of one size and settings step in one launch: five weights of two sizes (the 2-D ones and the 1-D
    # ones of 7200 elements share a launch) and two groups
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(1)
        shapes = [(24, 300), (7200,), (24, 300), (30,), (30,)]
        a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        b = [torch.nn.Parameter(x.detach().clone()) for x in a]
        kw = settings("adamw", "int8", "int4", {})
        groups = lambda ps: [{"params": ps[:4]}, {"params": ps[4:], "weight_decay": 0.0}]  # noqa: E731
        fast, eager = slimopt.SlimOptimizer(groups(a), **kw), slimopt.SlimOptimizer(groups(b), fused=False, **kw)
        before, tensors = counting.calls, counting.tensors
        run(a, fast, 0, 3)
        run(b, eager, 0, 3)
        report[f"batched/{str(dtype)[6:]}"] = {**compare(a, b, fast, eager, dtype), "launches": counting.calls - before,
                                              "tensors": counting.tensors - tensors,
                                              "plans": sum(isinstance(getattr(fast._routes.get(p), "plan", None), kernel_plan.LaunchPlan)
                                                           for p in a)}
    # ternary_adamw's moments (ternary m, factored v): the two 2-D weights of one shape share their launches (the
    # rows layout and the moment pass), the 1-D weight's v is fp32 (a factored codec keeps a 1-D moment so); with
    # a scratch budget under one weight's fp64 sums, each 2-D weight launches on its own
    budget = triton_step._SCRATCH_BYTES
    for dtype, split in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        triton_step._SCRATCH_BYTES = 1 if split else budget
        gen = torch.Generator().manual_seed(2)
        shapes = [(24, 300), (7200,), (24, 300), (30,)]
        a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        b = [torch.nn.Parameter(x.detach().clone()) for x in a]
        kw = settings("adamw", "ternary", "factored", {})
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        before, tensors = counting.calls, counting.tensors
        run(a, fast, 0, 3)
        run(b, eager, 0, 3)
        report[f"batched ternary{' split' if split else ''}/{str(dtype)[6:]}"] = {
            **compare(a, b, fast, eager, dtype), "launches": counting.calls - before,
            "tensors": counting.tensors - tensors}
    triton_step._SCRATCH_BYTES = budget
    # TACO at taco_k 1: its whole step as Triton kernels (triton_taco), every weight of one shape in the same
    # launches; at k = 0 the one-candidate search as a Triton kernel (column_best) and the rest tensor operations;
    # against the eager step's torch search. Two 2-D weights of one shape (rows stored as uint8) and one of
    # another (300 rows: int16, five row chunks of the search); gradients rounded to a few levels so that ties
    # across the row chunks are common. With a scratch budget under one weight's, each weight launches alone
    counts = {"search": 0, "runs": 0, "stepped": 0}
    search, whole = triton_taco.column_best, triton_taco.run

    def counted_search(*args):
        counts["search"] += 1
        return search(*args)

    def counted_whole(launches):
        counts["runs"] += 1
        counts["stepped"] += len(launches)
        return whole(launches)

    triton_taco.column_best, triton_taco.run = counted_search, counted_whole
    taco_shapes = [(24, 300), (300, 24), (24, 300), (3000,), (30,)]
    for dtype, k, extra, split in ((torch.float32, 1, {}, False), (torch.bfloat16, 1, {}, False),
                                   (torch.float32, 1, dict(taco_format="int8", taco_scale_dtype="fp32"), False),
                                   (torch.bfloat16, 1, dict(taco_format="int8", taco_scale_dtype="fp32"), False),
                                   (torch.bfloat16, 1, {}, True), (torch.float32, 0, {}, False),
                                   (torch.bfloat16, 0, {}, False)):
        triton_step._SCRATCH_BYTES = 1 if split else budget
        kw = dict(lr=1e-2, weight_decay=0.1, rule="taco", taco_k=k, **extra)
        gen = torch.Generator().manual_seed(3)
        a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in taco_shapes]
        b = [torch.nn.Parameter(x.detach().clone()) for x in a]
        fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        before = dict(counts)
        for t in range(3):
            gen = torch.Generator().manual_seed(200 + t)
            for pa, pb in zip(a, b):
                g = torch.randint(-4, 5, pa.shape, generator=gen).to(dtype)
                pa.grad, pb.grad = g.clone(), g.clone()
            fast.step()
            eager.step()
        two_d = all(torch.equal(x, y) and all(torch.equal(fast.state[x][key], eager.state[y][key])
                                              for key in eager.state[y]) for x, y in zip(a, b) if x.dim() == 2)
        name = f"taco k={k}{' int8' if extra else ''}{' split' if split else ''} {str(dtype)[6:]}"
        report[name] = {**compare(a, b, fast, eager, dtype), "searches": counts["search"] - before["search"],
                        "runs": counts["runs"] - before["runs"], "stepped": counts["stepped"] - before["stepped"],
                        "2-D exact": two_d, "plans": sorted({type(getattr(fast._routes.get(x), "plan", None)).__name__ for x in a
                                                             if x.dim() == 2})}
    triton_step._SCRATCH_BYTES = budget
    # a checkpoint written by the Triton path resumes on the eager one (and back) with the same results
    kw = settings("adamw", "int8", "int4", {})
    a, b = params(torch.bfloat16), params(torch.bfloat16)
    fast, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
    run(a, fast, 0, 2)
    run(b, eager, 0, 2)
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    buf.seek(0)
    switched = slimopt.SlimOptimizer(a, fused=False, **kw)
    switched.load_state_dict(torch.load(buf, weights_only=True))
    run(a, switched, 2, 4)
    run(b, eager, 2, 4)
    report["switch to eager at resume"] = compare(a, b, switched, eager, torch.bfloat16)
    buf = io.BytesIO()
    torch.save(eager.state_dict(), buf)
    buf.seek(0)
    back = slimopt.SlimOptimizer(b, **kw)
    back.load_state_dict(torch.load(buf, weights_only=True))
    before = counting.calls
    run(b, back, 4, 5)
    run(a, switched, 4, 5)
    report["switch to Triton at resume"] = {**compare(b, a, back, switched, torch.bfloat16),
                                            "launches": counting.calls - before}
    # a kernel that fails to compile or launch: one warning, the eager step, and no second try
    warnings.simplefilter("default", RuntimeWarning)

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PTX assembly failed (a test's stand-in)")
            return launch

    def broken_run(name, kw, dtype, text="Triton element-wise step failed"):
        """Three steps with kernel `name` failing at every launch, against the eager step; the warnings it cost
        (those whose message holds `text`)."""
        real = getattr(kernels, name)
        setattr(kernels, name, Broken())
        a, b = params(dtype), params(dtype)
        broken, eager = slimopt.SlimOptimizer(a, **kw), slimopt.SlimOptimizer(b, fused=False, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(a, broken, 0, 3)
        setattr(kernels, name, real)
        run(b, eager, 0, 3)
        messages = [str(w.message) for w in caught if text in str(w.message)]
        return compare(a, b, broken, eager, dtype), messages

    result, messages = broken_run("elementwise_step", settings("adamw", "int8", "int8", {}), torch.float32)
    report["failed kernel"] = {**result, "warnings": len(messages),
                               "names_kernel": bool(messages) and "PTX assembly failed" in messages[0],
                               "fallbacks": len(triton_step.fallbacks())}
    # a second pass (the moment pass) that fails to compile: compiled before the first pass writes anything, so
    # the tensors are as they were and step eagerly
    triton_step._COMPILED.clear()  # as in a process that has not compiled these settings yet
    result, messages = broken_run("moment_step", settings("adamw", "ternary", "factored", {}), torch.bfloat16)
    report["failed moment pass"] = {**result, "warnings": len(messages)}
    # TACO's kernels failing: one warning, the tensor operations for that step and every later one
    result, messages = broken_run("taco_columns", dict(lr=1e-2, weight_decay=0.1, rule="taco"), torch.bfloat16,
                                  "Triton TACO step failed")
    report["failed taco kernel"] = {**result, "warnings": len(messages)}
    report["specializations"] = list(specializations.values())
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
