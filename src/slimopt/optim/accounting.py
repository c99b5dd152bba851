"""How many bytes an optimizer's state occupies."""

from __future__ import annotations

import torch
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor counts the shard this rank holds
    return to_local() if callable(to_local) else t


def tensor_nbytes(t: Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_nbytes(opt: torch.optim.Optimizer) -> int:
    """Exact bytes of every tensor in ``opt.state`` (codes, scales, padding, bases, step counters).

    Works for any torch optimizer whose state holds plain tensors; for a sharded (DTensor) state it counts the
    shard held by this rank.
    """
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, Tensor):
                total += tensor_nbytes(v)
    return total
