"""nn.Linear with its weight held on the device as int8 codes and fp32 scales (optim/algorithm/int8_weight.py).

The weight is dequantized to the input's dtype for each matmul, in the forward pass and again in the backward
pass, and never kept wider: a LLaMA-7B body then holds about 1 byte a weight instead of 2. The trainable copy, the
master, is not a parameter of the module (it lives where the optimizer steps it, on the host for issue 46's
offload): the backward pass hands the weight's gradient to the module's sink, by default added into
``master.grad``. Biases stay ordinary parameters in their dtype. The memory plan: docs/modules.md, section
slimopt.bench.planner.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import increment_version
from torch.utils.hooks import RemovableHandle

from slimopt.optim.algorithm import int8_weight
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.routes.cpu import native

__all__ = ["Int8Linear"]


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
                module: "Int8Linear") -> Tensor:
        ctx.save_for_backward(x, codes, scale)
        ctx.module = module
        return F.linear(x, int8_weight.dequantize(codes, scale, module.group, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, codes, scale = ctx.saved_tensors
        module: Int8Linear = ctx.module
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


class Int8Linear(nn.Module):
    """A Linear layer whose weight is ``weight_codes`` (out, in) int8 and ``weight_scale`` (out, groups) fp32
    buffers; ``group`` 0 gives one scale a row. ``master``: the trainable weight (out, in), not registered (the
    module's ``.to()`` leaves it where it is); ``grad_sink``: called with each weight gradient the backward pass
    makes, instead of adding it into ``master.grad``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = int8_weight.check_group(group)
        groups = int8_weight.group_count(in_features, group)
        self.register_buffer("weight_codes", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.grad_sink: Callable[[Tensor], None] | None = None
        object.__setattr__(self, "_master", None)  # bypasses nn.Module's registration on purpose
        object.__setattr__(self, "_token", None)
        self._token_hooks: dict[int, Callable[[Tensor], None]] = OrderedDict()  # weak-referenceable

    @property
    def master(self) -> nn.Parameter | None:
        return self._master

    def set_master(self, value: nn.Parameter | None) -> None:
        """Attach the trainable copy (out, in) without registering it (nn.Module would take a Parameter
        assigned to an attribute for one of its own)."""
        if value is not None and tuple(value.shape) != (self.out_features, self.in_features):
            raise ValueError(f"master of shape {tuple(value.shape)} for an Int8Linear of weight shape "
                             f"{(self.out_features, self.in_features)}")
        object.__setattr__(self, "_master", value)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = 0, master_dtype: torch.dtype = torch.float32,
                    master_device: torch.device | str = "cpu") -> "Int8Linear":
        """The int8 form of `linear` on its device, with a master copy of its weight (`master_dtype` on
        `master_device`; pinned when that is the CPU and a CUDA device exists, for asynchronous copies; on the
        meta device, a master that holds nothing, for weights stepped in place)."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group, w.device, w.dtype)
        if linear.bias is not None:
            layer.bias = linear.bias
        master = w.to(device=master_device, dtype=master_dtype, copy=True)
        if master.device.type == "cpu" and torch.cuda.is_available():
            master = master.pin_memory()
        layer.set_master(nn.Parameter(master, requires_grad=linear.weight.requires_grad))
        layer.load_weight(w if master.device.type == "meta" else master)  # the codes are the master's rounding
        return layer

    @torch.no_grad()
    def load_weight(self, weight: Tensor, noise: CounterStream | None = None) -> None:
        """Write `weight` (out, in), any float dtype and device, as this layer's codes and scales (nearest
        rounding, or stochastic from `noise`). Rounded where the weight is (a host master: the host), so only the
        int8 codes and the scales cross to the layer's device."""
        if weight.device.type == "cpu":  # the C kernel's writer (the same bytes), straight into CPU buffers
            codes, scale = self.host_buffers()
            if native.quantize_int8(weight.detach().contiguous(), self.group, noise, codes, scale):
                self.publish(codes, scale)
                return
        codes, scale = int8_weight.quantize(weight, self.group, noise=noise)
        self.weight_codes.copy_(codes)
        self.weight_scale.copy_(scale)

    def host_buffers(self) -> tuple[Tensor, Tensor]:
        """Where a writer on the host puts this layer's codes and scales: the layer's own buffers on a CPU, new
        host tensors for another device (``publish`` copies them there)."""
        if self.weight_codes.device.type == "cpu":
            return self.weight_codes, self.weight_scale
        return (torch.empty(self.weight_codes.shape, dtype=torch.int8),
                torch.empty(self.weight_scale.shape, dtype=torch.float32))

    @torch.no_grad()
    def publish(self, codes: Tensor, scale: Tensor) -> None:
        """Make the codes and scales a host writer put into ``host_buffers``' tensors this layer's weight."""
        if codes is self.weight_codes:  # written through a pointer: tell autograd, as copy_ would, that they changed
            increment_version(self.weight_codes)
            increment_version(self.weight_scale)
        else:
            self.weight_codes.copy_(codes)
            self.weight_scale.copy_(scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the layer computes with, dequantized to `dtype` (a new tensor)."""
        return int8_weight.dequantize(self.weight_codes, self.weight_scale, self.group, dtype)

    def deliver(self, grad: Tensor) -> None:
        """Hand one weight gradient (out, in) to the sink, or add it into ``master.grad`` on the master's device
        and dtype."""
        if self.grad_sink is not None:
            self.grad_sink(grad)
            return
        master = self.master
        grad = grad.to(device=master.device, dtype=master.dtype)
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)

    def forward(self, x: Tensor) -> Tensor:
        return _Int8Matmul.apply(x, self.weight_codes, self.weight_scale, self.bias, self.grad_token(), self)

    def grad_token(self) -> Tensor | None:
        """The layer's token on its device (created on first use; None while the master needs no gradient). A
        post-accumulate-grad hook on it runs when this layer's weight gradient is complete."""
        master = self.master
        if master is None or not master.requires_grad:
            return None
        token = self._token
        if token is None or token.device != self.weight_codes.device:
            token = torch.zeros((), dtype=torch.float32, device=self.weight_codes.device, requires_grad=True)
            token.register_post_accumulate_grad_hook(self._grad_complete)
            object.__setattr__(self, "_token", token)
        return token

    def _grad_complete(self, token: Tensor) -> None:
        token.grad = None
        for hook in list(self._token_hooks.values()):
            hook(token)

    def on_grad_complete(self, hook: Callable[[Tensor], None]) -> RemovableHandle:
        """Call hook(token) each time the backward pass has delivered every gradient of this layer's weight;
        the handle's ``remove()`` takes it off."""
        handle = RemovableHandle(self._token_hooks)
        self._token_hooks[handle.id] = hook
        return handle

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group={self.group}")
