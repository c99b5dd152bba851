"""Next-token cross-entropy through the output layer without the full logits: slices of the vocabulary at a time.

The usual loss keeps the logits (tokens x vocabulary in bf16), their fp32 copy and its gradient: 8 bytes per token
and vocabulary entry, 2 GiB for 2048 tokens of LLaMA-3's 128,256-entry vocabulary, more than an int8 LLaMA-3-8B's
layers need. Here the forward pass computes each slice's logits, folds them into a running log-sum-exp and drops
them; the backward pass recomputes each slice, forms its softmax gradient from the saved log-sum-exp and takes the
output weight's gradient for those rows in one product (as precise as the usual one) and its part of the hidden
states' gradient, summed in fp32 (tokens x hidden: small). The peak holds one slice: tokens x slice x 8 bytes.
Where the output weight's master lives elsewhere (``MasterWeights``: a row route, ``weights/row_grads.py``), each
slice's rows of its gradient are handed over as they are made instead of filling a (V, h) gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimopt.weights.row_grads import route_of

__all__ = ["IGNORE", "linear_cross_entropy", "causal_lm_loss"]

IGNORE = -100  # a target that scores nothing (the last position of a packed block)


class _LinearCrossEntropy(torch.autograd.Function):
    """mean over targets != IGNORE of logsumexp(h W^T) - (h W^T)[target], W's rows taken `slice_rows` at a time."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, slice_rows: int) -> Tensor:
        # hidden: (N, h) compute dtype; weight: (V, h); target: (N,) int64
        route = route_of(weight)
        if route is not None:
            route.ready()  # an update of the weight still in flight lands first
        n, vocab = hidden.shape[0], weight.shape[0]
        running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        running_sum = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # the target's logit
        valid = target != IGNORE
        for start in range(0, vocab, slice_rows):
            stop = min(start + slice_rows, vocab)
            logits = (hidden @ weight[start:stop].t()).float()  # (N, slice)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            running_sum = running_sum * torch.exp(running_max - new_max) + \
                torch.exp(logits - new_max[:, None]).sum(dim=1)
            running_max = new_max
            inside, column = _in_slice(target, valid, start, stop)
            picked += torch.where(inside, logits.gather(1, column).squeeze(1), 0.0)
        lse = running_max + torch.log(running_sum)  # (N,)
        count = valid.sum().clamp_min(1)
        ctx.save_for_backward(hidden, weight, target, lse, count)
        ctx.slice_rows = slice_rows
        return ((lse - picked) * valid).sum() / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, target, lse, count = ctx.saved_tensors
        valid = target != IGNORE
        per_token = (grad_loss.float() / count) * valid  # (N,) the loss's weight on each target
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        route = route_of(weight) if ctx.needs_input_grad[1] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] and route is None else None
        for start in range(0, weight.shape[0], ctx.slice_rows):
            stop = min(start + ctx.slice_rows, weight.shape[0])
            logits = (hidden @ weight[start:stop].t()).float()
            grad_logits = torch.exp(logits - lse[:, None])  # softmax, (N, slice)
            inside, column = _in_slice(target, valid, start, stop)
            grad_logits.scatter_add_(1, column, -inside.to(torch.float32)[:, None])  # -1 at the target, -0.0 elsewhere
            grad_logits = (grad_logits * per_token[:, None]).to(hidden.dtype)
            grad_hidden += (grad_logits @ weight[start:stop]).float()
            if route is not None:  # this slice's rows leave now; the device never holds the whole gradient
                route.rows(start, grad_logits.t() @ hidden)
            elif grad_weight is not None:
                grad_weight[start:stop] = grad_logits.t() @ hidden
        if route is not None:
            route.done()
        return grad_hidden.to(hidden.dtype), grad_weight, None, None


def _in_slice(target: Tensor, valid: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Which targets fall in vocabulary rows [start, stop), and each one's column in the slice (N, 1) (a target
    elsewhere points at column 0 and is masked): tensor ops only, so no host sync a slice."""
    inside = valid & (target >= start) & (target < stop)
    return inside, (target - start).clamp_(0, stop - start - 1)[:, None]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, slice_rows: int = 8192) -> Tensor:
    """Mean cross-entropy of logits ``hidden @ weight.T`` against `target` (IGNORE: not scored), computed a
    vocabulary slice of `slice_rows` rows at a time. hidden (..., h), weight (V, h), target (...) int64; returns a
    0-d fp32 tensor."""
    if isinstance(slice_rows, bool) or not isinstance(slice_rows, int) or slice_rows < 1:
        raise ValueError(f"slice_rows must be an integer >= 1, got {slice_rows!r}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} do not pair up")
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), slice_rows)


def causal_lm_loss(model: torch.nn.Module, input_ids: Tensor, slice_rows: int = 8192) -> Tensor:
    """Next-token cross-entropy of a Hugging Face causal LM (its body, then ``linear_cross_entropy`` through its
    output layer) on packed blocks: the mean over every position but each block's last, like ``lm_loss``."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"the vocabulary-sliced loss needs an output layer that is a bias-free nn.Linear; "
                         f"{type(model).__name__} has {type(head).__name__}")
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise ValueError(f"{type(model).__name__} scales its logits; the vocabulary-sliced loss does not")
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=input_ids).last_hidden_state  # (batch, seq, h)
    target = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE)
    return linear_cross_entropy(hidden, head.weight, target, slice_rows)
