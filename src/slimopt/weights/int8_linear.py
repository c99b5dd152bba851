"""nn.Linear with its weight held on the device as int8 codes and fp32 scales (optim/algorithm/int8_weight.py).

The weight is dequantized to the input's dtype for each matmul, in the forward pass and again in the backward
pass, and never kept wider: a LLaMA-7B body then holds about 1 byte a weight instead of 2. The master copy, the
gradient's sink and its token: ``Int8Weight`` (int8_layer.py). Biases stay ordinary parameters in their dtype.
The memory plan: docs/modules.md, section slimopt.bench.planner.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from slimopt.optim.algorithm import int8_weight
from slimopt.weights.int8_layer import Int8Weight

__all__ = ["Int8Linear", "Int8TiedLinear"]


class _Int8Matmul(torch.autograd.Function):
    """y = x W^T + b with W dequantized from its codes in each pass. Only x (as nn.Linear saves it) and the codes
    and scales (already held) are kept for the backward pass. The weight's gradient is delivered to the module,
    not returned: autograd would copy it to the master's device on the backward pass's thread. In its place the
    layer's token (a scalar leaf on the device) gets a zero gradient, so that the output requires grad whenever
    the master does (a first layer on inputs that do not) and the token's AccumulateGrad runs once, after every
    use of the layer in the backward pass (re-entrant calls, recomputed checkpoints): the moment its weight's
    gradient is complete."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None, token: Tensor | None,
                module: Int8Weight) -> Tensor:
        ctx.save_for_backward(x, codes, scale)
        ctx.module = module
        return F.linear(x, int8_weight.dequantize(codes, scale, module.group, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, codes, scale = ctx.saved_tensors
        module: Int8Weight = ctx.module  # Int8Linear, or the table an Int8TiedLinear computes with
        flat_out = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ int8_weight.dequantize(codes, scale, module.group, grad_out.dtype)
        grad_token = None
        if ctx.needs_input_grad[4]:
            module.deliver(flat_out.t() @ x.reshape(-1, x.shape[-1]))  # (out, in) in the compute dtype
            grad_token = torch.zeros((), dtype=torch.float32, device=grad_out.device)
        if ctx.needs_input_grad[3]:
            grad_b = flat_out.sum(0)
        return grad_x, None, None, grad_b, grad_token, None


class Int8Linear(Int8Weight):
    """A Linear layer whose weight (out, in) is held as int8 codes and scales (``Int8Weight``; ``group`` 0: one
    scale a row)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(out_features, in_features, group, device)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = 0, master_dtype: torch.dtype = torch.float32,
                    master_device: torch.device | str = "cpu") -> Int8Linear:
        """The int8 form of `linear` on its device, with a master copy of its weight (``Int8Weight.take_weight``)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, w.device, w.dtype)
        if linear.bias is not None:
            layer.bias = linear.bias
        layer.take_weight(w, master_dtype, master_device)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return _Int8Matmul.apply(x, self.weight_codes, self.weight_scale, self.bias, self.grad_token(), self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group={self.group}")


class Int8TiedLinear(nn.Module):
    """An output layer tied to an int8 embedding table (as SmolLM2 ties them): y = x W^T (+ b) with W the table
    ``owner`` holds (an ``Int8Weight`` of shape (vocabulary, hidden)), dequantized in each pass as ``Int8Linear``
    does. Its weight gradient goes to the owner's sink beside the embedding's, and the owner's token, which both
    uses pass, completes once both parts are in. The owner is not a submodule: the table, its master and its
    place in the state dict stay the embedding's."""

    def __init__(self, owner: Int8Weight, bias: nn.Parameter | None = None):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.out_features, self.in_features = owner.weight_codes.shape
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        owner = self.owner
        return _Int8Matmul.apply(x, owner.weight_codes, owner.weight_scale, self.bias, owner.grad_token(), owner)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tied to the int8 embedding table")
