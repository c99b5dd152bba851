"""slimopt: memory-lean optimizers for training and fine-tuning language models.

One composable optimizer (``SlimOptimizer``) in which GaLore, FRUGAL, BAdam, TACO, signSGD and AdamW are
settings, with low-bit optimizer state as an independent axis. Start with ``slimopt.build(model, method)``;
``slimopt.methods()`` lists the methods.

The names below load on first use, so that ``import slimopt.catalog`` (what ``slimopt methods`` needs) does not
pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "state_nbytes": "slimopt.optim.accounting",
    "SlimOptimizer": "slimopt.optim.optimizer",
    "build": "slimopt.factory",  # recipes.build, or int8 weights and host masters (slimopt.weights)
    **{name: "slimopt.optim.recipes" for name in ("TACO", "BAdam", "FRUGAL", "GaLoreAdamW", "default_lr", "methods",
                                                    "param_groups")},
}

__all__ = ["SlimOptimizer", "GaLoreAdamW", "FRUGAL", "BAdam", "TACO", "build", "param_groups", "methods",
           "default_lr", "state_nbytes"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slimopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
