"""The model, methods, gradients and comparison rules shared by the FSDP2 workers and tests/test_fsdp.py, and
what every worker does to start (``start_ranks``).

The model has the shapes that exercise every sharded code path at 2 and 4 ranks: right projections (128 x 64),
left ones (64 x 128, 64 x 68), quantization blocks aligned with every shard (64-wide rows) and not (68 x 64 at
2 and 4 ranks, 64 x 68), shards with no rows (3 x 64 and 3-element biases at 4 ranks), 1-D norms and biases.
Gradients are injected (a fixed function of the step and the parameter), so FSDP and one process step on
bit-identical gradients and any difference is the optimizer's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import slimopt
from slimopt.optim.algorithm import projectors as P
from slimopt.optim.distributed import sharded as S

K1, K2 = 3, 3  # steps before the checkpoint, steps after it


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 128, bias=False)  # (128, 64): right projection
        self.down_proj = nn.Linear(128, 64)  # (64, 128): left projection under proj_side="std"
        self.odd = nn.Linear(64, 68, bias=False)  # (68, 64): shards of 34 / 17 rows, blocks cross shard ends
        self.odd_out = nn.Linear(68, 64, bias=False)  # (64, 68): rows of 68, blocks cross rows
        self.tiny = nn.Linear(64, 3)  # (3, 64): at 4 ranks one rank holds no row


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 64)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 64, bias=False)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


# name -> (method, hyperparameters): every recipe, and two mixtures (one parameter group per override) that cover
# the other projectors, rules and codecs. update_gap 2 puts refreshes at steps 1, 3, 5 (K1 + K2 = 6 steps).
GAP = dict(update_gap=2)
MIXED_A = {  # projectors, sides, on_refresh modes and codecs on AdamW
    # eps before the bias correction (galore-torch's placement), large enough to change the step on randn gradients
    r"layers\.0\.q_proj": dict(projector="svd", rank=8, proj_side="right", eps_placement="galore", eps=0.5, **GAP),
    r"layers\.0\.down_proj\.weight": dict(projector="random", rank=8, rule="lion", free_rule="sign",
                                         on_refresh="project", **GAP),
    r"layers\.0\.odd\.weight": dict(projector="columns", density=0.25, free_rule="sign", v_codec="factored", **GAP),
    r"layers\.0\.odd_out": dict(projector="rows", density=0.25, codec="int8", on_refresh="project", free_rule="sign",
                                **GAP),
    r"layers\.1\.q_proj": dict(projector="rows", density=0.25, free_rule="sgd", on_refresh="keep", **GAP),
    r"layers\.1\.odd\.weight": dict(projector="random", rank=8, proj_side="right", codec="bf16_sr", **GAP),
    r"lm_head": dict(rule="sgdm", codec="ternary_ef"),
    # the ternary forms with a mean / rms scale, blocks of 64 and bf16 scales: row-aligned blocks, and blocks that
    # cross rows of 68
    r"layers\.1\.down_proj\.weight": dict(codec="ternary_sr_rms64"),
    r"layers\.1\.odd_out": dict(m_codec="ternary_ef_mean64"),
}
MIXED_B = {  # TACO: the bare direction, a history of 3 (int8, fp32 scales), on a right and a left projection; Lion
    # with int4 state
    r"layers\.0\.q_proj": dict(taco_k=0),
    r"layers\.1\.q_proj": dict(taco_k=3, taco_format="int8", taco_scale_dtype="fp32"),
    r"layers\.0\.odd\.weight": dict(projector="svd", rank=8, proj_side="right", **GAP),
    r"layers\.1\.down_proj\.weight": dict(projector="randomized_svd", rank=8, proj_side="left",
                                         on_refresh="project", **GAP),
    r"embed_tokens": dict(rule="lion", codec="int4"),
}
MIXED_MUON = {  # Muon in subspaces: a row-split right projection, a replicated left one, columns with int8 momentum
    r"layers\.0\.q_proj": dict(projector="svd", rank=8, proj_side="right", **GAP),
    r"layers\.0\.down_proj\.weight": dict(projector="random", rank=8, free_rule="sign", on_refresh="project", **GAP),
    r"layers\.0\.odd\.weight": dict(projector="columns", density=0.25, free_rule="sign", codec="int8", **GAP),
    r"layers\.1\.odd_out": dict(nesterov=False, adjust_lr_fn="original"),
}
CASES: dict[str, tuple[str, dict]] = {
    "adamw": ("adamw", {}),
    "adamw8bit": ("adamw8bit", {}),
    "adamw4bit": ("adamw4bit", {}),
    "ternary_adamw": ("ternary_adamw", {}),
    "signsgd": ("signsgd", {}),
    "frugal": ("frugal", GAP),
    "frugal8bit": ("frugal8bit", GAP),
    "frugal_ternary": ("frugal_ternary", GAP),
    "frugal_rho0": ("frugal_rho0", {}),
    "badam": ("badam", GAP),
    "galore": ("galore", dict(rank=8, **GAP)),
    "galore_rsvd": ("galore_rsvd", dict(rank=8, on_refresh="project", **GAP)),
    "galore8bit": ("galore8bit", dict(rank=8, **GAP)),
    "galore_staggered": ("galore", dict(rank=8, stagger_refresh=True, **GAP)),  # half the matrices at odd steps
    "taco": ("taco", {}),
    "mixed_a": ("adamw", dict(overrides=MIXED_A)),
    "mixed_b": ("taco", dict(overrides=MIXED_B)),
    "muon": ("muon", {}),
    "muon8bit": ("muon8bit", {}),
    "frugal_muon": ("frugal_muon", GAP),
    "mixed_muon": ("muon", dict(overrides=MIXED_MUON)),
}


def build(model: nn.Module, case: str):
    # The sharded step is the eager per-parameter arithmetic on a shard; the one-process twin takes the same
    # (fused=False), so the two can be held to equality. The multi-tensor path equals the eager step to rounding
    # (tests/test_multi_tensor.py).
    method, hp = CASES[case]
    return slimopt.build(model, method, fused=False, **hp)


def gradient(name: str, index: int, shape, step: int) -> torch.Tensor:
    """The injected gradient of parameter `index` at optimizer step `step` (1-based): the same in every process."""
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(tuple(shape), generator=gen)


def set_grads(model: nn.Module, step: int) -> None:
    """Give every parameter its gradient for `step`: whole in one process, this rank's rows under FSDP2."""
    for i, (name, p) in enumerate(model.named_parameters()):
        g = gradient(name, i, p.shape, step)
        if S.is_sharded(p):
            from torch.distributed.tensor import DTensor
            rows = S.rows_of(p)
            p.grad = DTensor.from_local(g[rows.start: rows.stop].clone(), p.device_mesh, p.placements,
                                        run_check=False, shape=p.shape, stride=p.stride())
        else:
            p.grad = g


def run_steps(model: nn.Module, opt, first: int, last: int) -> None:
    for step in range(first, last + 1):
        set_grads(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------------------
# which parameters must match exactly


def exactness(opt, p, group, worlds: tuple[int, ...]) -> str:
    """How a run sharded over each world size in `worlds` (1: one process, or FSDP on one rank) compares with one
    process, for parameter p: "exact" (bit-identical), "rounding" (sums over ranks taken in another order) or
    "noise" (quantization blocks cut differently): the guarantees docs/distributed.md states. Stochastic
    rounding reads the one counter-based stream from each shard's first element: as exact as its blocks."""
    multi = any(w > 1 for w in worlds)
    layout = opt._layout(p, group)
    shape = tuple(p.shape)
    kind = "exact"
    space = shape
    if layout not in ("none", "block"):
        side = P.side_for(p.shape, group["proj_side"]) if layout in P.ORTHO_PROJECTORS else None
        r = P.subspace_rank(p.shape, layout, side, group["rank"], group["density"])
        if r == 0:
            return "exact"
        if layout == "randomized_svd":
            kind = "rounding"  # the range finder's products are sums over ranks (and ordered differently)
        if layout == "random":
            # projectors.random_basis returns QR's column-major Q; the sharded step (and any checkpoint) keeps it
            # row-major, and G Q rounds differently on the two layouts
            kind = "rounding"
        if not multi:
            return kind
        if side == "left":
            return "rounding"  # the all-reduced projection; its moments are replicated
        space = (r, shape[1]) if layout == "rows" else (shape[0], r)
    if not multi or (group["rule"] == "taco" and len(shape) == 2):
        return kind  # TACO's max-loc and candidate merge are exact
    for _, codec in S.moment_codecs(opt, group, S.Space(torch.Size(space), None), torch.float32):
        if codec.name == "factored" and len(space) == 2:
            kind = "rounding"  # column sums over ranks
        size = getattr(codec, "block_size", None)
        row_len = math.prod(space[1:]) if len(space) > 1 else 1
        if size is None or row_len % size == 0:
            continue  # every shard holds whole rows of whole blocks
        if layout == "rows":
            return "noise"  # the chosen rows split unevenly: blocks cut where the draw puts them
        if any(w > 1 and (-(-space[0] // w) * row_len) % size for w in worlds):
            return "noise"
    return kind


def tolerance(kind: str, lr: float, steps: int) -> float:
    return {"exact": 0.0, "rounding": 1e-5, "noise": 20 * lr * steps}[kind]


def compare(ref_params: dict[str, torch.Tensor], model: nn.Module, opt, worlds, lr_steps: int, what: str) -> None:
    """Assert model's (full) parameters equal ref_params under the exactness rule of each parameter."""
    owner = {id(p): g for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        full = p.full_tensor() if S.is_sharded(p) else p.detach()
        group = owner[id(p)]
        kind = exactness(opt, p, group, worlds)
        tol = tolerance(kind, float(group["lr"]), lr_steps)
        diff = (full - ref_params[name]).abs().max().item() if full.numel() else 0.0
        if not diff <= tol:
            raise AssertionError(f"{what}: {name} differs by {diff:.3e} (allowed {tol:.1e}, {kind})")


# ----------------------------------------------------------------------------------------------------------------
# what the workers share


def small_llama(key_value_heads: int = 4):
    """The workers' small LLaMA (hidden 64, MLP 176, 4 heads, vocabulary 128, 2 layers), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                      num_key_value_heads=key_value_heads, num_hidden_layers=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), cloned, by name."""
    return {n: (p.full_tensor() if S.is_sharded(p) else p.detach()).clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of tensors under the same names."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def start_ranks(parser=None):
    """A worker's start: its arguments (--out, and `parser`'s own), one torch thread, gloo, UserWarnings off, a 1-D
    mesh over the ranks. Returns (args, mesh, world, rank); the caller destroys the process group."""
    import argparse
    import datetime
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from slimopt.train.process_group import init_process_group
    init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    return args, init_device_mesh("cpu", (world,)), world, rank


def write_report(out: str, name: str, report: dict, rank: int) -> None:
    """Rank 0 writes `report` to out/name as JSON; every rank waits for it."""
    import json
    import os

    import torch.distributed as dist

    if rank == 0:
        with open(os.path.join(out, name), "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
