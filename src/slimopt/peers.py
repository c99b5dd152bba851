"""Other libraries' memory-lean optimizers, built the way their authors use them, for side-by-side runs.

`slimopt train --method <peer>`, `slimopt compare` and the benchmarks accept these names next to slimopt's own
methods. Each peer is optional: `available_peers()` says which are installed, and `build_peer` raises a clear
ImportError naming the pip package when one is missing.

Details: docs/modules.md, ``slimopt.peers``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slimopt import catalog, peer_logs

if TYPE_CHECKING:
    import torch

__all__ = ["PEERS", "available_peers", "build_peer", "projectable_linear_weights", "optimizer_state_nbytes"]


@dataclass(frozen=True)
class _Peer:
    package: str        # import name checked for availability
    pip: str            # what to pip install


# What each of slimopt.catalog's "peer" names needs installed, in its order (its description and default lr are the
# catalogue's; tests/test_build.py checks that the names agree).
PEERS: dict[str, _Peer] = {
    "torch-adamw": _Peer("torch", "torch"),
    "torch-adamw-fused": _Peer("torch", "torch"),
    "bnb-adamw8bit": _Peer("bitsandbytes", "bitsandbytes"),
    "torchao-adamw8bit": _Peer("torchao.optim", "torchao"),
    "torchao-adamw4bit": _Peer("torchao.optim", "torchao"),
    "galore-torch": _Peer("galore_torch", "galore-torch"),
    "galore-torch-8bit": _Peer("galore_torch", "galore-torch"),
    "apollo": _Peer("apollo_torch", "apollo-torch"),
    "apollo-mini": _Peer("apollo_torch", "apollo-torch"),
}


def available_peers() -> dict[str, str | None]:
    """Peer name -> None when its package is installed here, else what to install.

    Reads the installed packages without importing any (an import of torchao or bitsandbytes takes seconds and
    logs load warnings); a package that is installed but fails to import says so when the peer is built."""
    out: dict[str, str | None] = {}
    for name, peer in PEERS.items():
        top = peer.package.split(".")[0]
        found = importlib.util.find_spec(top) is not None
        out[name] = None if found else f"{peer.pip} is not installed; pip install {peer.pip}"
    return out


def _check_name(name: str) -> None:
    if name not in PEERS:
        raise ValueError(f"unknown peer optimizer {name!r}; known peers: {', '.join(PEERS)}")


def _import(name: str):
    peer = PEERS[name]
    peer_logs.hush()
    try:
        return importlib.import_module(peer.package)
    except Exception as e:
        raise ImportError(f"peer optimizer {name!r} needs the package {peer.pip!r}, which is not usable here "
                          f"({type(e).__name__}: {e}). Install it with: pip install {peer.pip}") from e


def projectable_linear_weights(model: torch.nn.Module, targets: tuple[str, ...] = ("attn", "mlp")
                               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Split trainable parameters the way the GaLore pretraining script does.

    Returns (projected, regular): the weights of `nn.Linear` modules whose qualified name contains one of
    `targets` (attention and MLP projections in LLaMA), and every other trainable parameter once each.
    """
    import torch

    projected: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(t in mod_name for t in targets) and mod.weight.requires_grad:
            if id(mod.weight) not in seen:
                projected.append(mod.weight)
                seen.add(id(mod.weight))
    regular = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            regular.append(p)
            seen.add(id(p))
    if not projected:
        raise ValueError(f"no nn.Linear weight under a module named like {targets} to project: this model does not "
                         f"have the LLaMA-style attention/MLP layout galore-torch and apollo-torch expect")
    return projected, regular


def _default_rank(model: torch.nn.Module, projected: list[torch.nn.Parameter]) -> int:
    # GaLore and APOLLO use a quarter of the hidden size (rank 128 for the 512-wide LLaMA-60m).
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is None:
        hidden = min(min(p.shape) for p in projected)
    return max(1, int(hidden) // 4)


def build_peer(model: torch.nn.Module, name: str, lr: float | None = None, weight_decay: float = 0.0,
               **kw) -> torch.optim.Optimizer:
    """Build peer optimizer `name` over `model`'s trainable parameters.

    lr: None uses the peer's default (`slimopt.catalog.default_lr`: its authors' for pretraining). Extra keywords:
    `betas`, `eps`; for the projected peers `rank` (default hidden_size // 4; APOLLO-Mini 1), `update_gap` (200),
    `scale` (GaLore 0.25, APOLLO 1, APOLLO-Mini 128), `proj_type` ("std").
    """
    import torch

    _check_name(name)
    if lr is None:
        lr = catalog.default_lr(name)
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    common = {k: kw.pop(k) for k in ("betas", "eps") if k in kw}
    if "betas" in common:
        common["betas"] = tuple(common["betas"])
    params = [p for p in model.parameters() if p.requires_grad]

    if name in ("torch-adamw", "torch-adamw-fused"):
        _no_extra(name, kw)
        fused = name.endswith("fused")
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=None if fused else True,
                                 fused=fused or None, **common)
    mod = _import(name)
    if name == "bnb-adamw8bit":
        _no_extra(name, kw)
        return mod.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay, **common)
    if name in ("torchao-adamw8bit", "torchao-adamw4bit"):
        _no_extra(name, kw)
        cls = mod.AdamW8bit if name.endswith("8bit") else mod.AdamW4bit
        return cls(params, lr=lr, weight_decay=weight_decay, **common)

    projected, regular = projectable_linear_weights(model)
    rank = int(kw.pop("rank", 1 if name == "apollo-mini" else _default_rank(model, projected)))
    gap = int(kw.pop("update_gap", 200))
    proj_type = kw.pop("proj_type", "std")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if gap < 1:
        raise ValueError(f"update_gap must be >= 1, got {gap}")
    if name.startswith("galore-torch"):
        scale = float(kw.pop("scale", 0.25))
        _no_extra(name, kw)
        groups = [{"params": regular},
                  {"params": projected, "rank": rank, "update_proj_gap": gap, "scale": scale, "proj_type": proj_type}]
        if name.endswith("8bit"):
            return mod.GaLoreAdamW8bit(groups, lr=lr, weight_decay=weight_decay, **common)
        return mod.GaLoreAdamW(groups, lr=lr, weight_decay=weight_decay, no_deprecation_warning=True, **common)
    # APOLLO (channel-wise scaling, rank r) and APOLLO-Mini (rank 1, one scale per tensor).
    mini = name == "apollo-mini"
    scale = float(kw.pop("scale", 128.0 if mini else 1.0))
    _no_extra(name, kw)
    groups = [{"params": regular},
              {"params": projected, "rank": rank, "proj": "random", "scale_type": "tensor" if mini else "channel",
               "scale": scale, "update_proj_gap": gap, "proj_type": proj_type}]
    return mod.APOLLOAdamW(groups, lr=lr, weight_decay=weight_decay, **common)


def optimizer_state_nbytes(opt: torch.optim.Optimizer) -> int:
    """Bytes held by `opt.state`, for any optimizer, slimopt's or a peer's.

    Counts the storage actually allocated: the inner tensors of quantized tensor subclasses (torchao's 8/4-bit
    states report their logical fp32 size through `numel()`), and tensors kept inside Python objects (galore-torch
    and apollo-torch store their projection matrices in projector objects). Shared storages count once.
    """
    import torch

    seen: set[tuple[int, int]] = set()

    def tensor_bytes(t: torch.Tensor) -> int:
        to_local = getattr(t, "to_local", None)
        if callable(to_local) and type(t).__name__ == "DTensor":
            t = to_local()
        flatten = getattr(t, "__tensor_flatten__", None)
        if callable(flatten) and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            names, _ = flatten()
            return sum(tensor_bytes(getattr(t, n)) for n in names)
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.device.type != "meta" else (id(t), 0)
        if key in seen and key[0] != 0:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes() if t.numel() else 0

    def walk(v, depth: int = 0) -> int:
        if depth > 4:
            return 0
        if isinstance(v, torch.Tensor):
            return tensor_bytes(v)
        if isinstance(v, dict):
            return sum(walk(x, depth + 1) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(walk(x, depth + 1) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return sum(walk(x, depth + 1) for x in vars(v).values())
        return 0

    return sum(walk(st) for st in opt.state.values())


def _no_extra(name: str, kw: dict) -> None:
    if kw:
        raise ValueError(f"peer optimizer {name!r} does not take {', '.join(sorted(kw))}")
