"""Atomic training checkpoints and the RNG snapshot that makes a resumed run identical to an unbroken one.

A checkpoint is written through ``slimopt.atomic`` (a temporary file in the same folder, fsync-ed, renamed over
the previous one, the folder fsync-ed): a process killed at any moment leaves either the old or the new checkpoint
complete, never a torn one.

Everything saved is tensors, numbers, strings and containers of them, so checkpoints load with
`torch.load(weights_only=True)`: loading a checkpoint never runs code from the file. A file that does not load says
why in one line (`CheckpointError`): damaged or incomplete (cut short by a full disk or a copy, overwritten), or
holding Python objects (written by an optimizer that keeps them in its state).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import signal
import threading
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from slimopt.atomic import atomic_file, fsync_dir

__all__ = [
    "CHECKPOINT_NAME", "CheckpointError", "save_atomic", "load_checkpoint", "find_checkpoint", "rng_state",
    "set_rng_state", "check_weights_only_safe", "fsync_dir",
]

CHECKPOINT_NAME = "checkpoint.pt"


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """Write `obj` with `torch.save` to `path` so that `path` is always either the old or the new file.

    A Ctrl-C during the write takes effect once the file is in place (a second one at once, the write abandoned):
    torch's zip writer, interrupted, raises an error of its own that hides the interrupt, and the run would stop
    with a traceback instead of naming the checkpoint it can resume from."""
    path = Path(path)
    with _interrupts_after():
        with atomic_file(path, "wb") as f:  # fsync-ed before the rename; an interrupted write removes its temporary
            torch.save(obj, f)
    return path


@contextlib.contextmanager
def _interrupts_after() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block until it ends, then raise KeyboardInterrupt; a second SIGINT
    raises at once. Only the main thread receives signals: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:  # None: a handler not set from Python, for which Python's own stands in
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, in one line: the file, what is wrong with it and what to do. A
    ValueError, so that ``slimopt train`` prints that line rather than a traceback (``slimopt.cli.main``)."""


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint file with `weights_only=True`: one written by `save_atomic`, or a torch.save file of an
    FSDP checkpoint folder (``train_state.pt``, ``rng_rank<r>.pt``; ``slimopt.train.fsdp``).

    A file that is damaged or incomplete, or that holds Python objects, raises CheckpointError; any other failure
    of a whole file (memory, device) is torch's own error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        refused = _refused_global(e)
        if refused is not None:
            raise CheckpointError(
                f"checkpoint {path} holds Python objects ({refused}), which torch.load(weights_only=True) refuses to "
                f"run: some peer optimizers, e.g. galore-torch and apollo-torch, keep projector objects in their "
                f"state; start the run over with --overwrite") from e
        damage = _damage(path)
        if damage is None:
            raise  # the archive is whole: torch's error is about something else
        raise CheckpointError(
            f"checkpoint {path} is damaged or incomplete ({damage}), so the run cannot resume from it: put back a "
            f"copy of it if you keep one (a run keeps only its last checkpoint), or start the run over with "
            f"--overwrite") from e


def _refused_global(err: Exception) -> str | None:
    """The Python global that a weights_only load refused (torch's message names it "GLOBAL module.Name"), or None:
    an unpickling error without one is a damaged file, not an object."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else None


def _damage(path: Path) -> str | None:
    """What is wrong with `path` as a torch.save archive (a zip whose every member passes its checksum), or None
    when it is whole, or when it cannot be read at all (torch's error says why, e.g. permissions)."""
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except OSError:
        return None
    if size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):  # a cut-short file has lost the zip's end record; garbage never had one
        return f"{size:,} bytes that do not end as a torch.save archive does"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        return f"its archive cannot be read: {e}"
    return None if bad is None else f"{bad} in its archive fails its checksum"


def find_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint of the run in `out_dir`, or None when there is none yet (leftover temp files are ignored)."""
    p = Path(out_dir) / CHECKPOINT_NAME
    return p if p.is_file() else None


def rng_state() -> dict:
    """Every random generator a training run may draw from: torch (CPU and each CUDA device), Python, NumPy."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": _to_plain(random.getstate()),
        # NumPy's state holds an ndarray, which weights_only refuses: store the key array as a tensor.
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def _to_plain(x):
    if isinstance(x, tuple):
        return [_to_plain(v) for v in x]
    return x


def _to_tuple(x):
    if isinstance(x, list):
        return tuple(_to_tuple(v) for v in x)
    return x


def check_weights_only_safe(obj: Any, where: str = "state") -> str | None:
    """Return a description of the first value `torch.load(weights_only=True)` would refuse, or None.

    Used before a run starts saving, so that an optimizer whose state holds Python objects is reported at once
    rather than at resume time.
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return None
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad = check_weights_only_safe(k, f"{where} key") or check_weights_only_safe(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            bad = check_weights_only_safe(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"
