"""Work that needs whole matrices, queued during ``step()`` and run in bounded runs: Muon's iteration
(``muon_batch.py``) and, under FSDP2, a refresh's decomposition (``refresh_batch.py``).

A parameter's step puts its part of a matrix in the queue with what finishes its step once the result is there. A
key's queue runs when adding a matrix would pass ``QUEUE_BYTES`` a rank (whole matrices' bytes over the ranks:
the same count on every rank, so every rank cuts its runs at the same matrix) and at the end of ``step()``; a
larger matrix waits alone. Under FSDP2 each run is one exchange with owner ranks (``distributed/exchange.py``).
``runs`` gives the cuts from the matrices alone, for the memory and communication planners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from slimopt.optim.distributed.exchange import Part

__all__ = ["QUEUE_BYTES", "Pending", "WholeQueue", "flush_due", "runs"]

QUEUE_BYTES = 64 << 20  # waiting bytes per rank: small beside a model, a few layers' matrices of LLaMA-1B


@dataclass
class Pending:
    """One queued matrix: this rank's ``Part`` of it, the work's cost (``owners.py``'s models), what takes this
    rank's share of the result (and the owner's status value), and the work on the whole matrix where it differs
    from matrix to matrix (a refresh's decomposition)."""

    part: Part
    cost: float
    finish: Callable[..., None]
    work: Callable[[Any], Any] | None = None

    @property
    def whole_bytes(self) -> int:
        return self.part.shape[0] * self.part.shape[1] * self.part.x.element_size()


def flush_due(queued_bytes: int, new_bytes: int, world: int) -> bool:
    """Whether a queue holding `queued_bytes` of whole matrices runs before one of `new_bytes` joins it."""
    return queued_bytes > 0 and queued_bytes + new_bytes > QUEUE_BYTES * world


def runs(matrices: list[tuple[tuple, int, tuple[int, int], int]], world: int) -> list[list[tuple]]:
    """How a step's queued matrices (key, parameter index, whole shape, element size), in the order queued, are
    run: each list one run of one key's queue (``WholeQueue`` cuts alike)."""
    out: list[list[tuple]] = []
    open_runs: dict[tuple, list[tuple]] = {}
    for item in matrices:
        key, _, (m, n), size = item
        run = open_runs.setdefault(key, [])
        if flush_due(sum(a * b * s for _, _, (a, b), s in run), m * n * size, world):
            out.append(run)
            run = open_runs[key] = []
        run.append(item)
    return out + [r for r in open_runs.values() if r]


class WholeQueue:
    """The matrices waiting, by key (a key: one kind of work, one process group, one element type and setting),
    each key with the function that runs a list of its ``Pending``s."""

    def __init__(self) -> None:
        self._queues: dict[tuple, tuple[Callable[[list[Pending]], None], list[Pending]]] = {}

    def add(self, key: tuple, pending: Pending, run: Callable[[list[Pending]], None]) -> None:
        _, queue = self._queues.setdefault(key, (run, []))
        if flush_due(sum(q.whole_bytes for q in queue), pending.whole_bytes, pending.part.rows.world):
            run(list(queue))
            queue.clear()
        queue.append(pending)

    def flush(self) -> None:
        """Run every queued matrix (a run's finishing steps may queue more: they run too)."""
        while self._queues:
            key = next(iter(self._queues))
            run, queue = self._queues.pop(key)
            if queue:
                run(queue)

    def __bool__(self) -> bool:
        return any(queue for _, queue in self._queues.values())


def key_of(kind: str, rows: Any, *setting: Any) -> tuple:
    """A queue's key: the kind of work, the process group and its size, and what else the run must share."""
    return (kind, id(rows.group), rows.world, *setting)
