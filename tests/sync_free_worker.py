"""Whether ``step()`` on the CUDA route would make the host wait for the device, checked on CPU tensors.

On a GPU, ``benchmarks/gpu_step_checks.py`` runs ``step()`` under ``torch.cuda.set_sync_debug_mode("error")``. This
is the same question asked where no GPU is: CPU tensors take the CUDA route (``TRITON_INTERPRET=1``,
``SLIMOPT_TRITON_CPU=1``, the C kernel and torch's CPU-only fused paths switched off), the Triton launches are
stubbed out (nothing runs, nothing is interpreted), and a dispatch mode records every operation that on a CUDA
tensor blocks the host until the device is done: reading a value (``item``, ``bool``, ``float``, ``tolist``,
``numpy``, ``torch.equal``), an output whose size depends on values (``nonzero``, ``masked_select``, boolean
indexing, ``unique``, ``repeat_interleave`` without its size), a linear-algebra error check, and a copy to the
host. Reads of the step counters are allowed: torch.optim keeps them on the host (0-d CPU tensors, as slimopt
does for every weight, wherever it lives), so they cost no synchronization.

Not seen from here: a copy from pageable host memory to the device (both sides are CPU tensors here), and what a
kernel does on the device. Prints one JSON object: per method and kind of step (a step between refreshes, and a
step that refreshes a subspace), the operations that would synchronize, with where in slimopt each was called.

Run by tests/test_sync_free.py in a process of its own (the interpreter is chosen when triton is imported).
"""

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SLIMOPT_TRITON_CPU") == "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import slimopt  # noqa: E402
from slimopt.models.llama import build_model  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from triton_host_time import _Launches, route_as_cuda  # noqa: E402  (a stub counting its launches)

aten = torch.ops.aten
HOST_KEYS = ("step", "moment_step")  # the state tensors that live on the host whatever the weight's device
# operations that make a CUDA host wait: a value read back, or an output sized by the values
SYNCING = {
    aten._local_scalar_dense.default: "reads a value on the host (item, bool, float, int)",
    aten.is_nonzero.default: "reads a value on the host (bool)",
    aten.equal.default: "torch.equal reads its answer on the host",
    aten.nonzero.default: "nonzero: an output sized by the values",
    aten.masked_select.default: "masked_select: an output sized by the values",
    aten._unique2.default: "unique: an output sized by the values",
    aten.unique_dim.default: "unique: an output sized by the values",
    aten.unique_consecutive.default: "unique_consecutive: an output sized by the values",
    aten._linalg_check_errors.default: "a linear-algebra error check reads the device's error codes",
}
# indexing whose output is sized by the values when an index is a boolean mask
MASKABLE = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
for name in ("repeat_interleave.Tensor", "repeat_interleave.self_Tensor"):
    SYNCING[getattr(aten.repeat_interleave, name.split(".")[1])] = "repeat_interleave without output_size"


def _where() -> str:
    """The innermost slimopt frame of the current stack: file:line function."""
    for frame in reversed(traceback.extract_stack()):
        if "/slimopt/" in frame.filename and "/tests/" not in frame.filename:
            path = frame.filename.split("/slimopt/", 1)[1]
            return f"{path}:{frame.lineno} {frame.name}"
    return "outside slimopt"


class SyncTrap(TorchDispatchMode):
    """Records the operations that would synchronize a CUDA device, but for reads of the host's step counters."""

    def __init__(self, opt):
        super().__init__()
        self.opt, self.found = opt, []

    def on_host(self, t) -> bool:
        """Whether `t` is a step counter of the optimizer's state now (one a step may have just made)."""
        return any(s.get(k) is t for s in self.opt.state.values() for k in HOST_KEYS)

    def _note(self, why: str) -> None:
        self.found.append(f"{why} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = SYNCING.get(func)
        if why is not None and not (func is aten._local_scalar_dense.default and self.on_host(args[0])):
            self._note(why)
        elif func in MASKABLE:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                self._note(f"{func.__name__} with a boolean mask: an output sized by the values")
        elif func in (aten._to_copy.default, aten.to.device) and str(kwargs.get("device", "")) == "cpu":
            self._note("a copy to the host")
        return func(*args, **kwargs)


def _patch_host_reads(trap: SyncTrap):
    """tolist, numpy and cpu() read no dispatched operation on a CPU tensor: count them as the GPU would."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def wrap(name):
        inner = saved[name]

        def read(self, *args, **kwargs):
            if not trap.on_host(self):
                trap._note(f"Tensor.{name}() copies to the host")
            return inner(self, *args, **kwargs)
        return read

    for name in saved:
        setattr(torch.Tensor, name, wrap(name))
    return saved


def trapped_step(opt) -> list[str]:
    trap = SyncTrap(opt)
    saved = _patch_host_reads(trap)
    try:
        with trap:
            opt.step()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return sorted(set(trap.found))


# beyond the recipes: FRUGAL's projections with a residual (random, columns), TACO's several components a column
# (tensor operations), a Kahan-compensated weight, stochastically rounded bf16 moments
VARIANTS = {
    "frugal random": ("frugal", dict(projector="random", density=0.25)),
    "frugal columns": ("frugal", dict(projector="columns", density=0.25)),
    "taco k=2": ("taco", dict(taco_k=2)),
    "galore kahan": ("galore", dict(param_rounding="kahan")),
    "adamw bf16_sr": ("adamw", dict(codec="bf16_sr")),
}


def check(name: str, update_gap: int) -> dict:
    """Steps 1 and 2 untrapped (state made, first refresh, plans), then steps 3 .. update_gap + 1 trapped: the
    steps between refreshes and, at update_gap + 1, a refresh of every subspace."""
    model = build_model("tiny", 512, 64, dtype=torch.bfloat16, seed=0, device=torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    method, settings = VARIANTS.get(name, (name, {}))
    try:  # the methods that refresh a subspace or turn blocks read update_gap; build refuses it elsewhere
        opt = slimopt.build(model, method, update_gap=update_gap, **settings)
    except ValueError:
        opt = slimopt.build(model, method, **settings)
    gen = torch.Generator().manual_seed(0)
    between, refresh, launches = [], [], 0
    for step in range(1, update_gap + 2):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        if step <= 2:
            opt.step()
        elif step <= update_gap:
            before = _Launches.count
            between += trapped_step(opt)
            launches += _Launches.count - before
        else:
            refresh += trapped_step(opt)
    return {"between refreshes": sorted(set(between)), "refresh": sorted(set(refresh)),
            "launches between refreshes": launches}


class _Syncing(torch.optim.Optimizer):
    """A control: a step that reads device values in each way the trap must see."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        for p in self.param_groups[0]["params"]:
            if bool(torch.isfinite(p.grad).all()):  # is_nonzero / item
                p.data[p.grad > 0] -= 1e-3  # boolean-mask indexing
            p.grad.sum().tolist()
            p.data.add_(float(p.grad.abs().max()), alpha=0.0)


def control() -> list[str]:
    p = torch.nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    return trapped_step(_Syncing([p]))


def main() -> None:
    route_as_cuda()
    methods = sys.argv[1].split(",") if len(sys.argv) > 1 else [*slimopt.methods(), *VARIANTS]
    report = {"control": control()}
    for method in methods:
        report[method] = check(method, update_gap=4)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
