"""How many bytes an optimizer's state occupies: on this rank, or summed over the ranks of a sharded run."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor counts the shard this rank holds
    return to_local() if callable(to_local) else t


def tensor_nbytes(t: Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_tensors(opt: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor in ``opt.state`` (the optimizer state holds plain tensors or DTensors, one dict a parameter)."""
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor)]


def state_nbytes(opt: torch.optim.Optimizer, total: bool = False, group: Any = None) -> int:
    """Exact bytes of every tensor in ``opt.state`` (codes, scales, padding, bases, step counters).

    Works for any torch optimizer whose state holds plain tensors or DTensors. Under FSDP2 (a process group is
    initialised) it counts what this rank holds: its shards and chunks, and its copy of replicated state
    (indices, steps). ``total=True`` sums that over the ranks of ``group`` (default: all ranks) with one
    all-reduce, so every rank must call it; replicated state then counts once per rank that holds it, which is
    the memory the whole job spends on it.
    """
    count = sum(tensor_nbytes(v) for v in state_tensors(opt))
    if not total or not (dist.is_available() and dist.is_initialized()):
        return count
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # nccl reduces GPU tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())
