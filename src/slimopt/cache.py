"""The one root of slimopt's on-disk caches (tokenizers, packed data, the converted SmolLM2, the C kernel).

One function, so that every cache honours the same settings: the caller's folder, else ``$SLIMOPT_CACHE``, else
``$XDG_CACHE_HOME/slimopt``, else ``~/.cache/slimopt``. Standard library only, so that any layer may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Root of slimopt's on-disk caches: `cache_dir`, else $SLIMOPT_CACHE, else $XDG_CACHE_HOME/slimopt, else
    ~/.cache/slimopt."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SLIMOPT_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "slimopt"
