"""slimopt's methods inside torchtitan 0.3, PyTorch's FSDP2 / tensor / pipeline parallel pretraining engine.

torchtitan builds its optimizer with ``config.optimizer.build(model_parts=...)``, which constructs the owner class
of the Config it holds. ``SlimOptimizersContainer`` is such an owner: an ``OptimizersContainer`` with one
``SlimOptimizer`` per model part, its groups from ``slimopt.param_groups`` (torchtitan's llama3 names partition as
Hugging Face names do: ``tok_embeddings`` the embedding, ``lm_head`` the head, norms the rest, every Linear
projectable; the fused ``wqkv`` is one matrix). torchtitan's LR schedulers (a LambdaLR per optimizer scales every
group), gradient clipping and FSDP2 stay as they are.

Details: docs/modules.md, ``slimopt.integrations.torchtitan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.base import OPTIMIZER
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

import slimopt
from slimopt.optim.distributed import distcheckpoint, portable

__all__ = ["SlimOptimizersContainer", "SlimCheckpointManager"]

# the Config fields that are slimopt hyperparameters (None: the method's own value)
_NAMED = ("lr", "weight_decay", "rank", "density", "update_gap", "scale", "state_bits")


class SlimOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with a slimopt method: one SlimOptimizer per model part."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        method: str = "adamw"
        """A slimopt method (``slimopt methods``): adamw8bit, galore8bit, frugal, frugal_head, taco, muon8bit, ..."""
        lr: float | None = None
        """None: the method's own rate (``slimopt.default_lr``)."""
        weight_decay: float | None = None
        rank: int | None = None
        """Subspace rank of a projected method (GaLore, FRUGAL)."""
        density: float | None = None
        """Subspace density instead of a rank (FRUGAL's column / row blocks)."""
        update_gap: int | None = None
        """Steps between subspace refreshes."""
        scale: float | None = None
        state_bits: int | None = None
        state_full: str | None = None
        """'all' or 'head' (only the output layer keeps Adam state); None: the method's own."""
        target_modules: list[str] | None = None
        """Name patterns of the projectable matrices; None: every Linear weight but the head."""
        settings: dict[str, Any] = field(default_factory=dict)
        """Any other SlimOptimizer setting for every group (``slimopt.optim.settings.DEFAULTS``)."""
        overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
        """Name regex -> settings for the parameters it matches."""

        def hyperparameters(self) -> dict[str, Any]:
            named = {k: getattr(self, k) for k in _NAMED if getattr(self, k) is not None}
            clash = sorted(set(named) & set(self.settings))
            if clash:
                raise ValueError(f"optimizer.settings repeats {clash}: set each once, as a field or in settings")
            return {**named, **self.settings}

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError("optimizer.param_groups must be empty with a slimopt method: slimopt.param_groups "
                             "makes the groups (use optimizer.overrides for per-parameter settings)")
        if config.optimizer_factory_kwargs_by_name:
            raise ValueError("optimizer.optimizer_factory_kwargs_by_name is not read with a slimopt method")
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("optimizer.implementation 'fused_opt_states_bf16' is torch AdamW's; slimopt's state "
                             "formats are its methods (adamw8bit, ternary_adamw, ...) or optimizer.settings codec")
        hparams = config.hyperparameters()
        if config.implementation == "for-loop":
            hparams.setdefault("fused", False)  # slimopt's eager reference step
        self.optimizers = []
        self.model_parts = model_parts
        self._load_metadata: dict[str, Any] | None = None
        self._blind_template = False
        all_params = []
        for part, model in enumerate(model_parts):
            groups = slimopt.param_groups(model, config.method, target_modules=config.target_modules,
                                          state_full=config.state_full, overrides=config.overrides or None, **hparams)
            for g in groups:
                g["param_names"] = [canonical_fqn(n) for n in g.pop("names")]
                all_params.extend(g["params"])
                logger.info(f"slimopt {config.method} (model_part={part}): {g['name']}, {len(g['params'])} params, "
                            f"lr {g['lr']}" + (f", rank {g['rank']}" if g.get("rank") else ""))
            self.optimizers.append(slimopt.SlimOptimizer(groups))
        self._validate_params(all_params)
        self._post_init(all_params)

    def state_dict(self) -> dict[str, Any]:
        """The flat ``state.{fqn}.{key}`` / ``param_groups.{fqn}.{key}`` dict torchtitan's checkpoints hold, with
        slimopt's portable state. Before a load (``expect_checkpoint``) the entries are the checkpoint's."""
        flat: dict[str, Any] = {}
        stepped = False
        for opt in self.optimizers:
            distcheckpoint.fill_empty_state(opt)
            with portable.portable_state(opt):
                sd = opt.state_dict()
            fqns = [f for g in sd["param_groups"] for f in g["param_names"]]
            state = {fqn: sd["state"][i] for g in sd["param_groups"] for i, fqn in zip(g["params"], g["param_names"])
                     if i in sd["state"]}
            stepped |= any(float(s["step"]) > 0 for s in state.values() if "step" in s)
            if self._load_metadata is not None:
                state = distcheckpoint.saved_state_template(opt, fqns, self._load_metadata, f"{OPTIMIZER}.state.")
            for fqn, entries in state.items():
                for key, value in entries.items():
                    flat[f"state.{fqn}.{key}"] = value
            for g in sd["param_groups"]:
                for fqn in g["param_names"]:
                    for key, value in g.items():
                        if key not in ("params", "param_names"):
                            flat[f"param_groups.{fqn}.{key}"] = value
        # a template taken from unstepped state names only steps: what DCP loads into it is incomplete
        self._blind_template = self._load_metadata is None and not stepped
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blind, self._blind_template, self._load_metadata = self._blind_template, False, None
        if blind and any(k.startswith("state.") and k.endswith(".step") and float(v) > 0
                         for k, v in state_dict.items()):
            raise ValueError("this checkpoint holds slimopt optimizer state that torchtitan's CheckpointManager "
                             "cannot load: set Trainer.Config.checkpoint to slimopt.integrations.torchtitan."
                             "SlimCheckpointManager.Config(...) (the job configs in slimopt.integrations.torchtitan."
                             "config_registry do)")
        for opt in self.optimizers:
            state, groups, index = {}, [], 0
            for g in opt.param_groups:
                fqns = g["param_names"]
                for pid, fqn in enumerate(fqns, start=index):
                    entries = _under(state_dict, f"state.{fqn}.")
                    if entries:
                        state[pid] = entries
                groups.append({**_under(state_dict, f"param_groups.{fqns[0]}."),
                               "params": list(range(index, index + len(fqns))), "param_names": list(fqns)})
                index += len(fqns)
            opt.load_state_dict({"state": state, "param_groups": groups})

    def expect_checkpoint(self, checkpoint_id: str) -> None:
        """The next ``state_dict()`` is the template DCP loads `checkpoint_id` into (SlimCheckpointManager calls it)."""
        self._load_metadata = distcheckpoint.read_metadata(checkpoint_id).state_dict_metadata


def _under(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix) and "." not in k[len(prefix):]}


class SlimCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager that tells a SlimOptimizersContainer which checkpoint it is about to load."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        optimizers = self.states.get(OPTIMIZER)
        if not from_hf and OPTIMIZER in state_dict and isinstance(optimizers, SlimOptimizersContainer):
            optimizers.expect_checkpoint(checkpoint_id)
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
