"""Atomic writes: a file or folder is whole under its name, or absent, or the previous version; never half.

Every site that writes a checkpoint, a cache entry, a result table or a log goes through here: the new content
is written under a temporary name in the same folder (a rename across file systems is not atomic), fsync-ed,
renamed over the target with ``os.replace`` (atomic on POSIX), and the folder is fsync-ed so that the rename
survives a power cut. An error or an interrupt before the rename removes the temporary and leaves the target as
it was. Standard library only, so that any layer may import it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_file", "write_atomic", "atomic_dir", "replace_dir", "fsync_dir"]


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync `folder` so that a rename into it survives a power cut."""
    # Some file systems do not allow opening a folder, which is harmless: the rename is atomic all the same.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path, suffix: str) -> Path:
    # Hidden, next to the target, and unique, so that concurrent writers (ranks, parallel runs) never share one.
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a fresh, empty temporary file next to `path` for the caller (or a compiler) to write; when the block
    ends without an exception, fsync it and rename it over `path`. An exception removes it and leaves `path` as
    it was. The file is created with the usual permissions (0666 less the umask), as `open` would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _temp_name(path, suffix)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """``with atomic_file(path, "w") as f: f.write(...)``: `f` writes a temporary file that replaces `path` when
    the block ends without an exception. `mode` is "w" or "wb"; `open_kwargs` go to `open` (encoding, newline);
    text defaults to UTF-8."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes a whole file: mode 'w' or 'wb', got {mode!r}")
    if mode == "w":
        open_kwargs.setdefault("encoding", "utf-8")
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f
        f.flush()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path` atomically; return the path."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)


def replace_dir(staged: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete folder `staged` to `final`, replacing a previous `final`, which stays whole until the
    new one is in place: it is renamed aside first and removed only after the rename of `staged`."""
    staged, final = Path(staged), Path(final)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh, empty temporary folder next to `path`; when the block ends without an exception, rename it
    to `path`. An exception removes it. With `replace`, a previous `path` is replaced (``replace_dir``); without,
    the rename raises FileExistsError when `path` exists and is not an empty folder (another process finished
    first), and the temporary folder is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _temp_name(path, ".tmp")
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if replace:
            replace_dir(tmp, path)
        else:
            try:
                os.rename(tmp, path)  # replaces only an empty folder
            except OSError as err:
                raise FileExistsError(f"{path} already exists") from err
            fsync_dir(path.parent)
    except BaseException:
        _remove(tmp)
        raise
