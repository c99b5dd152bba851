"""FSDP2 for `slimopt train --fsdp`: sharding the model, micro-batches, evaluation and resumable checkpoints.

With ``--fsdp`` every decoder layer and the root module are wrapped by ``torch.distributed.fsdp.fully_shard``:
parameters, gradients and the slimopt optimizer state are sharded over the ranks (``slimopt.optim.distributed.sharded``
steps them). Run it under torchrun (``torchrun --nproc_per_node N -m slimopt train --fsdp ...``), or as one
plain process, which shards over a group of one (the CUDA path on a single GPU).

Details: docs/modules.md, ``slimopt.train.fsdp``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from slimopt.atomic import replace_dir
from slimopt.train.checkpoint import load_checkpoint
from slimopt.train.process_group import init_process_group, launched

__all__ = ["CHECKPOINT_DIR", "ensure_process_group", "shard_model", "no_sync", "find_checkpoint", "save",
           "read_train_state", "load", "full_model_state_dict", "check_method"]

CHECKPOINT_DIR = "checkpoint.dcp"


def check_method(kind: str, method: str) -> None:
    """--fsdp steps slimopt methods (their optimizer knows DTensors); raise ValueError for the others."""
    if kind != "slimopt":
        raise ValueError(f"--fsdp supports slimopt methods (`slimopt methods`); {method!r} is a {kind}, run it "
                         f"without --fsdp (DDP under torchrun)")


def ensure_process_group(device: torch.device) -> bool:
    """Initialise a one-process group when none exists (a plain `slimopt train --fsdp`, or torchrun at one rank,
    whose rendezvous it joins); True if done here."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched():
        init_process_group(backend)  # env://, the launcher's store
        return True
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """fully_shard every decoder layer (``model.model.layers``) and then the root, over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Accumulate gradients locally for this backward (FSDP2's set_requires_gradient_sync)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


def find_checkpoint(out: str | os.PathLike) -> Path | None:
    """The complete checkpoint folder of the run in `out`, or None."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".old"):
        path = Path(out) / name
        if (path / ".metadata").is_file() and (path / "train_state.pt").is_file():
            return path
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(out: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], rng: dict[str, Any]) -> Path:
    """Write a checkpoint of the run into `out` (every rank calls it; atomic, see the module docstring).

    train_state: the position of the run (the same on every rank; tensors, numbers, strings and containers);
    rng: this rank's RNG state (``slimopt.train.checkpoint.rng_state``)."""
    from slimopt.optim.distributed import distcheckpoint
    out = Path(out)
    final, tmp = out / CHECKPOINT_DIR, out / (CHECKPOINT_DIR + ".tmp")  # replace_dir keeps the old as .old
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    distcheckpoint.save(tmp, model, optimizer)
    torch.save(rng, tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save(train_state, tmp / "train_state.pt")
    _barrier()
    if _rank() == 0:
        replace_dir(tmp, final)  # the previous checkpoint stays whole (renamed aside) until the new one is in place
    _barrier()
    return final


def read_train_state(path: str | os.PathLike) -> dict[str, Any]:
    """The run's position saved with a checkpoint folder (cheap: read before loading any shard). A damaged or
    incomplete file raises CheckpointError, one line naming it (``slimopt.train.checkpoint.load_checkpoint``)."""
    return load_checkpoint(Path(path) / "train_state.pt")


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint folder into `model` and `optimizer` (any number of ranks); return this rank's RNG state
    (rank 0's when the checkpoint was written by fewer ranks)."""
    from slimopt.optim.distributed import distcheckpoint
    path = Path(path)
    rng_file = path / f"rng_rank{_rank()}.pt"
    # The RNG file first: a damaged one is refused in one line (CheckpointError) before any shard is loaded.
    rng = load_checkpoint(rng_file if rng_file.is_file() else path / "rng_rank0.pt")
    distcheckpoint.load(path, model, optimizer)
    return rng


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, gathered on every rank (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
