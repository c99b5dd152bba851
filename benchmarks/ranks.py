"""The ranks of a multi-process benchmark: `world` processes of their own (spawned), each running
``target(rank, world, port, *args, queue)`` and putting ``(rank, result)`` on the queue, collected here. A rank
that dies (an import error, a failed collective) stops the run with its exit code instead of hanging it.

    from ranks import spawn_ranks          # benchmarks/ is the script's folder, so on sys.path
    results = spawn_ranks(_rank, 2, methods)   # {0: ..., 1: ...}
"""

from __future__ import annotations

import socket
from queue import Empty
from typing import Any, Callable

import torch.multiprocessing as mp


def spawn_ranks(target: Callable[..., None], world: int, *args: Any) -> dict[int, Any]:
    """rank -> what `target` put on the queue, for `world` spawned ranks sharing a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    while len(results) < world:
        try:
            rank, mine = queue.get(timeout=5)
            results[rank] = mine
        except Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.terminate()
                raise SystemExit(f"a rank failed (exit code {failed[0]}): its error is above")
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    return results
