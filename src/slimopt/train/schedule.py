"""Learning-rate schedule used for pretraining: linear warmup, then cosine decay to a floor.

This is the recipe of the GaLore (arXiv 2403.03507) and FRUGAL (arXiv 2411.07837) pretraining runs: the learning
rate rises linearly from 0 over the first 10% of the steps, then follows a half cosine down to 10% of its peak at
the last step.

`WarmupCosine` is a plain callable object, so it works as the `lr_lambda` of `torch.optim.lr_scheduler.LambdaLR`
and its settings travel in the scheduler's `state_dict()` as numbers only (safe for `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["WarmupCosine", "resolve_warmup", "build_scheduler"]


class WarmupCosine:
    """Multiplier of the peak learning rate at a given step.

    Step `s` (0-based, the number of optimizer steps already taken) gets:
      - `(s + 1) / warmup_steps` while `s < warmup_steps` (so the very first step already moves the weights);
      - afterwards `min_ratio + (1 - min_ratio) * (1 + cos(pi * t)) / 2`, with `t` running from 0 at the end of
        warmup to 1 at the last step (`total_steps - 1`), and staying at `min_ratio` beyond it.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float = 0.1):
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
        if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps must be an integer in [0, total_steps={total_steps}], got {warmup_steps!r}")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_ratio!r}")
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - 1 - self.warmup_steps
        if decay_steps <= 0:
            return 1.0 if step < self.total_steps else self.min_ratio
        t = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def resolve_warmup(warmup: float, total_steps: int) -> int:
    """Turn the `--warmup` option into a number of steps.

    A value in [0, 1) is a fraction of the run (0.1: the papers' 10%); an integer value >= 1 is a step count.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0 (a fraction in [0, 1) or a step count), got {warmup!r}")
    if warmup < 1:
        return int(round(warmup * total_steps))
    if warmup != int(warmup):
        raise ValueError(f"warmup >= 1 is a step count and must be an integer, got {warmup!r}")
    if warmup > total_steps:
        raise ValueError(f"warmup ({int(warmup)} steps) is longer than the run ({total_steps} steps)")
    return int(warmup)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup: float = 0.1,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over every param group of `optimizer` following `WarmupCosine`."""
    fn = WarmupCosine(total_steps, resolve_warmup(warmup, total_steps), min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
