"""Save and load a model with its SlimOptimizer through ``torch.distributed.checkpoint`` (DCP), at any world size.

``save(path, model, optimizer)`` writes a DCP checkpoint folder from FSDP2 ranks or from one process;
``load(path, model, optimizer)`` reads it into a model sharded over any number of ranks, or into one process.
Both go through ``get_model_state_dict`` / ``get_optimizer_state_dict`` and their ``set_*`` twins
(``torch.distributed.checkpoint.state_dict``), so the FQN mapping and the sharded model state are torch's; the
optimizer state is in slimopt's portable form (``portable.py``), which DCP reshards.

Details: docs/modules.md, ``slimopt.optim.distributed.distcheckpoint``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from slimopt.optim.distributed import portable
from slimopt.optim.distributed import sharded as S

__all__ = ["save", "load", "load_template", "saved_state_template", "fill_empty_state",
           "read_metadata"]


def fill_empty_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state ``step = 0`` (the same as no state for SlimOptimizer), so that a
    state-dict helper finds the optimizer initialised and skips its zero-gradient step (which would take GaLore's
    first subspace from a zero gradient)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32)


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> None:
    """Write model, optimizer (portable form) and `extra` to the DCP folder `path` (every rank calls it)."""
    fill_empty_state(optimizer)
    with portable.portable_state(optimizer):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if extra:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=os.fspath(path))


def _damaged(path: str | os.PathLike, what: str) -> ValueError:
    return ValueError(f"checkpoint folder {path} is damaged or incomplete ({what}), so it cannot be loaded: put back "
                      f"a copy of it if you keep one, or start over (slimopt train: --overwrite)")


def read_metadata(path: str | os.PathLike):
    """The DCP metadata of the folder `path`, once every file it names is there with all its bytes (a ValueError
    naming the folder otherwise: DCP itself would fail mid-load, with a traceback per rank)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}")
    if not (folder / ".metadata").is_file():
        raise _damaged(folder, "it has no .metadata file")
    try:
        metadata = dcp.FileSystemReader(os.fspath(folder)).read_metadata()
    except Exception as e:  # a pickle cut short or overwritten fails in many ways (EOFError, UnpicklingError, ...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise _damaged(folder, f"its .metadata does not read: {type(e).__name__}: {first}") from e
    ends: dict[str, int] = {}  # file -> the end of its last saved item
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            raise _damaged(folder, f"{name} is missing")
        size = file.stat().st_size
        if size < end:
            raise _damaged(folder, f"{name} holds {size:,} of its {end:,} bytes")
    return metadata


def load_template(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state dict to load `path` into: every saved optimizer tensor, as this process lays it out."""
    metadata = read_metadata(path).state_dict_metadata
    fill_empty_state(optimizer)
    with portable.portable_state(optimizer):
        osd = get_optimizer_state_dict(model, optimizer)
    fqns = [f for g in osd["param_groups"] for f in g["params"]]
    return {**osd, "state": saved_state_template(optimizer, fqns, metadata, "optim.state.")}


def saved_state_template(optimizer: torch.optim.Optimizer, fqns: list[str], metadata: dict[str, Any],
                         prefix: str) -> dict[str, dict[str, torch.Tensor]]:
    """fqn -> {key: an empty tensor} for every optimizer entry a DCP checkpoint holds under ``prefix + fqn + "."``
    (its ``state_dict_metadata``), laid out as this process needs it. `fqns` name the optimizer's parameters in
    order. The checkpoint, not the live state, is the template: a block method holds moments only for the blocks
    active when it was saved."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    owner = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    state = {}
    for fqn, p in zip(fqns, params):
        head = f"{prefix}{fqn}."
        entries = {}
        for name, meta in metadata.items():
            if not name.startswith(head) or "." in name[len(head):] or not hasattr(meta, "size"):
                continue
            key = name[len(head):]
            entries[key] = _empty_like_saved(optimizer, p, owner[id(p)], key, meta)
        if entries:
            state[fqn] = entries
    return state


def _empty_like_saved(optimizer, p, group, key: str, meta) -> torch.Tensor:
    """An uninitialised tensor for one saved entry: sharded like p for a row-layout key (p's rows, or rows split over
    its ranks alike: a right basis's, a left projection's subspace's), else whole."""
    dtype = meta.properties.dtype
    size = tuple(meta.size)
    device = p.to_local().device if S.is_sharded(p) else p.device
    if key == "step" or key == "moment_step":
        device = torch.device("cpu")
    layout = portable.layout_of(optimizer, p, group, key) if S.is_sharded(p) else "replicated"
    if layout in ("rows", "chunks", "columns"):  # the parameter's rows, or rows or columns split alike (a right
        # basis, a left subspace, TACO's history)
        dim = int(layout == "columns")
        rows = S.rows_of(p) if layout == "rows" else S.chunks_of(S.rows_of(p), size[dim])
        local = torch.empty(size[:dim] + (rows.local,) + size[dim + 1:], dtype=dtype, device=device)
        return portable._param_rows_tensor(local, p, rows, dim)
    return torch.empty(size, dtype=dtype, device=device)


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load `path` (written by ``save`` at any world size) into `model` and `optimizer` (every rank calls it).

    extra: a template of the extra state to read (values of the right types, tensors of the right shapes), or
    None. Returns the loaded extra state (or None).
    """
    model_state = get_model_state_dict(model)
    state: dict[str, Any] = {"model": model_state, "optim": load_template(path, model, optimizer)}
    if extra is not None:
        state["extra"] = extra
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return state.get("extra")
