"""Will the host hold the run? The host bytes that int8 weights or a host master need, planned before the first
step, against the memory this machine has free; a run that would not fit stops with one line naming the setting
that does.

The figures are the planner's (``slimopt memory --weights int8 --offload host``): with a host master, the master
copy, the optimizer state and projections, the pinned gradient and weight buffers and the step's temporaries; when
the device is the CPU, the device's part (weights, gradients, activations) is host memory too.
``SLIMOPT_HOST_BYTES`` (e.g. ``8GiB``) stands in for the memory this machine has free.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["HOST_BYTES_ENV", "available_host_bytes", "check_host_memory", "host_bytes_needed"]

HOST_BYTES_ENV = "SLIMOPT_HOST_BYTES"
_SMALL_STATE = ("ternary_adamw", "adamw8bit", "frugal_head")  # tried in this order for a method that fits


def available_host_bytes() -> int | None:
    """The host bytes a run may take: ``$SLIMOPT_HOST_BYTES`` when set, else MemAvailable of /proc/meminfo,
    else psutil's figure; None when none of them is known."""
    from slimopt.bench.units import parse_size

    given = os.environ.get(HOST_BYTES_ENV)
    if given:
        return parse_size(given, HOST_BYTES_ENV)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def host_bytes_needed(model: nn.Module, method: str, settings: dict[str, Any], *, weights: str, offload: str,
                      master: str, int8_group: int, batch: int, seq: int, device: torch.device,
                      vocab_slice: int = 0, int8_embeddings: bool = False) -> int:
    """The planned host bytes of a run of `method` (with `settings`) on `model` (its config, planned on the meta
    device): the planner's host part with ``offload="host"``, plus its device part when `device` is the CPU."""
    from slimopt.bench import planner

    dtype = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    prep = planner.prepare(_meta_twin(model, dtype), method, dtype=dtype, config=model.config,
                           weight_format=weights, offload=offload, master=master if offload == "host" else None,
                           int8_group=int8_group, int8_embeddings=int8_embeddings, vocab_slice=vocab_slice,
                           **settings)
    plan = prep.plan(batch, seq)
    return plan.host + (plan.peak if device.type == "cpu" else 0)


def _meta_twin(model: nn.Module, dtype: str) -> nn.Module:
    """`model`'s architecture on the meta device (its own class from its config: a classifier stays one), in
    `dtype`; a model that is not a transformers one, as the planner builds its config."""
    from slimopt.bench import planner

    build = getattr(type(model), "_from_config", None)
    if build is None:
        return planner.meta_model(model.config, dtype)
    with torch.device("meta"):
        twin = build(model.config)
    return twin.to(planner._dtype(dtype))


def check_host_memory(model: nn.Module, method: str, settings: dict[str, Any], *, weights: str, offload: str,
                      master: str, int8_group: int, batch: int, seq: int, device: torch.device,
                      vocab_slice: int = 0, int8_embeddings: bool = False) -> None:
    """Raise ValueError, one line, when the planned host bytes exceed those available: needed, available and
    the first of a smaller --master, a smaller-state --method, --offload none that fits. Nothing to check with the
    weights in their dtype and no offload, or with device-only int8 weights on a GPU (no host part)."""
    if (weights == "dtype" and offload == "none") or (offload == "none" and device.type != "cpu"):
        return
    available = available_host_bytes()
    if available is None:
        return
    plan = {"weights": weights, "offload": offload, "master": master, "int8_group": int8_group, "batch": batch,
            "seq": seq, "device": device, "vocab_slice": vocab_slice, "int8_embeddings": int8_embeddings}
    needed = host_bytes_needed(model, method, settings, **plan)
    if needed <= available:
        return
    source = f" (${HOST_BYTES_ENV})" if os.environ.get(HOST_BYTES_ENV) else ""
    fits = _fitting_setting(model, method, settings, plan, available)
    hint = f"{fits[0]} needs {_gib(fits[1])} and fits" if fits else "no smaller setting fits: use a larger machine"
    raise ValueError(f"host memory: this run needs {_gib(needed)} (master, optimizer state and step temporaries"
                     f"{', with the model and activations on the CPU' if device.type == 'cpu' else ''}), "
                     f"{_gib(available)} available{source}; {hint}")


def _fitting_setting(model: nn.Module, method: str, settings: dict[str, Any], plan: dict[str, Any],
                     available: int) -> tuple[str, int] | None:
    """(the option that changes, its planned host bytes) of the first setting that fits, or None."""
    tries: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
    if plan["offload"] == "host":  # the smaller masters, largest first
        from slimopt.bench.planner import MASTERS
        smaller = [m for m in sorted(MASTERS, key=MASTERS.get, reverse=True) if MASTERS[m] < MASTERS[plan["master"]]]
        tries += [(f"--master {m}", method, settings, {**plan, "master": m}) for m in smaller]
    tries += [(f"--method {m}", m, {}, plan) for m in _SMALL_STATE if m != method]
    if plan["offload"] == "host":
        tries.append(("--offload none", method, settings, {**plan, "offload": "none"}))
    for option, m, s, p in tries:
        need = 0 if p["offload"] == "none" and p["device"].type != "cpu" else \
            host_bytes_needed(model, m, s, **p)
        if need <= available:
            return option, need
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
