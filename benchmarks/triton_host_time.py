"""Host time of the CUDA (Triton) path's step, without a GPU: how long ``step()`` keeps the CPU busy per tensor.

On a GPU the step is launched asynchronously, so the optimizer's Python bookkeeping (step counters, routing, the
launch tables) bounds the step time wherever it exceeds the kernels' time. This script routes CPU tensors the way
CUDA ones go (the Triton path, under ``TRITON_INTERPRET=1`` and ``SLIMOPT_TRITON_CPU=1``), replaces the kernel
launch by a counter, and times ``step()`` on a model's parameters: the host time a step, and the launches a step.
A CUDA weight skips two environment look-ups a CPU one makes here (about 2 us a tensor).

    python benchmarks/triton_host_time.py adamw8bit --model small
"""

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["SLIMOPT_TRITON_CPU"] = "1"

import torch  # noqa: E402

import slimopt  # noqa: E402
from slimopt.optim import multi_tensor, native, triton_step  # noqa: E402
from slimopt.train.models import build_model  # noqa: E402


class _Launches:
    """Stands in for the kernel: counts launches, runs nothing."""

    count = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _Launches.count += 1
        return launch


def route_as_cuda() -> None:
    """CPU tensors take the CUDA route from here on, one torch thread, every kernel launch stubbed out."""
    torch.set_num_threads(1)
    native._state["lib"] = None  # the C kernel would take CPU tensors first
    multi_tensor._DEVICES = ()  # and torch's fused AdamW: route as on CUDA
    kernels = triton_step._triton()
    if kernels is None:
        raise SystemExit("triton is not installed (pip install triton)")
    for name in ("elementwise_step", "moment_step", "taco_columns", "column_best"):  # every kernel a step launches
        setattr(kernels, name, _Launches())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", help="a slimopt method (slimopt.build), e.g. adamw8bit, frugal, adamw")
    ap.add_argument("--model", default="small", help="a model config of slimopt.train.models (default small)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default 20; the median is printed)")
    args = ap.parse_args()
    route_as_cuda()
    model = build_model(args.model, 8192, 1, dtype=torch.bfloat16, seed=0, device=torch.device("cpu"))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = slimopt.build(model, args.method)
    for _ in range(3):
        opt.step()
    _Launches.count = 0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    print(f"{args.method} on {args.model}: {ms:.2f} ms host time a step, {len(params)} tensors "
          f"({ms / len(params) * 1e3:.0f} us each), {_Launches.count / args.steps:.0f} launches a step")


if __name__ == "__main__":
    main()
