"""A weight whose gradient leaves a block of rows at a time, as the code computing it produces them.

The vocabulary-sliced loss (``train/vocab_chunked_loss.py``) computes the output layer's gradient one vocabulary
slice of rows at a time. Returned whole, it is a (V, h) tensor on the device (0.98 GiB for LLaMA-3-8B in bf16),
the largest gradient of the model, alive at the start of the backward pass with nearly every activation.
``MasterWeights`` routes it instead: each slice's rows go to the host master as they are made, and the device
holds one slice. Whoever computes such a gradient asks ``route_of(weight)``; whoever keeps the weight's master
registers the route with ``route_rows``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

__all__ = ["RowRoute", "route_rows", "route_of"]


@dataclass(frozen=True)
class RowRoute:
    """What to do with a weight instead of returning its gradient whole.

    ready(): before the weight is read in a forward pass (its update in flight must have landed);
    rows(start, grad): grad holds rows [start, start + len(grad)) of this backward pass's gradient (in the compute
    dtype; each row once a pass); done(): every row of this pass's gradient has been handed over."""

    ready: Callable[[], None]
    rows: Callable[[int, Tensor], None]
    done: Callable[[], None]


# id(weight) -> (a weak reference to it, its route): tensors compare element by element, so they cannot be the
# keys of a WeakKeyDictionary; the reference tells a live weight from a new tensor that took a dead one's id
_ROUTES: dict[int, tuple[weakref.ref, RowRoute]] = {}


class _Handle:
    def __init__(self, weight: Tensor) -> None:
        self._id, self._weight = id(weight), weakref.ref(weight)

    def remove(self) -> None:
        entry = _ROUTES.get(self._id)
        if entry is not None and entry[0] is self._weight:
            del _ROUTES[self._id]


def route_rows(weight: Tensor, route: RowRoute) -> _Handle:
    """Send `weight`'s gradient through `route` wherever it is computed a block of rows at a time; the handle's
    ``remove()`` takes the route off (the gradient is then returned whole again)."""
    handle = _Handle(weight)
    _ROUTES[id(weight)] = (handle._weight, route)
    return handle


def route_of(weight: Tensor) -> RowRoute | None:
    """The route registered for `weight`, or None (return its gradient whole)."""
    entry = _ROUTES.get(id(weight))
    if entry is None or entry[0]() is not weight:
        return None
    return entry[1]
