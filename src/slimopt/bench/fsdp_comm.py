"""Communication of slimopt's optimizer step under FSDP2: counted in a run, and predicted for any model.

FSDP2 itself all-gathers parameters and reduce-scatters gradients; this module is about what the *optimizer*
adds on top (``slimopt.optim.distributed.sharded``). Volumes are payloads in bytes per rank and call, the size of the
logical tensor a collective produces: an all-reduce of X bytes, an all-gather into X bytes (padding included),
a gather of X bytes at the first rank, a broadcast of X bytes, an all-to-all: what the rank sends to the others
(Muon's owner exchange, the one volume that differs between ranks). With ring algorithms a rank sends about
2 (W - 1) / W of an all-reduce's payload and (W - 1) / W of an all-gather's.

Details: docs/modules.md, ``slimopt.bench.fsdp_comm``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slimopt.optim.algorithm import projectors as P
from slimopt.optim.algorithm import taco
from slimopt.optim.algorithm.rules import ELEMENTWISE_RULES

__all__ = ["CollectiveCounter", "expected_bytes", "muon_owner_bytes", "param_bytes", "split_space", "volume_table"]


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _process_group(group: Any):
    if isinstance(group, torch.ScriptObject):  # how c10d ops carry their process group through the dispatcher
        group = torch.distributed.ProcessGroup.unbox(group)
    return group


def _group_size(group: Any) -> int:
    return _process_group(group).size()


class CollectiveCounter(TorchDispatchMode):
    """Records (op name, payload bytes) of every collective dispatched while active.

    Example::

        with CollectiveCounter() as counter:
            optimizer.step()
        counter.total_bytes(), counter.calls()
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name.startswith(("c10d.", "_c10d_functional.")) and "wait" not in name and "wrap" not in name:
            self.records.append((name.split(".")[-1], self._payload(name, args)))
        return func(*args, **kwargs)

    @staticmethod
    def _payload(name: str, args) -> int:
        if name.endswith(("allgather_", "_allgather_base_", "all_gather_into_tensor")):
            if name.endswith("all_gather_into_tensor"):  # functional: (input, group size, group name)
                return _nbytes(args[0]) * int(args[1])
            return _nbytes(args[0])  # the output (list of) tensor(s)
        if name.endswith("gather_"):  # (outputs at the root, inputs, group, ...): what the root receives
            return _nbytes(args[1]) * _group_size(args[2])
        if name.endswith("alltoall_base_"):  # (output, input, group, output splits, input splits, ...)
            rank = _process_group(args[2]).rank()
            splits = args[4] or [args[1].shape[0] // _group_size(args[2])] * _group_size(args[2])
            per_row = args[1][:1].numel() * args[1].element_size() if args[1].shape[0] else 0
            return per_row * (sum(splits) - splits[rank])  # what this rank sends to the others
        return _nbytes(args[0])

    def total_bytes(self) -> int:
        return sum(b for _, b in self.records)

    def calls(self) -> int:
        return len(self.records)

    def reset(self) -> None:
        self.records.clear()


# ----------------------------------------------------------------------------------------------------------------
# the prediction


def split_space(opt, p, group, world: int) -> tuple[tuple[int, int] | None, int, str | None, int]:
    """(shape of the 2-D tensor the rule runs on, split by its rows over the ranks, or None where it is whole on
    every rank or there is none; the bytes a projection sends a step; side; subspace size r): also what
    ``rank_state`` splits the moments by."""
    layout = opt._layout(p, group)
    if layout in ("none", "block"):
        return (tuple(p.shape) if p.dim() == 2 else None), 0, None, 0
    m, n = p.shape
    side = P.side_for(p.shape, group["proj_side"]) if layout in P.ORTHO_PROJECTORS else None
    r = P.subspace_rank(p.shape, layout, side, group["rank"], group["density"])
    if r == 0:
        return None, 0, side, 0
    if layout in ("svd", "randomized_svd"):
        r = min(r, m, n)  # an SVD-based basis has at most min(m, n) columns
    if side == "left":
        if group["rule"] not in ELEMENTWISE_RULES:  # Muon, TACO: the whole (r, n) sum on every rank
            return None, 4 * r * n, side, r
        # the moments split by the subspace's rows: this rank's rows of the sum (a reduce-scatter into chunk rows),
        # or all of it where FRUGAL's residual needs it (an all-reduce), then the direction's rows all-gathered
        chunk = -(-r // world)
        residual = group["free_rule"] != "none" and r < m
        return (r, n), (4 * r * n if residual else 4 * chunk * n) + 4 * chunk * world * n, side, r
    if layout == "rows":
        return (r, n), 0, side, r
    if layout in P.ORTHO_PROJECTORS:  # a right basis kept in chunks of its n rows, all-gathered for each step
        return (m, r), _basis_size(p) * -(-n // world) * world * r, side, r
    return (m, r), 0, side, r


def _basis_size(p) -> int:
    """Bytes of a basis value: a basis is stored like a bf16 or fp16 weight, else in fp32 (fp64 for fp64)."""
    return 2 if p.dtype in (torch.bfloat16, torch.float16) else 8 if p.dtype == torch.float64 else 4


def param_bytes(opt, p, group: dict[str, Any], world: int, step: int) -> tuple[int, int]:
    """(bytes communicated every step, extra bytes of a refresh) by one parameter's update at optimizer step
    `step`, predicted from its settings and its state *before* that step."""
    if world <= 1:
        return 0, 0
    layout = opt._layout(p, group)
    if layout == "block" and not opt._block_active(p, group, step):
        return 0, 0  # an inactive block takes signSGD on its shard: nothing to send
    space, per_step, side, r = split_space(opt, p, group, world)
    if space is not None:
        rows, cols = space
        if taco.owns(group, space):
            k = group["taco_k"]
            if layout in ("none", "block") and k == 1 and group["fused"] and (
                    p.dtype != torch.bfloat16 or group["param_rounding"] == "nearest"):
                per_step += 16 * cols  # the fast route's keys (float64): candidates and stored entries
            else:
                per_step += 8 * cols if k == 0 else 4 * k * cols + 8 * min(k, rows) * cols
            if k:  # every column's record all-gathered from the ranks' column chunks, packed in bytes
                per_column = taco.state_nbytes((rows, cols), k, group["taco_format"], group["taco_scale_dtype"],
                                               step=False) // cols
                per_step += per_column * -(-cols // world) * world
        else:
            # a factored v's column sums, all-reduced in fp64 (codecs.factored_means): each rank keeps its chunk of
            # the means, and the next step decodes with every mean that all-reduce gave (nothing gathered)
            per_step += 8 * cols * sum(c.name == "factored" for _, c in _codecs(opt, group, space, p.dtype))
        if group["rule"] == "muon" and (not group["fused"] or layout not in ("none", "block")):
            # the eager step's scheme: the rows to orthogonalize all-gathered in the iteration's dtype (the queued
            # one sends rows to owner ranks: expected_bytes counts it over the step's matrices)
            from slimopt.optim.algorithm import muon
            device = torch.device("cuda") if p.device.type == "meta" else p.device
            size = torch.empty((), dtype=muon.iteration_dtype(group["ns_dtype"], device)).element_size()
            per_step += size * world * max(1, -(-rows // world)) * cols
    refresh = 0
    from slimopt.optim.routes.subspace import refresh_phase
    if layout in ("none", "block") or not r or not P.refresh_due(step, group["update_gap"],
                                                                 refresh_phase(opt, p, group)):
        return per_step, refresh
    m, n = p.shape
    chunk = -(-m // world)
    state = opt.state.get(p, {})
    moments = "proj" in state or "proj_index" in state  # a refresh with moments to carry over
    if layout in ("svd", "randomized_svd") and not group["fused"]:
        # the eager reference: the gradient gathered, decomposed on the first rank, the basis broadcast (the fast
        # routes decompose on owner ranks: expected_bytes counts it over the step's refreshes)
        refresh = 4 * world * chunk * n + 8 + 4 * (m if side == "left" else n) * r
    stateful = moments and not taco.owns(group, (r, n)) and any(k in state for k, _ in _codecs(opt, group, (r, n),
                                                                                               p.dtype))
    if side == "right" and layout in P.ORTHO_PROJECTORS and group["on_refresh"] == "project" and stateful:
        refresh += 2 * _basis_size(p) * -(-n // world) * world * r  # the old and new bases gathered to rotate
    if side == "left" and group["on_refresh"] == "project" and stateful:
        refresh += 4 * r * r  # Q_new^T Q_old
        if group["rule"] in ELEMENTWISE_RULES:  # each moment's rows all-gathered (fp32) for the rotation
            refresh += 4 * -(-r // world) * world * n * len(_codecs(opt, group, (r, n), p.dtype))
    if layout == "rows" and group["on_refresh"] == "keep" and stateful:
        counts = _chosen_counts(state["proj_index"], m, world)
        per_moment = 4 * world * max(1, max(counts)) * n
        refresh += per_moment * len(_codecs(opt, group, (r, n), p.dtype))
    return per_step, refresh


def _codecs(opt, group, shape, dtype):
    from slimopt.optim.distributed.sharded import Space, moment_codecs
    return moment_codecs(opt, group, Space(torch.Size(shape), None), dtype)


def _chosen_counts(index: torch.Tensor, m: int, world: int) -> list[int]:
    from slimopt.optim.distributed.sharded import chunk_bounds
    out = []
    for r in range(world):
        s, e = chunk_bounds(m, world, r)
        out.append(int(((index >= s) & (index < e)).sum().item()))
    return out


def refresh_owner_bytes(opt, world: int, step: int, rank: int = 0) -> int:
    """What `rank` sends to the other ranks for the refreshes by owner ranks due at `step`
    (``routes.refresh_batch``): its gradient rows to each matrix's owner, and from each matrix it owns the other
    ranks' rows of a left basis or a whole right basis, with a status value each."""
    from slimopt.optim.distributed.exchange import sent_bytes
    from slimopt.optim.routes import refresh_batch, whole_queue

    if world <= 1:
        return 0
    items = refresh_batch.queued_refreshes(opt, step)
    by_index = {item[1]: item for item in items}
    return sum(sent_bytes([by_index[i][1:] for _, i, _, _ in run], world, rank, status=True)
               for run in whole_queue.runs([item[:4] for item in items], world))


def muon_owner_bytes(opt, world: int, step: int, rank: int = 0) -> int:
    """What `rank` sends to the other ranks for Muon's iterations by owner ranks at `step`
    (``routes.torch.muon_batch``, ``distributed.exchange``): its rows to each matrix's owner, and from each matrix it
    owns the others' rows of the result."""
    from slimopt.optim.distributed.exchange import sent_bytes
    from slimopt.optim.distributed.owners import muon_cost
    from slimopt.optim.routes import whole_queue
    from slimopt.optim.routes.torch import muon_batch

    if world <= 1:
        return 0
    return sum(sent_bytes([(i, (m, n), size, muon_cost(m, n, key[1][2]), (m, n), True)
                           for key, i, (m, n), size in run], world, rank)
               for run in whole_queue.runs(muon_batch.queued_matrices(opt, step), world))


def expected_bytes(opt, world: int, step: int, rank: int = 0) -> tuple[int, int]:
    """(bytes of the optimizer's collectives at `step` apart from refreshes, bytes of the refreshes due at `step`)
    sent by `rank`, for the optimizer's parameters sharded over `world` ranks; call it before that step (a refresh
    that carries moments over costs more than the first one). Only Muon's owner exchange differs between ranks."""
    per_step, refresh = muon_owner_bytes(opt, world, step, rank), refresh_owner_bytes(opt, world, step, rank)
    for group in opt.param_groups:
        for p in group["params"]:
            a, b = param_bytes(opt, p, group, world, step)
            per_step += a
            refresh += b
    return per_step, refresh


def volume_table(size: str = "1b", world: int = 8, methods: dict[str, dict[str, Any]] | None = None,
                 vocab: int = 32000) -> list[dict[str, Any]]:
    """Per method: the optimizer's bytes per step and per refresh for a LLaMA size on `world` ranks, from its
    meta-device parameters (no memory), with the training command's defaults (GaLore rank hidden / 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimopt.factory import make_optimizer
    from slimopt.models.llama import LLAMA_SIZES

    cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **LLAMA_SIZES[size])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    methods = methods or {m: {} for m in ("adamw", "adamw8bit", "ternary_adamw", "frugal", "badam", "signsgd",
                                          "galore", "galore_rsvd", "taco")}
    out = []
    for name, hp in methods.items():
        label, method = (name.split("@", 1)[0], name.split("@", 1)[-1]) if "@" in name else (name, name)
        opt = make_optimizer(model, method, **hp)
        gap = max([g["update_gap"] for g in opt.param_groups if g["projector"] in P.ORTHO_PROJECTORS] or [0])
        steady, _ = expected_bytes(opt, world, 2)
        _, refresh = expected_bytes(opt, world, 1)
        out.append({"method": label, "per_step": steady, "per_refresh": refresh, "update_gap": gap or None,
                    "per_step_amortised": steady + (refresh / gap if gap else 0.0),
                    "params": sum(math.prod(p.shape) for p in model.parameters())})
    return out


# The methods of the LLaMA-1B table in docs/distributed.md: "label@method" runs `method` with the settings.
DOC_METHODS: dict[str, dict[str, Any]] = {
    "adamw": {}, "adamw8bit": {}, "adamw4bit": {}, "frugal": {}, "badam": {}, "signsgd": {},
    "ternary_adamw": {}, "frugal_ternary": {},
    "galore": {}, "galore, proj_side=right@galore": {"proj_side": "right"},
    "galore_rsvd": {}, "galore_rsvd, proj_side=right@galore_rsvd": {"proj_side": "right"},
    "galore rank 128, proj_side=right@galore": {"rank": 128, "proj_side": "right"},
    "galore_rsvd rank 128, proj_side=right@galore_rsvd": {"rank": 128, "proj_side": "right"},
    "taco": {}, "taco, taco_k=0@taco": {"taco_k": 0},
    "muon": {}, "muon8bit": {}, "frugal_muon": {},
}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows of ``volume_table`` as the markdown table of docs/distributed.md (MB = 10^6 bytes)."""
    lines = ["| method | per step (MB) | per refresh (MB) | update gap | per step, refresh amortised (MB) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        gap = r["update_gap"] or "-"
        lines.append(f"| {r['method']} | {r['per_step'] / 1e6:,.1f} | {r['per_refresh'] / 1e6:,.1f} | {gap} | "
                     f"{r['per_step_amortised'] / 1e6:,.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m slimopt.bench.fsdp_comm [size] [world]: the table of docs/distributed.md
    import sys
    size = sys.argv[1] if len(sys.argv) > 1 else "1b"
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(markdown_table(volume_table(size, world, DOC_METHODS)))
