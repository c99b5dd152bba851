"""SlimOptimizer's side of torch.optim's state_dict contract: loading a saved state without torch's casts.

torch.optim.Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype (and even uint8
codes of a floating parameter): 8-bit codes would become floats and fp32 scales bf16 (docs/design.md, section 3).
``load`` keeps torch's checks and hooks, in their order, and puts the state in itself (``load_state``): every
tensor keeps its saved dtype and only moves to its parameter's device.
"""

from __future__ import annotations

from typing import Any, Callable

from slimopt.optim.algorithm.rules import MOMENTS
from slimopt.optim.distributed import portable
from slimopt.optim.settings import DEFAULTS, validate_group

__all__ = ["load", "load_state"]


def load(opt, state_dict: dict[str, Any], torch_load: Callable[[dict[str, Any]], None]) -> None:
    """As torch.optim.Optimizer.load_state_dict (its checks, its hooks in their order, state that names no
    parameter kept as it is), but every state tensor keeps its saved dtype.

    torch casts floating state to the parameter's dtype (and even uint8 codes of a floating parameter), which
    would turn 8-bit codes into floats and fp32 scales into bf16. State tensors only move to the parameter's
    device; the counters ``step`` and ``moment_step`` become 0-D fp32 tensors on the CPU, from a tensor or from
    a Python number (which torch.optim loads too: older and hand-edited checkpoints). A group saved before a
    setting existed gets its default (the arithmetic it was saved with; e.g. ``eps_placement="torch"``).

    torch.optim's AdamW (or Adam without weight decay) loads too, as torch.optim's optimizers of one algorithm
    load each other's: its moments continue, and a torch setting SlimOptimizer does not compute (``amsgrad``,
    ``maximize``, Adam's L2 ``weight_decay``) is refused naming it (``_loaded_group``). Every loaded group is
    checked as a new group is, before anything is loaded.

    torch_load: torch.optim.Optimizer.load_state_dict bound to `opt`.
    """
    loaded: dict[str, Any] = {}

    def take_state(optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        # The last pre-hook: it sees what the user's pre-hooks left, and hands torch the groups only, so that
        # torch's cast never touches the state.
        loaded.update(sd)
        groups = sd["param_groups"]
        if len(groups) == len(opt.param_groups):  # otherwise torch refuses the state dict itself
            groups = [_loaded_group(ours, g, i) for i, (ours, g) in enumerate(zip(opt.param_groups, groups))]
        return {**sd, "param_groups": groups, "state": {}}

    def put_state(optimizer) -> None:
        # The first post-hook: the user's post-hooks see the loaded state, as they do with torch's optimizers.
        load_state(opt, loaded)

    pre = opt.register_load_state_dict_pre_hook(take_state)
    post = opt.register_load_state_dict_post_hook(put_state, prepend=True)
    try:
        torch_load(state_dict)
    finally:
        pre.remove()
        post.remove()


def load_state(opt, state_dict: dict[str, Any]) -> None:
    """Put the saved per-parameter state into ``opt.state`` (the groups are loaded already): torch's form, or
    the portable one of a DCP / resharding checkpoint (``portable.py``)."""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = dict(zip(ids, (p for g in opt.param_groups for p in g["params"])))
    in_portable_form = portable.is_portable(state_dict)
    for i, values in state_dict["state"].items():
        p = params.get(i)
        if p is None:
            opt.state[i] = values  # torch keeps state that names no parameter as it is
            continue
        values = portable.saved_state(values, f"state of parameter {i}")
        if "moment_step" not in values and "step" in values and not _MOMENT_KEYS.isdisjoint(values):
            # torch.optim's moments never restart, so their age is the parameter's step
            values["moment_step"] = values["step"].clone()
        if in_portable_form:
            opt.state[p] = portable.import_param(opt, p, opt.param_groups[opt._where[p][0]], values)
        else:
            opt.state[p] = {k: v if k in portable.COUNTERS else v.detach().to(p.device, copy=True)
                             for k, v in values.items()}


_MOMENT_KEYS = frozenset(key for keys in MOMENTS.values() for key, _ in keys)


def _loaded_group(ours: dict[str, Any], saved: dict[str, Any], index: int) -> dict[str, Any]:
    """The saved parameter group `saved` as it loads into the group `ours`: slimopt's settings over the defaults,
    refused with a ValueError naming the key where SlimOptimizer would not compute what the saver did."""
    where = f"parameter group {index} of the state dict"
    for key in ("amsgrad", "maximize"):  # torch.optim's AdamW settings with no slimopt arithmetic
        if saved.get(key):
            raise ValueError(f"{where}: {key}={saved[key]!r} (torch.optim) is an arithmetic SlimOptimizer does not "
                             f"implement; it loads only state saved with {key}=False")
    if saved.get("decoupled_weight_decay") is False and float(saved.get("weight_decay", 0.0)) != 0.0:
        raise ValueError(f"{where}: decoupled_weight_decay=False with weight_decay={saved['weight_decay']!r} is "
                         "torch.optim.Adam's L2 decay (added to the gradient); SlimOptimizer decays the weights "
                         "themselves, as torch.optim.AdamW does: it loads AdamW's state, or Adam's with weight_decay=0")
    group = {k: v for k, v in {**DEFAULTS, **saved}.items() if k != "state_layout"}
    for key, value in saved.items():
        # torch.optim saves None for a setting it picks itself (fused, foreach); where None is no value of
        # slimopt's setting, this optimizer's own value stays
        if value is None and key in DEFAULTS and not _valid({**ours, key: None}):
            group[key] = ours[key]
    try:
        validate_group({**group, "params": ours["params"]})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return group


def _valid(group: dict[str, Any]) -> bool:
    try:
        validate_group(group)
    except ValueError:
        return False
    return True
