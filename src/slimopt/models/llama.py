"""Causal language models for pretraining: LLaMA sizes by name, local configs or checkpoints, hub names.

The named sizes are the LLaMA configurations used to compare memory-lean optimizers in GaLore
(Zhao et al., arXiv 2403.03507, appendix) and FRUGAL (Zmushko et al., arXiv 2411.07837): vocabulary 32000
(the t5-base tokenizer), untied input/output embeddings, SwiGLU MLP, RMSNorm, rotary positions. Two tiny sizes
train in seconds on a CPU. Every size builds from a config alone, so nothing is downloaded.

`build_model` resolves, in order: a size name in `LLAMA_SIZES`; ``smollm2-135m`` (``slimopt.models.smollm2``); a
local directory holding a config.json (weights loaded when present, else random init from that config); any other
string is passed to `AutoModelForCausalLM.from_pretrained`, which needs the Hugging Face hub or its local cache.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import transformers

from slimopt.models.hub import from_hub
from slimopt.models.smollm2 import SMOLLM2, load_smollm2

# hidden / intermediate (SwiGLU) / attention heads / layers; vocab 32000 unless the caller passes another.
# "tiny" (~1.5M parameters at vocab 4096) and "small" (~7.5M at vocab 8192, ~20M at 32000) are for CPU runs.
LLAMA_SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_hidden_layers=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_hidden_layers=4),
    "60m": dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_hidden_layers=8),
    "130m": dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_hidden_layers=12),
    "350m": dict(hidden_size=1024, intermediate_size=2736, num_attention_heads=16, num_hidden_layers=24),
    "1b": dict(hidden_size=2048, intermediate_size=5461, num_attention_heads=32, num_hidden_layers=24),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=32),
}
DEFAULT_VOCAB_SIZE = 32000

# Weight files whose presence in a local directory means "load these weights" rather than "init from config".
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _sizes_text() -> str:
    return ", ".join(LLAMA_SIZES)


def llama_config(name: str, vocab_size: int | None = None, seq_len: int = 256, **overrides) -> transformers.LlamaConfig:
    """The `transformers.LlamaConfig` of a named size; `overrides` replace any config field (e.g. eos_token_id)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in LLAMA_SIZES:
        raise ValueError(f"unknown model size {name!r}; built-in sizes are: {_sizes_text()}")
    vocab = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
    if vocab < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if int(seq_len) < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    fields = dict(
        vocab_size=vocab,
        max_position_embeddings=int(seq_len),  # rotary positions: no parameters depend on it
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_cache=False,  # training only; the KV cache would just hold memory
        **LLAMA_SIZES[key],
    )
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def llama_param_count(config: transformers.PretrainedConfig) -> int:
    """Parameters of a LLaMA-architecture model computed from its config alone (no weights allocated)."""
    h = config.hidden_size
    v = config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = h * q_out + 2 * h * kv_out + q_out * h  # q, k, v, o projections
    if attn_bias:
        attn += q_out + 2 * kv_out + h
    mlp = 3 * h * inter  # gate, up, down
    if mlp_bias:
        mlp += 2 * inter + h
    per_layer = attn + mlp + 2 * h  # input and post-attention RMSNorm weights
    embed = v * h
    head = 0 if getattr(config, "tie_word_embeddings", False) else v * h
    return embed + head + config.num_hidden_layers * per_layer + h  # + final norm


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def _init_from_config(config, seed: int, device) -> torch.nn.Module:
    # fork_rng: a deterministic init from `seed` must not disturb the caller's global RNG stream.
    devices = [torch.device(device)] if device is not None and torch.device(device).type == "cuda" else []
    cls = transformers.LlamaForCausalLM if isinstance(config, transformers.LlamaConfig) else None
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)


def _has_weights(path: Path) -> bool:
    return any((path / f).exists() for f in _WEIGHT_FILES)


def build_model(
    name_or_path: str,
    vocab_size: int | None,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> torch.nn.Module:
    """Build a causal LM in training mode.

    name_or_path: a size in LLAMA_SIZES (random init from `seed`), a local directory with config.json (its
    weights when present, else random init), or a Hugging Face model name (needs the hub or its cache).
    vocab_size: the tokenizer's size; None keeps the size's/checkpoint's own. A loaded checkpoint with a smaller
    embedding table than vocab_size is resized (new rows initialised by transformers).
    device: where to allocate (initialising a 1B/7B model on the GPU is much faster than on the CPU).
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a size name ({_sizes_text()}), a local directory or a hub name; "
                         f"got {name_or_path!r}")
    if int(seq_len) < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")

    if name_or_path.lower() in LLAMA_SIZES:
        config = llama_config(name_or_path, vocab_size=vocab_size, seq_len=seq_len)
        model = _init_from_config(config, seed, device)
    elif name_or_path == SMOLLM2:  # pretrained, offline (slimopt.models.smollm2): continued pretraining
        model = load_smollm2()
        if device is not None:
            model = model.to(device)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            if _has_weights(path):
                model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
                if device is not None:
                    model = model.to(device)
            else:
                config = transformers.AutoConfig.from_pretrained(str(path))
                if vocab_size is not None:
                    config.vocab_size = int(vocab_size)
                model = _init_from_config(config, seed, device)
        elif path.exists():
            raise ValueError(f"model path {str(path)!r} exists but is not a directory with a config.json")
        elif _looks_like_path(name_or_path):
            raise FileNotFoundError(f"model path {name_or_path!r} does not exist "
                                    f"(built-in sizes are: {_sizes_text()})")
        else:
            model = _from_hub(name_or_path, dtype, device)
        if vocab_size is not None and model.get_input_embeddings().num_embeddings < int(vocab_size):
            model.resize_token_embeddings(int(vocab_size))
        if getattr(model.config, "max_position_embeddings", None) is not None and \
                model.config.max_position_embeddings < int(seq_len):
            raise ValueError(f"seq_len {seq_len} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")

    model = model.to(dtype=dtype)
    model.train()
    return model


def _looks_like_path(s: str) -> bool:
    # Hub ids are "name" or "org/name"; anything with a leading ./, ~, / or more than one slash is a path.
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or "\\" in s


def _from_hub(name: str, dtype, device) -> torch.nn.Module:
    model = from_hub(
        lambda offline: transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=offline),
        lambda where, err: f"model {name!r} is not a built-in size ({_sizes_text()}), not a local directory with "
                           f"config.json, and could not be loaded from {where}: {err}")
    return model.to(device) if device is not None else model
