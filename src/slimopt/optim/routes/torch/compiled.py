"""A torch.compile'd AdamW step for full-space parameters: decode, update in fp32, encode and write back in one
fused pass.

The eager step (``windowed.py``, ``reference.py``) stays the reference; this one must equal it
(tests/test_compiled.py). Every hyperparameter reaches the compiled function as a 0-D tensor, so a learning-rate
schedule, or the bias corrections changing every step, never trigger a recompile: the graph depends only on the
parameter's shape and dtype and on the two codecs (torchao/optim does the same).

Used for groups with ``compile=True`` where the rule is ``adamw``, the parameter is updated in full space
(projector ``none``) and neither codec draws random numbers (stochastic rounding needs a
generator per call, which would break the graph).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor

from slimopt.optim.routes import abi


def supported(codecs: list[tuple[str, Any]]) -> bool:
    return not any(codec.needs_generator for _, codec in codecs)


@functools.lru_cache(maxsize=None)
def _kernel(m_codec: Any, v_codec: Any, shape: torch.Size) -> Callable[..., None]:
    def adamw_step(p: Tensor, g: Tensor, state: dict[str, Tensor], lr: Tensor, beta1: Tensor, beta2: Tensor,
                   eps_before: Tensor, eps: Tensor, wd: Tensor, bias1: Tensor, bias2_sqrt: Tensor) -> None:
        # p: parameter (shape, any float dtype); g: fp32 gradient (shape); state: the codecs' tensors
        m = m_codec.decode("exp_avg", state, shape)
        v = v_codec.decode("exp_avg_sq", state, shape)
        m = m + (1 - beta1) * (g - m)
        v = v * beta2 + (1 - beta2) * g * g
        # one of eps_before (eps_placement "galore") and eps ("torch") is 0: adding 0 is exact, so both
        # placements share this graph and round as the eager path (rules.direction) does
        denom = (v.sqrt() + eps_before) / bias2_sqrt + eps
        new_p = p.float() * (1 - lr * wd) - (lr / bias1) * (m / denom)
        p.copy_(new_p)
        m_codec.encode("exp_avg", m, state)
        v_codec.encode("exp_avg_sq", v, state)

    return torch.compile(adamw_step, dynamic=False)


def adamw_step(p: Tensor, g: Tensor, state: dict[str, Tensor], codecs: list[tuple[str, Any]], group: dict[str, Any],
               age: int) -> None:
    """One fused AdamW step of p (in place) with moments stored by `codecs` (age: the moments' step count)."""
    r = abi.scalars(group, age)
    dev = p.device
    t = lambda x: torch.as_tensor(float(x), dtype=torch.float32, device=dev)  # noqa: E731
    state_tensors = {k: v for k, v in state.items() if k not in ("step", "moment_step")}
    _kernel(codecs[0][1], codecs[1][1], p.shape)(
        p, g, state_tensors, t(r.lr), t(r.beta1), t(r.beta2), t(r.eps if r.eps_before else 0.0),
        t(0.0 if r.eps_before else r.eps), t(r.weight_decay), t(r.bias1), t(r.bias2_sqrt))
