"""What each compared method's memory would be at a size people train: the planner's figures beside a comparison.

A comparison runs at a size a CPU trains in minutes, where optimizer state is a few MiB and a process's peak memory
is mostly the runtime. The point of these methods is memory at scale, so each row also gets the planned optimizer
state and peak of one training step of the same method at `model` (LLaMA-7B by default) in bf16, batch 1 x 256
tokens with layer-wise updates (the setting of GaLore's 7B-on-24GB claim, arXiv 2403.03507 section 5.5), and
whether that fits `gpu_memory`: the figures ``slimopt memory`` prints for the same method, settings and model
(``command`` gives the call). Baselines the planner does not model (lora, relora, lowrank, the control) get none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlanSetting", "plan_methods", "memory_command"]


@dataclass(frozen=True)
class PlanSetting:
    """Where compared methods are planned: a model size or config folder, and the GPU memory to fit in."""

    model: str = "7b"
    gpu_memory: str = "24GiB"
    dtype: str = "bf16"
    batch: int = 1
    seq: int = 256
    layerwise: bool = True

    @property
    def budget(self) -> int:
        from slimopt.bench.units import parse_size
        return parse_size(self.gpu_memory, "--plan-gpu-memory")


# the run settings a variant may set (adamw+weights=int8+offload=host) -> the planner's keyword, slimopt memory's
PLACEMENT = {"weights": ("weight_format", "--weights"), "int8_group": ("int8_group", "--int8-group"),
             "int8_embeddings": ("int8_embeddings", "--int8-embeddings"),
             "offload": ("offload", "--offload"), "master": ("master", "--master"),
             "vocab_slice": ("vocab_slice", "--vocab-slice")}


def _plan_settings(settings: dict) -> dict:
    """The optimizer settings of a compared entry that shape its state (its lr does not)."""
    return {k: v for k, v in settings.items() if k != "lr" and k not in PLACEMENT}


def _placed(settings: dict) -> dict:
    """An entry's run settings (a master only where it lives on the host: without offload there is none)."""
    return {k: v for k, v in settings.items()
            if k in PLACEMENT and (k != "master" or settings.get("offload") == "host")}


def memory_command(setting: PlanSetting, method: str, settings: dict) -> str:
    """The `slimopt memory` call that prints the same plan."""
    parts = [f"slimopt memory --model {setting.model} --method {method} --dtype {setting.dtype}",
             f"--batch {setting.batch} --seq {setting.seq}"]
    if setting.layerwise:
        parts.append("--layerwise")
    parts.append(f"--gpu-memory {setting.gpu_memory}")
    parts += [(PLACEMENT[k][1] if v is True else f"{PLACEMENT[k][1]} {v}")  # a flag (--int8-embeddings) alone
              for k, v in _placed(settings).items() if v is not False]
    parts += [f"--set {method}.{k}={v}" for k, v in sorted(_plan_settings(settings).items())]
    return " ".join(parts)


def plan_methods(setting: PlanSetting, entries: dict[str, tuple[str, dict]]) -> dict[str, dict | None]:
    """entry -> {"state_gib", "peak_gib", "fits", "command"} for every entry (name -> (method, settings)) the
    planner models, None for the others. Raises ValueError naming the option (an unknown model, a bad memory
    size) or the entry (a bad setting)."""
    from slimopt.bench import planner

    budget = setting.budget
    try:
        label, config = planner.load_config(setting.model)
    except ValueError as e:
        raise ValueError(f"--plan-model: {e}") from e
    known = set(planner.planner_methods())
    out: dict[str, dict | None] = {}
    for entry, (method, settings) in entries.items():
        if method not in known:
            out[entry] = None
            continue
        try:
            prep = planner.prepare(planner.meta_model(config, setting.dtype), method, dtype=setting.dtype,
                                   label=label, config=config, **{PLACEMENT[k][0]: v for k, v in _placed(settings).items()},
                                   **_plan_settings(settings))
        except ValueError as e:
            raise ValueError(f"method {entry!r}: {e}") from e
        plan = prep.plan(setting.batch, setting.seq, setting.layerwise, False)
        out[entry] = {"state_gib": plan.optimizer_state / 2**30, "peak_gib": plan.peak / 2**30,
                      "fits": plan.peak <= budget, "model": label,
                      "command": memory_command(setting, method, settings)}
    return out
