"""Where a training run's checkpoint lives, and how it is written and read back, for a plain run and an FSDP2 one.

A plain run (one process, or DDP) writes one ``checkpoint.pt`` from rank 0 (``checkpoint.py``); an FSDP2 run writes a
DCP folder from every rank, its position in ``train_state.pt`` (``fsdp.py``). The training loop asks the same four
things of either: find the checkpoint, read its position (the step, the schedule, the settings it was made with),
restore the model and optimizer, and save; ``for_run`` picks the strategy once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from slimopt.train import checkpoint as ckpt
from slimopt.train import fsdp

__all__ = ["FileCheckpoint", "ShardedCheckpoint", "for_run", "last_step"]


class FileCheckpoint:
    """``out/checkpoint.pt``: the whole run in one weights_only file, written by rank 0 (``main``)."""

    def __init__(self, out: Path, main: bool) -> None:
        self.out, self.main = out, main

    def find(self) -> Path | None:
        return ckpt.find_checkpoint(self.out)

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        """The checkpoint's contents (the position with the model and optimizer in it)."""
        return ckpt.load_checkpoint(path, map_location=device)

    def step(self, path: Path) -> int:
        """The checkpoint's step, its tensors mapped from the file rather than read."""
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])

    def restore(self, path: Path, state: dict[str, Any], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> dict:
        """Load the model and optimizer; return the RNG state to set."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["rng"]

    def save(self, position: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        if self.main:
            ckpt.save_atomic({**position, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "rng": ckpt.rng_state(), **extra}, self.out / ckpt.CHECKPOINT_NAME)


class ShardedCheckpoint:
    """``out/checkpoint.dcp``: each rank's shards through torch.distributed.checkpoint (they reshard on load),
    the position beside them, one RNG file a rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def find(self) -> Path | None:
        return fsdp.find_checkpoint(self.out)

    def read(self, path: Path, device: torch.device) -> dict[str, Any]:
        """The position only: the shards are read after the settings check (``restore``)."""
        return fsdp.read_train_state(path)

    def step(self, path: Path) -> int:
        return int(fsdp.read_train_state(path)["step"])

    def restore(self, path: Path, state: dict[str, Any], model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> dict:
        return fsdp.load(path, model, optimizer)

    def save(self, position: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        fsdp.save(self.out, model, optimizer, position, ckpt.rng_state())  # every rank writes its shards


def for_run(out: str | None, sharded: bool, main: bool) -> FileCheckpoint | ShardedCheckpoint | None:
    """The strategy of a run writing into `out` (None: a run without an output folder keeps no checkpoint)."""
    if out is None:
        return None
    return ShardedCheckpoint(Path(out)) if sharded else FileCheckpoint(Path(out), main)


def last_step(out: str | os.PathLike) -> int | None:
    """The step of the checkpoint in a run's folder, plain or FSDP2, or None where none loads (a damaged one: a
    resume says how, naming the file)."""
    for strategy in (FileCheckpoint(Path(out), main=True), ShardedCheckpoint(Path(out))):
        found = strategy.find()
        if found is not None:
            try:
                return strategy.step(found)
            except Exception:
                return None
    return None
