"""Host time of the CUDA (Triton) path's step, without a GPU: how long ``step()`` keeps the CPU busy per tensor.

On a GPU the step is launched asynchronously, so the optimizer's Python bookkeeping (step counters, routing, the
launch tables) bounds the step time wherever it exceeds the kernels' time. This script routes CPU tensors the way
CUDA ones go (the Triton path, under ``TRITON_INTERPRET=1`` and ``SLIMOPT_TRITON_CPU=1``), replaces the kernel
launch by a counter, and times ``step()`` on a model's parameters: the host time a step, and the launches a step.
A CUDA weight skips two environment look-ups a CPU one makes here (about 2 us a tensor).

    python benchmarks/triton_host_time.py adamw8bit --model small
    python benchmarks/triton_host_time.py adamw8bit --model 1b --fsdp          # FSDP2 on one rank
    torchrun --nproc_per_node 2 benchmarks/triton_host_time.py adamw8bit --model 1b --fsdp

``--fsdp`` shards every decoder layer and the root with ``fully_shard`` (gloo; in this process when not started by
torchrun) and times each rank's step on its shards, to set beside the unsharded step: the launches a step and the
host time a tensor. The model is made on the meta device and given uninitialised memory: nothing is computed, and
collectives are counted, not run, while steps are timed (a GPU's nccl collective is a launch the host enqueues).
TACO's sharded step reads its column search's result on the host, which stubbed launches leave unwritten: it is
left out here.
"""

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["SLIMOPT_TRITON_CPU"] = "1"

import torch  # noqa: E402

import slimopt  # noqa: E402
from slimopt.optim.routes.cpu import native  # noqa: E402
from slimopt.optim.routes.torch import multi_tensor  # noqa: E402
from slimopt.optim.routes.triton import triton_step  # noqa: E402
from slimopt.models.llama import build_model  # noqa: E402
from slimopt.train.process_group import init_process_group  # noqa: E402


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


class _Collectives:
    """Stands in for torch.distributed's collectives while steps are timed: counts them, runs nothing, as a GPU's
    nccl collective is a launch the host enqueues (gloo on CPU tensors would block the host for the transfer)."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "broadcast", "gather", "all_to_all_single")

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self):
        import torch.distributed as dist
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(dist, n, self._count)
        return self

    def _count(self, *args, **kwargs) -> None:
        self.count += 1

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _sharded(model) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:  # under torchrun
            init_process_group("gloo")
        else:
            import tempfile
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            init_process_group("gloo", store=store, rank=0, world_size=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", help="a slimopt method (slimopt.build), e.g. adamw8bit, frugal, adamw")
    ap.add_argument("--model", default="small", help="a model config of slimopt.models.llama (default small)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default 20; the median is printed)")
    ap.add_argument("--fsdp", action="store_true", help="step FSDP2 shards (see above)")
    args = ap.parse_args()
    route_as_cuda()
    model = build_model(args.model, 8192, 1, dtype=torch.bfloat16, seed=0, device=torch.device("meta"))
    if args.fsdp:
        _sharded(model)
    model.to_empty(device="cpu")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = slimopt.build(model, args.method)
    for _ in range(3):
        opt.step()
    _Launches.count = 0
    times = []
    with _Collectives() as collectives:
        for _ in range(args.steps):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    where = ""
    if args.fsdp:
        import torch.distributed as dist
        where = f" (FSDP2 rank {dist.get_rank()} of {dist.get_world_size()})"
    print(f"{args.method} on {args.model}{where}: {ms:.2f} ms host time a step, {len(params)} tensors "
          f"({ms / len(params) * 1e3:.0f} us each), {_Launches.count / args.steps:.0f} launches and "
          f"{collectives.count / args.steps:.0f} collectives a step")


if __name__ == "__main__":
    main()
