"""Starting a process group so that ``destroy_process_group`` can free it.

``torch._dynamo``, imported after a default group exists (DDP's constructor imports it, and so do FSDP2 and
``torch.compile``), keeps references to that group that outlive ``destroy_process_group``: the group is never
freed, and its gloo worker threads run on into the interpreter's shutdown. A worker that then drops the last
reference to a finished collective's tensors takes the GIL of an interpreter that is finalizing, and the process
aborts at exit ("terminate called without an active exception", SIGABRT) after its work is done: about one
2-rank gloo run in twelve on a 2-core machine (torch 2.13). Imported first, dynamo holds no group, the group is
freed when destroyed, and its threads are joined.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = ["init_process_group", "launched"]

# what torchrun (and other env:// launchers) set for each worker
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """True when a launcher such as torchrun started this process, at any world size (one rank included).

    Such a process must join the launcher's rendezvous (env://): at one rank torchrun's agent hosts the store,
    and a group started on a port of its own would wait for a server nobody runs.
    """
    return all(k in os.environ for k in _LAUNCHER_ENV)


def init_process_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, ``torch._dynamo`` imported before it."""
    import torch._dynamo  # noqa: F401  (imported for its side effect: before the group exists, not after)
    dist.init_process_group(backend, **kwargs)
