"""Muon (``muon.py``) on a matrix whose rows are spread over ranks (FSDP2).

The iteration needs the whole matrix: each rank updates the momentum of its own rows (element-wise, local), the
rows of U are all-gathered in the iteration's dtype (2 bytes a value for bf16; 4 for fp32), every rank runs the
iteration on the whole matrix and keeps its rows: the same step as one process, bit for bit. The bytes are those
of the all-gather, A x B x 2 (bf16) per matrix and step; every rank repeats the iteration. The eager step's
scheme (the reference), and Muon's in a row-split subspace; the fast step orthogonalizes each matrix once, on an
owner rank (``exchange.py``, ``routes/torch/muon_batch.py``).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from slimopt.optim.algorithm.muon import iteration_dtype, lr_ratio, momentum_update, orthogonalize
from slimopt.optim.distributed.shardcomm import Rows, gather_rows

__all__ = ["direction"]


def direction(g: Tensor, buf: Tensor, group: Mapping[str, Any], shape, rows: Rows) -> tuple[Tensor, float]:
    """``muon.direction`` of this rank's rows g (and momentum rows buf) of a (rows.total, n) matrix: this rank's
    rows of d, and c."""
    if not rows.chunked:
        raise ValueError("rule 'muon' under FSDP2 orthogonalizes all-gathered rows, which needs torch.chunk's row "
                         "split; the 'rows' projector splits its chosen rows unevenly: use 'columns', 'block' or an "
                         "orthonormal projector with rule 'muon'")
    dtype = iteration_dtype(group["ns_dtype"], g.device)
    u = momentum_update(g, buf, group)
    whole = gather_rows(u.to(dtype).contiguous(), rows)
    o = orthogonalize(whole, group["ns_coefficients"], group["ns_steps"], float(group["ns_eps"]), dtype)
    return o[rows.start: rows.stop].float(), lr_ratio(group["adjust_lr_fn"], shape)
