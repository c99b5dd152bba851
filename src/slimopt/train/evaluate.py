"""Causal-LM loss and held-out evaluation.

Validation loss is the true mean over held-out tokens: the sum of every predicted token's cross-entropy divided by
the number of predicted tokens. It is not a mean of per-batch means (wrong when the last batch is short) and not a
sum divided by `batches + 1` (what the GaLore pretraining script, arXiv 2403.03507, reports). Perplexity is
`exp(loss)`. Under torch.distributed each rank scores its share of the blocks and the sums are all-reduced, so
every rank gets the same figure.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

__all__ = ["lm_loss", "evaluate"]


def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a causal LM on packed blocks.

    input_ids: [batch, seq_len] token ids; position t predicts token t + 1, so each block yields seq_len - 1
    predictions. The logits are upcast to fp32 before the softmax so bf16 runs score like fp32 ones.
    Returns a 0-D fp32 tensor: the mean or the sum over all predictions.
    """
    logits = model(input_ids=input_ids).logits  # [batch, seq_len, vocab]
    # Shift the targets rather than slicing the logits: a slice of the [batch, seq_len, vocab] logits would cost a
    # full-size zero fill and copy in backward. The last position has no next token and is ignored.
    target = F.pad(input_ids[:, 1:], (0, 1), value=-100)  # [batch, seq_len]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=-100,
                           reduction=reduction)


@torch.no_grad()
def evaluate(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int, device: torch.device | str = "cpu",
             autocast_dtype: torch.dtype | None = None, rank: int = 0, world_size: int = 1) -> dict:
    """Validation loss, perplexity and token count over `blocks`.

    blocks: [num_blocks, seq_len] held-out token ids. With `world_size > 1`, rank r scores blocks r, r + W, ...
    and the sums are all-reduced (torch.distributed must be initialised).
    """
    if blocks.dim() != 2 or blocks.size(1) < 2:
        raise ValueError(f"blocks must be [num_blocks, seq_len >= 2], got shape {tuple(blocks.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    mine = blocks[rank::world_size]
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    for start in range(0, mine.size(0), batch_size):
        x = mine[start:start + batch_size].to(device, non_blocking=True)
        with ctx:
            s = lm_loss(model, x, reduction="sum")
        total += s.double()
        count += x.size(0) * (x.size(1) - 1)
    if world_size > 1:
        import torch.distributed as dist
        both = torch.stack([total, count])
        dist.all_reduce(both)
        total, count = both[0], both[1]
    model.train(was_training)
    n = int(count.item())
    if n == 0:
        raise ValueError("no held-out tokens to evaluate on (the validation split is empty)")
    loss = total.item() / n
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": n}
