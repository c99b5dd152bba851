"""torchtitan job configs that train with a slimopt method: pass ``--module slimopt.integrations.torchtitan
--config NAME`` to ``torchtitan.train``, and set any slimopt field on the command line (``--optimizer.method frugal
--optimizer.rank 128``) as any other torchtitan option.

Each config is torchtitan's llama3 config of that size with ``optimizer`` and ``checkpoint`` replaced
(``with_slimopt`` does it to any Trainer.Config).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from slimopt.integrations.torchtitan import SlimCheckpointManager, SlimOptimizersContainer

__all__ = ["llama3_1b_adamw", "llama3_1b_slimopt", "llama3_8b_slimopt", "llama3_debugmodel_slimopt", "with_slimopt"]


def with_slimopt(config: Trainer.Config, method: str, **settings: Any) -> Trainer.Config:
    """`config` training with slimopt's `method` (any SlimOptimizersContainer.Config field in `settings`), its
    checkpoint settings kept under SlimCheckpointManager."""
    config.optimizer = SlimOptimizersContainer.Config(method=method, **settings)
    old = config.checkpoint
    config.checkpoint = SlimCheckpointManager.Config(**{f.name: getattr(old, f.name) for f in fields(old) if f.init})
    return config


def llama3_debugmodel_slimopt() -> Trainer.Config:
    """torchtitan's debug model (dim 256, 6 layers, vocabulary 2048) with GaLore at rank 64, 8-bit state."""
    return with_slimopt(llama3_debugmodel(), "galore8bit", rank=64, update_gap=200)


def llama3_1b_adamw() -> Trainer.Config:
    """LLaMA-3 1B (dim 2048, 16 layers, vocabulary 128256) on the debug model's short schedule with torch's fused
    AdamW, torchtitan's default optimizer: the baseline of llama3_1b_slimopt."""
    config = llama3_debugmodel()
    config.model_spec = model_registry("1B")
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=10, decay_ratio=0.8, decay_type="cosine")
    return config


def llama3_1b_slimopt() -> Trainer.Config:
    """llama3_1b_adamw with FRUGAL (arXiv 2411.07837): Adam on a quarter of the matrices (blocks that change every
    200 steps), signSGD on the rest."""
    return with_slimopt(llama3_1b_adamw(), "frugal")


def llama3_8b_slimopt() -> Trainer.Config:
    """torchtitan's LLaMA-3 8B job with GaLore's 7B pretraining settings (rank 1024, refresh every 500 steps, scale
    0.25; arXiv 2403.03507) and 8-bit state."""
    return with_slimopt(llama3_8b(), "galore8bit", rank=1024, update_gap=500, scale=0.25)
