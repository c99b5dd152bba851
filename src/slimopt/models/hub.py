"""The Hugging Face hub, reached or not: whether it can be reached, and loads that then stay local.

Every loader of a hub name (a model, a tokenizer, a dataset) asks here, so that an offline machine fails in a
second with one message naming where it looked, instead of retrying for a minute. Cached downloads stay in the
hub's own cache; slimopt's caches live under ``slimopt.cache.cache_root()``.

Details: docs/modules.md, ``slimopt.models``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

__all__ = ["hub_offline", "hub_calls_offline", "from_hub"]

T = TypeVar("T")


@functools.lru_cache(maxsize=1)
def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be reached, so loaders use only the local cache.

    Without this, an offline `from_pretrained` retries for about 50 s before failing. Honours HF_HUB_OFFLINE;
    behind a proxy the hub is assumed reachable (the local DNS lookup says nothing then).
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return True
    return False


@contextlib.contextmanager
def hub_calls_offline(offline: bool):
    """Make every Hugging Face hub lookup inside the block local-only when `offline`.

    `local_files_only=True` alone is not enough: transformers' adapter lookup in from_pretrained ignores it and
    retries the network; huggingface_hub's own offline flag covers all calls.
    """
    if not offline:
        yield
        return
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def from_hub(load: Callable[[bool], T], failure: Callable[[str, Exception], str], offline: bool | None = None) -> T:
    """``load(offline)`` with every hub call local-only when `offline` (default: ``hub_offline()``). An OSError or
    ValueError becomes a ValueError reading ``failure(where, err)``, `where` naming what was searched: the local
    cache when offline, else the hub."""
    offline = hub_offline() if offline is None else offline
    try:
        with hub_calls_offline(offline):
            return load(offline)
    except (OSError, ValueError) as err:
        where = "the local Hugging Face cache (the hub is unreachable)" if offline else "the Hugging Face hub"
        raise ValueError(failure(where, err)) from err
