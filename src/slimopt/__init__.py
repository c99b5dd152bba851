"""slimopt: memory-lean optimizers for training and fine-tuning language models.

One composable optimizer (``SlimOptimizer``) in which GaLore, FRUGAL, BAdam, TACO, signSGD and AdamW are
settings, with low-bit optimizer state as an independent axis. Start with ``slimopt.build(model, method)``;
``slimopt.methods()`` lists the methods.
"""

from .optim.accounting import state_nbytes
from .optim.optimizer import SlimOptimizer
from .optim.recipes import TACO, BAdam, FRUGAL, GaLoreAdamW, build, default_lr, methods, param_groups

__version__ = "0.1.0"

__all__ = ["SlimOptimizer", "GaLoreAdamW", "FRUGAL", "BAdam", "TACO", "build", "param_groups", "methods",
           "default_lr", "state_nbytes"]
