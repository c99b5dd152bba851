"""An optimizer built on the plain model, whose parameters are then switched in place to their FSDP2 shards, as
the Hugging Face Trainer does under ``fsdp_version: 2`` (it builds the optimizer, then accelerate's ``prepare``
shards the model and switches the groups' parameters); tests/test_fsdp_switch.py launches it.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/switch_worker.py --out DIR

For every method of ``slimopt methods`` at its defaults (defaults_worker.settings), on the small LLaMA whose row
shards hold whole quantization blocks, with injected gradients (``common.gradient``):

- switched before any step, STEPS steps equal an optimizer built after sharding bit for bit (weights and every
  state tensor), and one process within defaults_worker.TOLERANCE;
- switched after SWITCH_AT steps taken in one process, its state moves to the shards: the next steps equal an
  optimizer built after sharding that loads the state the plain one had at the switch (the checkpoint route,
  ``load_state_dict`` of the world-size-free form) bit for bit, and one process within TOLERANCE;
- switched before any step, the optimizer keeps no reference to the plain parameters (which would hold a whole
  copy of the model on every rank), as torch.optim's optimizers keep none.

The switch is accelerate's own (``accelerate.Accelerator._prepare_fsdp2``, accelerate 1.16): the groups'
parameters replaced by one-element placeholders keyed by the parameter's data pointer, ``fully_shard``, then
``fsdp2_switch_optimizer_parameters``. Rank 0 writes DIR/switch_<W>.json; any failed check raises.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import common as C  # noqa: E402
from defaults_worker import TOLERANCE, settings  # noqa: E402
from helpers import assert_same_state  # noqa: E402

import slimopt  # noqa: E402
from slimopt.optim.distributed import portable  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402

STEPS = 3
SWITCH_AT = 2


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def switch_like_accelerate(model, opt, wrap):
    """What accelerate's FSDP2 ``prepare`` does to a model and the optimizer built on it: the groups' parameters
    become placeholders (dropping the optimizer's references to them), ``wrap(model)`` shards it, and each
    placeholder is replaced by the new parameter of the same name. Returns the wrapped model."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters
    from accelerate.utils.modeling import _get_parameter_id
    old = {name: _get_parameter_id(p) for name, p in model.named_parameters()}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype, device=p.device)
            group["params"][i].data_ptr = _get_parameter_id(p)
    model = wrap(model)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(opt, {old[name]: new[name] for name in old})
    return model


def local_state(model, opt) -> dict[str, torch.Tensor]:
    """Every state tensor of this rank by parameter name and key (running sums settled first)."""
    opt.settle()
    return {f"{name}.{key}": v for name, p in model.named_parameters() for key, v in opt.state[p].items()}


def check(method: str, mesh) -> dict:
    hp = settings(method)
    ref = C.small_llama()
    ref_opt = slimopt.build(ref, method, **hp)
    C.run_steps(ref, ref_opt, 1, SWITCH_AT)
    weights_at_switch = C.full_params(ref)
    with portable.portable_state(ref_opt):
        # what a checkpoint taken at the switch holds (copied: the state dict holds the live tensors)
        state_at_switch = copy.deepcopy(ref_opt.state_dict())
    C.run_steps(ref, ref_opt, SWITCH_AT + 1, STEPS)
    one_process = C.full_params(ref)

    # switched before any step == built after sharding
    after = shard(C.small_llama(), mesh)
    after_opt = slimopt.build(after, method, **hp)
    C.run_steps(after, after_opt, 1, STEPS)
    plain = C.small_llama()
    switched_opt = slimopt.build(plain, method, **hp)
    plain_params = [weakref.ref(p) for p in plain.parameters()]
    switched = switch_like_accelerate(plain, switched_opt, lambda m: shard(m, mesh))
    del plain
    gc.collect()
    kept = sum(r() is not None for r in plain_params)
    if kept:  # the unsharded model would stay on every rank
        raise AssertionError(f"{method}: the optimizer keeps {kept} plain parameters alive after the switch")
    C.run_steps(switched, switched_opt, 1, STEPS)
    what = f"{method} switched before its first step"
    assert_same_state(C.full_params(switched), C.full_params(after), f"{what}, weights")
    assert_same_state(local_state(switched, switched_opt), local_state(after, after_opt), f"{what}, state")
    before_diff = C.max_diff(C.full_params(switched), one_process)

    # switched after SWITCH_AT steps == built after sharding and loaded with the state at the switch
    later = C.small_llama()
    later_opt = slimopt.build(later, method, **hp)
    C.run_steps(later, later_opt, 1, SWITCH_AT)
    later = switch_like_accelerate(later, later_opt, lambda m: shard(m, mesh))
    C.run_steps(later, later_opt, SWITCH_AT + 1, STEPS)
    loaded = shard(C.small_llama(), mesh)
    with torch.no_grad():
        for name, p in loaded.named_parameters():
            rows = S.rows_of(p)
            p.to_local().copy_(weights_at_switch[name][rows.start: rows.stop])
    loaded_opt = slimopt.build(loaded, method, **hp)
    loaded_opt.load_state_dict(state_at_switch)
    C.run_steps(loaded, loaded_opt, SWITCH_AT + 1, STEPS)
    what = f"{method} switched after {SWITCH_AT} steps"
    assert_same_state(C.full_params(later), C.full_params(loaded), f"{what}, weights")
    assert_same_state(local_state(later, later_opt), local_state(loaded, loaded_opt), f"{what}, state")
    after_diff = C.max_diff(C.full_params(later), one_process)
    if not (before_diff <= TOLERANCE and after_diff <= TOLERANCE):
        raise AssertionError(f"{method}: switched runs differ from one process by {before_diff:.3e} (before any "
                             f"step) and {after_diff:.3e} (after {SWITCH_AT}); allowed {TOLERANCE:.0e}")
    return {"before_diff": before_diff, "after_diff": after_diff,
            "moved": sum(len(st) for st in later_opt.state.values())}


def main() -> None:
    args, mesh, world, rank = C.start_ranks()
    report = {}
    try:
        for method in slimopt.methods():
            t0 = time.perf_counter()
            report[method] = check(method, mesh)
            report[method]["seconds"] = round(time.perf_counter() - t0, 2)
        C.write_report(args.out, f"switch_{world}.json", report, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
