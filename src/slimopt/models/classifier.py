"""Sequence classifiers by ``--model`` name, and their tokenizers: what ``slimopt finetune`` trains.

``minilm`` is the offline MiniLM-L6 encoder (``slimopt.models.minilm``), ``smollm2-135m`` the offline SmolLM2
decoder (``slimopt.models.smollm2``); any other name is a local model folder or a Hugging Face name, loaded with
``AutoModelForSequenceClassification`` under the hub policy of ``slimopt.models.hub`` (offline: its local cache
only). Every classifier gets a new head, and a padding token where its tokenizer has none.

Details: docs/modules.md, ``slimopt.models``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from slimopt.models.hub import from_hub, hub_offline
from slimopt.models.minilm import load_offline_classifier, offline_model_path
from slimopt.models.smollm2 import SMOLLM2, load_smollm2, load_smollm2_tokenizer

__all__ = ["OFFLINE_MODEL", "load_tokenizer", "load_classifier"]

OFFLINE_MODEL = "minilm"
"""``--model`` name of the offline MiniLM-L6 encoder (``slimopt.models.minilm.load_offline_classifier``)."""


def _hub_source(name: str) -> tuple[str, bool, bool]:
    """(what to pass to from_pretrained, local files only, is a local folder) for a model name or path."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {name!r} exists but holds no config.json")
        return str(path), True, True
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model path {name!r} does not exist")
    return name, hub_offline(), False


def _from_pretrained(name: str, load: Callable[[str, bool], Any]) -> Any:
    source, offline, local = _hub_source(name)
    return from_hub(
        lambda local_only: load(source, local_only),
        lambda where, err: (
            f"cannot load model {name!r} from {'its folder' if local else where}: {err}. Without network access "
            f"use --model {OFFLINE_MODEL} (the offline MiniLM-L6), {SMOLLM2} (the offline SmolLM2 decoder) or a "
            f"local model folder"),
        offline)


def load_tokenizer(name: str) -> Any:
    """The tokenizer of ``load_classifier(name, ...)``, with a padding token (decoder models lack one)."""
    import transformers

    if name == OFFLINE_MODEL:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(offline_model_path()))
    elif name == SMOLLM2:
        tokenizer = load_smollm2_tokenizer()
    else:
        tokenizer = _from_pretrained(
            name, lambda src, offline: transformers.AutoTokenizer.from_pretrained(src, local_files_only=offline))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_classifier(name: str, num_labels: int, id2label: dict[int, str] | None = None,
                    pad_token_id: int | None = None) -> Any:
    """A ``*ForSequenceClassification`` model with a new head of ``num_labels`` outputs: the offline MiniLM for
    ``"minilm"``, SmolLM2-135M for ``"smollm2-135m"``, else ``AutoModelForSequenceClassification`` from a local
    folder or the Hugging Face hub (offline: only its local cache; a checkpoint with another label count loads
    too)."""
    import transformers

    if name == OFFLINE_MODEL:
        model = load_offline_classifier(num_labels, id2label=id2label)[0]
    elif name == SMOLLM2:
        model = load_smollm2(num_labels, id2label)
    else:
        kwargs: dict[str, Any] = {"num_labels": num_labels, "ignore_mismatched_sizes": True}
        if id2label is not None:
            kwargs.update(id2label=dict(id2label), label2id={v: k for k, v in id2label.items()})
        model = _from_pretrained(name, lambda src, offline: transformers.AutoModelForSequenceClassification
                                 .from_pretrained(src, local_files_only=offline, **kwargs))
    if getattr(model.config, "pad_token_id", None) is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id  # decoder classifiers pool the last token that is not padding
    return model
