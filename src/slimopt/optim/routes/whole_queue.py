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
    open_runs: dict[tuple, tuple[list[tuple], int]] = {}  # key -> (its matrices, their whole bytes)
    for item in matrices:
        key, _, (m, n), size = item
        run, queued = open_runs.get(key, ([], 0))
        if flush_due(queued, m * n * size, world):
            out.append(run)
            run, queued = [], 0
        run.append(item)
        open_runs[key] = (run, queued + m * n * size)
    return out + [run for run, _ in open_runs.values()]


class WholeQueue:
    """The matrices waiting, by key (a key: one kind of work, one process group, one element type and setting),
    each key with the function that runs a list of its ``Pending``s."""

    def __init__(self) -> None:
        # key -> [what runs its matrices, the matrices waiting, their whole bytes]
        self._queues: dict[tuple, list] = {}

    def add(self, key: tuple, pending: Pending, run: Callable[[list[Pending]], None]) -> None:
        entry = self._queues.setdefault(key, [run, [], 0])
        if flush_due(entry[2], pending.whole_bytes, pending.part.rows.world):
            waiting, entry[1], entry[2] = entry[1], [], 0
            run(waiting)
        entry[1].append(pending)
        entry[2] += pending.whole_bytes

    def flush(self) -> None:
        """Run every queued matrix (a run's finishing steps may queue more: they run too)."""
        while self._queues:
            run, queue, _ = self._queues.pop(next(iter(self._queues)))
            if queue:
                run(queue)


def key_of(kind: str, rows: Any, *setting: Any) -> tuple:
    """A queue's key: the kind of work, the process group and its size, and what else the run must share."""
    return (kind, id(rows.group), rows.world, *setting)
