"""What every module whose weight the device holds as int8 codes and fp32 scales shares (Int8Linear,
Int8Embedding; the format: optim/algorithm/int8_weight.py).

The trainable copy, the master, is not a parameter of the module: it lives where the optimizer steps it (on the
host for issue 46's offload, docs/offload.md). The backward pass hands each gradient of the weight to the module's
sink, by default added into ``master.grad``, and a token (a scalar leaf on the device) tells when every use of
the weight in a backward pass has delivered its part. The weight is written by ``load_weight`` (any tensor), or
by a writer on the host into ``host_buffers`` and then ``publish``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version
from torch.utils.hooks import RemovableHandle

from slimopt.optim.algorithm import int8_weight
from slimopt.optim.algorithm.noise import CounterStream
from slimopt.optim.routes.cpu import native

__all__ = ["Int8Weight"]


class Int8Weight(nn.Module):
    """A weight (rows, cols) held as buffers ``weight_codes`` (rows, cols) int8 and ``weight_scale`` (rows, groups)
    fp32 (``group`` 0: one scale a row). ``master``: the trainable weight, not registered (the module's ``.to()``
    leaves it where it is); ``grad_sink``: called with each weight gradient the backward pass makes, instead of
    adding it into ``master.grad``."""

    def __init__(self, rows: int, cols: int, group: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.group = int8_weight.check_group(group)
        groups = int8_weight.group_count(cols, group)
        self.register_buffer("weight_codes", torch.zeros(rows, cols, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.zeros(rows, groups, dtype=torch.float32, device=device))
        self.grad_sink: Callable[[Tensor], None] | None = None
        object.__setattr__(self, "_master", None)  # bypasses nn.Module's registration on purpose
        object.__setattr__(self, "_token", None)
        self._token_hooks: dict[int, Callable[[Tensor], None]] = OrderedDict()  # weak-referenceable

    @property
    def master(self) -> nn.Parameter | None:
        return self._master

    def set_master(self, value: nn.Parameter | None) -> None:
        """Attach the trainable copy (rows, cols) without registering it (nn.Module would take a Parameter
        assigned to an attribute for one of its own)."""
        if value is not None and value.shape != self.weight_codes.shape:
            raise ValueError(f"master of shape {tuple(value.shape)} for an {type(self).__name__} of weight shape "
                             f"{tuple(self.weight_codes.shape)}")
        object.__setattr__(self, "_master", value)

    def take_weight(self, weight: nn.Parameter, master_dtype: torch.dtype, master_device: torch.device | str) -> None:
        """Hold `weight` (rows, cols), the module's this one replaces: a master copy of it (`master_dtype` on
        `master_device`; pinned when that is the CPU and a CUDA device exists, for asynchronous copies; on the meta
        device, a master that holds nothing, for weights stepped in place) and the codes, its rounding."""
        w = weight.detach()
        master = w.to(device=master_device, dtype=master_dtype, copy=True)
        if master.device.type == "cpu" and torch.cuda.is_available():
            master = master.pin_memory()
        self.set_master(nn.Parameter(master, requires_grad=weight.requires_grad))
        self.load_weight(w if master.device.type == "meta" else master)

    @torch.no_grad()
    def load_weight(self, weight: Tensor, noise: CounterStream | None = None) -> None:
        """Write `weight` (rows, cols), any float dtype and device, as this module's codes and scales (nearest
        rounding, or stochastic from `noise`). Rounded where the weight is (a host master: the host), so only the
        int8 codes and the scales cross to the module's device."""
        if weight.device.type == "cpu":  # the C kernel's writer (the same bytes), straight into CPU buffers
            codes, scale = self.host_buffers()
            if native.quantize_int8(weight.detach().contiguous(), self.group, noise, codes, scale):
                self.publish(codes, scale)
                return
        codes, scale = int8_weight.quantize(weight, self.group, noise=noise)
        self.weight_codes.copy_(codes)
        self.weight_scale.copy_(scale)

    def host_buffers(self) -> tuple[Tensor, Tensor]:
        """Where a writer on the host puts this module's codes and scales: its own buffers on a CPU, new host
        tensors for another device (``publish`` copies them there)."""
        if self.weight_codes.device.type == "cpu":
            return self.weight_codes, self.weight_scale
        return (torch.empty(self.weight_codes.shape, dtype=torch.int8),
                torch.empty(self.weight_scale.shape, dtype=torch.float32))

    @torch.no_grad()
    def publish(self, codes: Tensor, scale: Tensor) -> None:
        """Make the codes and scales a host writer put into ``host_buffers``' tensors this module's weight."""
        if codes is self.weight_codes:  # written through a pointer: tell autograd, as copy_ would, that they changed
            increment_version(self.weight_codes)
            increment_version(self.weight_scale)
        else:
            self.weight_codes.copy_(codes)
            self.weight_scale.copy_(scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight the module computes with, dequantized to `dtype` (a new tensor)."""
        return int8_weight.dequantize(self.weight_codes, self.weight_scale, self.group, dtype)

    def deliver(self, grad: Tensor) -> None:
        """Hand one weight gradient (rows, cols) to the sink, or add it into ``master.grad`` on the master's device
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

    def grad_token(self) -> Tensor | None:
        """The module's token on its device (created on first use; None while the master needs no gradient). A
        post-accumulate-grad hook on it runs when this module's weight gradient is complete."""
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
        """Call hook(token) each time the backward pass has delivered every gradient of this module's weight;
        the handle's ``remove()`` takes it off."""
        handle = RemovableHandle(self._token_hooks)
        self._token_hooks[handle.id] = hook
        return handle
