"""How much memory a training step's activations take, from a model config alone.

The planner adds it to weights, gradients and optimizer state to predict a step's peak without building the
model; LLaMA-family decoders get an exact count of what autograd saves.

Details: docs/modules.md, ``slimopt.bench.activations``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LLAMA_LIKE", "ActivationEstimate", "activation_bytes", "check_vocab_slice"]

LLAMA_LIKE = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation memory of one forward pass over a (batch, seq) token block, in bytes.

    saved: what autograd holds at the end of the forward pass (the bulk of the step's peak);
    loss_grad: the loss's temporaries at the start of the backward pass, on top of `saved`;
    head: the part of `saved` that the loss and output layer hold (their backward frees it first);
    recompute: with checkpointing, one decoder layer's activations, rebuilt during its backward (else 0);
    exact: True for the LLaMA-family count, False for the generic estimate; formula: which one was used.
    """

    saved: int
    loss_grad: int
    head: int
    recompute: int
    exact: bool
    formula: str


def _get(config, name: str, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def _dims(config) -> dict[str, int]:
    hidden = _get(config, "hidden_size") or _get(config, "n_embd") or _get(config, "d_model")
    layers = _get(config, "num_hidden_layers") or _get(config, "n_layer") or _get(config, "num_layers")
    heads = _get(config, "num_attention_heads") or _get(config, "n_head")
    if not (hidden and layers and heads):
        raise ValueError(f"cannot estimate activations for model_type={_get(config, 'model_type')!r}: its config "
                         "has no hidden_size / num_hidden_layers / num_attention_heads (or n_embd / n_layer / n_head)")
    inter = _get(config, "intermediate_size") or _get(config, "n_inner") or _get(config, "ffn_dim") or 4 * hidden
    head_dim = _get(config, "head_dim") or hidden // heads
    kv_heads = _get(config, "num_key_value_heads", heads)
    vocab = _get(config, "vocab_size", 0)
    return dict(h=int(hidden), L=int(layers), a=int(heads), i=int(inter), d=int(head_dim), kv=int(kv_heads),
                V=int(vocab))


def llama_layer_bytes(h: int, hq: int, hkv: int, i: int, a: int, e: int) -> int:
    """Saved bytes per token of one LLaMA decoder layer (see the module docstring)."""
    return 8 * h + 8 + 4 * e * h + 2 * e * hq + 2 * e * hkv + 4 * a + 4 * e * i


def check_vocab_slice(vocab_slice: object) -> None:
    """ValueError unless `vocab_slice` is an integer >= 0 (rows of the vocabulary the loss takes at a time)."""
    if isinstance(vocab_slice, bool) or not isinstance(vocab_slice, int) or vocab_slice < 0:
        raise ValueError(f"vocab_slice must be an integer >= 0 (0: the whole logits), got {vocab_slice!r}")


def activation_bytes(config, batch: int, seq: int, elem_size: int, checkpointing: bool = False,
                     has_lm_head: bool = True, body_trains: bool = True, vocab_slice: int = 0) -> ActivationEstimate:
    """Activation bytes of one forward pass of `batch` sequences of `seq` tokens.

    config: a transformers config; elem_size: bytes per activation element (2 for bf16/fp16 models, 4 for fp32);
    checkpointing: one activation checkpoint per decoder layer; has_lm_head: the model computes vocabulary logits
    and a loss over them (causal / masked LM), else only the hidden states; body_trains False: no weight of the
    body trains (a classifier whose head alone does), so only the head's input, the last hidden states, is kept.
    vocab_slice: the loss takes the vocabulary this many rows at a time (``train/vocab_chunked_loss.py``; 0: the
    whole logits): it saves one log-sum-exp per token instead of the log-softmax, and its backward pass holds one
    slice's fp32 logits, softmax and compute-dtype gradient plus the hidden states' fp32 gradient.
    """
    check_vocab_slice(vocab_slice)
    for name, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    if elem_size not in (2, 4):
        raise ValueError(f"elem_size must be 2 (bf16/fp16) or 4 (fp32), got {elem_size!r}")
    if batch == 0 or seq == 0:
        return ActivationEstimate(0, 0, 0, 0, True, "no activations (batch or seq is 0)")
    dims = _dims(config)
    h, L, a, i, d, kv, V = (dims[k] for k in ("h", "L", "a", "i", "d", "kv", "V"))
    e = elem_size
    tokens = batch * seq
    if not body_trains:
        return ActivationEstimate(tokens * h * e, 0, tokens * h * e, 0, True, "frozen body: the head's input only")
    V = V if has_lm_head else 0
    mode = "checkpointed layers" if checkpointing else "no checkpointing"
    model_type = _get(config, "model_type", "")
    sliced = bool(vocab_slice and V)
    # the loss's saved bytes a token (log-softmax and label, or log-sum-exp and label) and its backward's temporaries
    loss_saved = (4 + 8 if sliced else 4 * V + 8) if V else 0
    loss_grad = tokens * ((8 + e) * min(vocab_slice, V) + 4 * h) if sliced else 8 * V * tokens
    mode += ", the loss a vocabulary slice at a time" if sliced else ""
    if model_type in LLAMA_LIKE:
        layer = llama_layer_bytes(h, a * d, kv * d, i, a, e)
        head = (4 * h + 4 + 2 * e * h) + loss_saved  # final norm, head input, the loss's
        per_token = 8 + (L * e * h if checkpointing else L * layer) + head  # 8: the input ids
        saved = tokens * per_token + 2 * e * d * seq + (4 if V else 0)
        return ActivationEstimate(saved, loss_grad, head * tokens, layer * tokens if checkpointing else 0,
                                  True, f"LLaMA exact ({model_type}, SDPA attention, {mode})")
    eager = _get(config, "_attn_implementation", "eager") == "eager"
    layer = (18 * h + 4 * i) * e // 2 + (5 * a * seq * e // 2 if eager else 0)
    head = loss_saved - 8 if V else 0  # the generic count leaves labels out
    per_token = 8 + (L * e * h if checkpointing else L * layer) + head
    formula = (f"generic estimate (Korthikanti et al. 2205.05198; {'eager' if eager else 'fused'} attention, "
               f"{mode})")
    return ActivationEstimate(tokens * per_token, loss_grad, head * tokens,
                              layer * tokens if checkpointing else 0, False, formula)
