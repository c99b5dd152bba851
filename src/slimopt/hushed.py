"""Quiet the libraries slimopt runs on. Importing this module installs ``peer_logs.hush()``.

For processes that begin by importing a list of modules before any code of ours runs: the forkserver of
``slimopt compare`` preloads torch, transformers (which imports torchao) and slimopt, and would print the peers'
load chatter that the command line filters everywhere else. It is first in that list.

``progress_bars_off()`` turns off the progress bars of transformers (model loading and saving), datasets and
huggingface_hub for the length of a block: what ``--no-progress`` promises, since those libraries draw their bars
whatever slimopt's own bar does.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from typing import Callable, Iterator

from slimopt import peer_logs

__all__ = ["progress_bars_off"]

peer_logs.hush()


@contextlib.contextmanager
def progress_bars_off() -> Iterator[None]:
    """No progress bar from transformers, datasets or huggingface_hub inside the block; each library's own setting
    comes back after it, so a process that calls slimopt keeps the bars it had. Libraries not installed are skipped.

    A library whose ``*_DISABLE_PROGRESS_BARS`` environment variable is set obeys that variable, as it documents.
    """
    undo: list[Callable[[], None]] = []
    # A library is imported here, not left for later: each reads its setting once, at import.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "environment variable ... has priority": the variable wins, quietly
        try:
            importlib.import_module("huggingface_hub.utils.tqdm")
            # the module, not the tqdm class that huggingface_hub.utils exports under the same name
            hub_states = sys.modules["huggingface_hub.utils.tqdm"].progress_bar_states
            saved = dict(hub_states)  # per-group settings too, which enable_progress_bars() would clear

            def restore_hub() -> None:
                hub_states.clear()
                hub_states.update(saved)

            undo.append(restore_hub)
            sys.modules["huggingface_hub.utils.tqdm"].disable_progress_bars()
        except (ImportError, AttributeError):
            pass
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            pass
        else:
            if hf_logging.is_progress_bar_enabled():
                undo.append(hf_logging.enable_progress_bar)
                hf_logging.disable_progress_bar()
        try:
            import datasets
        except ImportError:
            pass
        else:
            if not datasets.are_progress_bars_disabled():
                undo.append(datasets.enable_progress_bars)
                datasets.disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in reversed(undo):  # transformers' enable also enables the hub's: the hub's snapshot goes last
                step()
