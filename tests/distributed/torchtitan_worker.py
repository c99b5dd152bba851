"""slimopt inside torchtitan 0.3 on CPU (gloo), run under torchrun by tests/test_torchtitan.py.

torchtitan's Trainer needs a GPU; its parts do not, so this worker assembles what Trainer.__init__ and train_step
do from them: torchtitan's llama3 debug model (2 of its 6 blocks) through ``parallelize_llama`` (FSDP2 over every
rank), the optimizer from ``SlimOptimizersContainer.Config.build(model_parts=...)``, torchtitan's LR schedulers,
its ``clip_grad_norm_`` and its CheckpointManager (``SlimCheckpointManager``). Every rank trains on the same
tokens, so the averaged gradient is the same at any world size.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/torchtitan_worker.py --phase save --out DIR
    python -m torch.distributed.run --nproc_per_node W2 tests/distributed/torchtitan_worker.py --phase load --out DIR
    python tests/distributed/torchtitan_worker.py --phase config --out DIR

``save``, per case: K1 steps, a checkpoint through the manager to DIR/ckpt_<case>, K2 more steps; a fresh model and
optimizer loading the checkpoint continue bit-identically; slimopt's own FSDP2 run (``slimopt.train.fsdp
.shard_model`` and ``slimopt.build``, torch's clipping, the same rates set by hand) on the same model and tokens
ends equal; the parameters go to DIR/<case>.final.pt. ``load``: the saved checkpoints at another world size, K2
steps, against the saved final parameters. ``config``: the job configs parse with command-line overrides, and the
partition of the full debug model. DIR/report_<phase>_<world>.json holds the figures; a failed check raises.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch._utils

# torchtitan chooses its device when imported (the first available accelerator, else "cuda"); on a CPU-only torch
# that is "cuda", so say "cpu" before the import
torch._utils._get_available_device_type = lambda: "cpu"

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.components.checkpointer.utils import canonical_fqn  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.llama3 import parallelize_llama  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import slimopt  # noqa: E402
from slimopt.integrations.torchtitan import SlimCheckpointManager, SlimOptimizersContainer  # noqa: E402
from slimopt.integrations.torchtitan.config_registry import llama3_debugmodel_slimopt  # noqa: E402
from slimopt.train.fsdp import shard_model  # noqa: E402
from slimopt.train.process_group import init_process_group  # noqa: E402

K1, K2, SEQ, BATCH, VOCAB = 3, 3, 32, 2, 2048  # the debug model's vocabulary
MAX_NORM = 1.0  # --max-norm
# torchtitan's default backend, spmd_types, needs GPU meshes past one rank on torch 2.13 (its parameters stay plain
# tensors on a CPU mesh); partial_dtensor is FSDP2 as torchtitan applies it without tensor parallelism
SPMD_BACKEND = "partial_dtensor"
# name -> SlimOptimizersContainer.Config fields; update_gap 2 puts a refresh among the K2 steps after the load.
# GaLore projects every matrix from the right: a left projection all-reduces partial products, whose order of sums
# changes with the world size (tests/test_fsdp.py covers it), and the resumed runs here must be bit-identical
CASES = {
    "adamw": dict(method="adamw"),
    "adamw8bit": dict(method="adamw8bit"),
    "galore8bit": dict(method="galore8bit", rank=16, update_gap=2, settings={"proj_side": "right"}),
    "frugal": dict(method="frugal", rank=16, update_gap=2),
    "frugal_head": dict(method="frugal_head", update_gap=2),
    "taco": dict(method="taco"),
    "muon8bit": dict(method="muon8bit"),
}


def _sdpa_as_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    # FlexAttention has no CPU backward, and llama3 offers only flex attention kinds. Each sequence here is one
    # document, so its block mask (causal, same document) is plain causal attention.
    assert score_mod is None and not return_aux.lse
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, None


FlexAttention.compiled_flex_attn = staticmethod(_sdpa_as_flex)


def job_config():
    """The repository's debug job config (llama3_debugmodel_slimopt) at 2 of its 6 blocks, fp32, short sequences."""
    config = llama3_debugmodel_slimopt()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = SPMD_BACKEND
    config.model_spec.model.update_from_config(config=config)  # what Trainer.__init__ does before building
    return config


def _build(config):
    with torch.device("meta"):
        return config.model_spec.model.build()


def _materialise(model):
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def titan_model(world: int):
    """The model as torchtitan's Trainer makes it: parallelize_llama (FSDP2 over every rank, the job's selective
    activation checkpointing), then initialised on the device."""
    config = job_config()
    backend = config.parallelism.spmd_backend
    dims = ParallelDims.from_config(config.parallelism, world)
    dist_utils.set_spmd_backend(backend)
    model = parallelize_llama(_build(config), parallel_dims=dims, training=config.training,
                              parallelism=config.parallelism, compile_config=config.compile,
                              ac_config=config.activation_checkpoint, dump_folder=tempfile.gettempdir())
    # torchtitan turns FSDP's gradient division off (its loss is divided by the global token count), which FSDP2
    # reduces with PREMUL_SUM; gloo has no PREMUL_SUM, and a plain sum is the same reduction
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return _materialise(model)


def titan_optimizers(model, case: str):
    optimizers = SlimOptimizersContainer.Config(**CASES[case]).build(model_parts=[model])
    schedulers = job_config().lr_scheduler.build(optimizers=optimizers, training_steps=10)
    return optimizers, schedulers


def loss_of(model, step: int, world: int = 1):
    """The mean loss over every rank's tokens, of which this rank holds 1/world (each rank the same tokens)."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    logits = model(tokens[:, :-1], positions, model.get_attention_masks(positions=positions))
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / world


def titan_step(model, optimizers, schedulers, step: int) -> list[float]:
    """What torchtitan's train_step does; returns the rates this step used, per group."""
    optimizers.zero_grad()
    loss_of(model, step, dist.get_world_size()).backward()  # summed over ranks, as torchtitan reduces
    dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
    rates = [g["lr"] for g in optimizers.optimizers[0].param_groups]
    optimizers.step()
    schedulers.step()
    return rates


def full_params(model) -> dict[str, torch.Tensor]:
    """common.full_params by torchtitan's names (wrappers such as activation checkpointing's left out)."""
    return {canonical_fqn(n): t for n, t in C.full_params(model).items()}


def manager(model, optimizers, schedulers, folder: str, step_box: dict):
    class TrainState:
        def state_dict(self):
            return dict(step_box)

        def load_state_dict(self, sd):
            step_box.update(sd)

    config = SlimCheckpointManager.Config(enable=True, folder=os.path.basename(folder), interval=1, keep_latest_k=0)
    return config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={"train_state": TrainState()}, sd_adapter=None, base_folder=os.path.dirname(folder))


def own_fsdp_run(case: str, initial: dict[str, torch.Tensor], rates: list[list[float]]) -> dict[str, torch.Tensor]:
    """slimopt's own FSDP2 run: the same model, weights and tokens, sharded as `slimopt train --fsdp` does, the
    optimizer from slimopt.build, torch's clipping and the container's rates."""
    model = _materialise(_build(job_config()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])  # torchtitan initialises shards: other draws than a whole tensor's
    model = shard_model(model, torch.device("cpu"))
    config = SlimOptimizersContainer.Config(**CASES[case])
    optimizer = slimopt.build(model, config.method, **config.hyperparameters())
    for step, step_rates in enumerate(rates):
        for group, lr in zip(optimizer.param_groups, step_rates):
            group["lr"] = lr
        optimizer.zero_grad()
        loss_of(model, step).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
        optimizer.step()
    return full_params(model)


def phase_save(out: str, world: int, rank: int) -> dict:
    report = {}
    for case in CASES:
        model = titan_model(world)
        initial = full_params(model)
        optimizers, schedulers = titan_optimizers(model, case)
        groups = {g["name"]: len(g["params"]) for g in optimizers.optimizers[0].param_groups}
        rates = [titan_step(model, optimizers, schedulers, s) for s in range(K1)]
        folder = os.path.join(out, f"ckpt_{case}")
        box = {"step": K1}
        ck = manager(model, optimizers, schedulers, folder, box)
        ck.save(curr_step=K1)
        ck.close()
        rates += [titan_step(model, optimizers, schedulers, s) for s in range(K1, K1 + K2)]
        final = full_params(model)

        again = titan_model(world)
        with torch.no_grad():
            for p in again.parameters():
                p.add_(1.0)  # the checkpoint must overwrite these
        again_opt, again_sched = titan_optimizers(again, case)
        box2 = {"step": 0}
        ck2 = manager(again, again_opt, again_sched, folder, box2)
        assert ck2.load(step=K1), case
        ck2.close()
        assert box2["step"] == K1, box2
        for s in range(K1, K1 + K2):
            titan_step(again, again_opt, again_sched, s)
        resumed = C.max_diff(final, full_params(again))
        own = C.max_diff(final, own_fsdp_run(case, initial, rates))
        if rank == 0:
            torch.save(final, os.path.join(out, f"{case}.final.pt"))
        report[case] = {"groups": groups, "resumed_diff": resumed, "own_fsdp_diff": own, "rates": rates}
        if rank == 0:
            print(f"{case} at {world} ranks: groups {groups}, resumed {resumed:.3g}, own FSDP2 {own:.3g}", flush=True)
    return report


def phase_load(out: str, world: int, rank: int) -> dict:
    report = {}
    for case in CASES:
        model = titan_model(world)
        optimizers, schedulers = titan_optimizers(model, case)
        box = {"step": 0}
        ck = manager(model, optimizers, schedulers, os.path.join(out, f"ckpt_{case}"), box)
        assert ck.load(step=K1), case
        ck.close()
        for s in range(K1, K1 + K2):
            titan_step(model, optimizers, schedulers, s)
        final = torch.load(os.path.join(out, f"{case}.final.pt"), weights_only=True)
        report[case] = {"resharded_diff": C.max_diff(final, full_params(model))}
        if rank == 0:
            print(f"{case} resumed at {world} ranks: {report[case]['resharded_diff']:.3g}", flush=True)
    report["stock_manager"] = stock_manager_refuses(out)
    return report


def stock_manager_refuses(out: str) -> str:
    """torchtitan's own CheckpointManager cannot hand the checkpoint's entries to the container: the load stops
    with a ValueError naming SlimCheckpointManager, instead of resuming with the moments lost."""
    model = titan_model(dist.get_world_size())
    optimizers, schedulers = titan_optimizers(model, "adamw")
    folder = os.path.join(out, "ckpt_adamw")
    stock = CheckpointManager.Config(enable=True, folder=os.path.basename(folder), interval=1, keep_latest_k=0)
    ck = stock.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                     states={}, sd_adapter=None, base_folder=os.path.dirname(folder))
    try:
        ck.load(step=K1)
    except ValueError as e:
        return str(e)
    finally:
        ck.close()
    raise AssertionError("torchtitan's CheckpointManager loaded slimopt state without SlimCheckpointManager")


def phase_config(out: str) -> dict:
    from torchtitan.config import ConfigManager

    from slimopt.optim.algorithm.partition import classify
    parsed = {}
    for name in ("llama3_debugmodel_slimopt", "llama3_1b_slimopt", "llama3_8b_slimopt"):
        config = ConfigManager().parse_args(["--module", "slimopt.integrations.torchtitan", "--config", name,
                                             "--optimizer.method", "frugal", "--optimizer.rank", "16",
                                             "--optimizer.lr", "0.002"])
        parsed[name] = {"optimizer": type(config.optimizer).__qualname__, "method": config.optimizer.method,
                        "rank": config.optimizer.rank, "lr": config.optimizer.lr,
                        "update_gap": config.optimizer.update_gap,
                        "checkpoint": type(config.checkpoint).__qualname__, "flavor": config.model_spec.flavor}
    kinds = {n: kind for n, (_, kind) in classify(_build(llama3_debugmodel_slimopt()), None).items()}
    return {"parsed": parsed, "kinds": kinds, "gpu_script": gpu_script_inputs(out), "parts": two_model_parts()}


def two_model_parts() -> dict:
    """Pipeline stages give the container several model parts: one SlimOptimizer each, and one flat state dict
    whose keys do not collide, which loads back into a fresh container (in one process, plain tensors). Each part
    is the model with the other stage's modules removed, as torchtitan's pipeline split leaves them (names stay
    the whole model's)."""
    def parts():
        first, second = _materialise(_build(job_config())), _materialise(_build(job_config()))
        del first.layers["1"]
        first.norm = first.lm_head = None
        del second.layers["0"]
        second.tok_embeddings = None
        return [first, second]

    def step(model_parts, optimizers, seed):
        gen = torch.Generator().manual_seed(seed)
        for part in model_parts:
            for p in part.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
        optimizers.step()

    first = parts()
    optimizers = SlimOptimizersContainer.Config(method="frugal", update_gap=1).build(model_parts=first)
    for s in range(2):
        step(first, optimizers, s)
    flat = optimizers.state_dict()
    again = parts()
    for a, b in zip(first, again):
        b.load_state_dict(a.state_dict())
    loaded = SlimOptimizersContainer.Config(method="frugal", update_gap=1).build(model_parts=again)
    loaded.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in flat.items()})
    step(first, optimizers, 2)
    step(again, loaded, 2)
    diff = max((a - b).abs().max().item() for x, y in zip(first, again)
               for a, b in zip(x.parameters(), y.parameters()))
    return {"optimizers": len(optimizers.optimizers), "state_keys": sum(k.startswith("state.") for k in flat),
            "names": sorted({k.split(".")[1] for k in flat if k.startswith("state.")}), "diff": diff}


def gpu_script_inputs(out: str) -> dict:
    """What benchmarks/torchtitan_gpu.sh hands torchtitan: its options parse, and torchtitan's own tokenizer and
    text loader read the assets slimopt writes (slimopt.integrations.text_assets)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ConfigManager
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from slimopt.integrations.text_assets import write_assets
    tokenizer_dir, text_dir = write_assets(os.path.join(out, "assets"), "kjv", max_chars=200_000)
    options = ["--hf-assets-path", str(tokenizer_dir), "--dataloader.dataset", "c4_test", "--dataloader.dataset-path",
               str(text_dir), "--training.steps", "30", "--training.local-batch-size", "8", "--training.seq-len",
               "2048", "--metrics.log-freq", "5", "--dump-folder", os.path.join(out, "dump")]
    runs = {"torch-adamw": ["--config", "llama3_1b_adamw"], "taco": ["--config", "llama3_1b_slimopt",
                                                                     "--optimizer.method", "taco"]}
    parsed = {}
    for name, args in runs.items():
        config = ConfigManager().parse_args(["--module", "slimopt.integrations.torchtitan", *args, *options])
        parsed[name] = {"optimizer": type(config.optimizer).__qualname__, "flavor": config.model_spec.flavor,
                        "seq_len": config.training.seq_len, "dataset_path": config.dataloader.dataset_path,
                        "method": getattr(config.optimizer, "method", None)}
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64, local_batch_size=2)
    assert isinstance(loader, HuggingFaceTextDataLoader)
    inputs, labels = next(iter(loader))
    return {"runs": parsed, "vocab": tokenizer.get_vocab_size(), "eos": tokenizer.eos_id,
            "batch": list(inputs["input"].shape), "labels": list(labels.shape),
            "max_id": int(inputs["input"].max()), "shifted": bool(torch.equal(inputs["input"][:, 1:], labels[:, :-1]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load", "config"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-norm", type=float, default=1.0,
                    help="gradient clipping; a huge value leaves gradients as they are, so that a run resumed at "
                         "another world size (another order of the norm's sums) stays bit-identical")
    args = ap.parse_args()
    global MAX_NORM
    MAX_NORM = args.max_norm
    torch.set_num_threads(1)
    if args.phase == "config":
        report, world = phase_config(args.out), 1
    else:
        init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        report = (phase_save if args.phase == "save" else phase_load)(args.out, world, rank)
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return
    with open(os.path.join(args.out, f"report_{args.phase}_{world}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
