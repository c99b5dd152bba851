"""Compressed state in training: every codec trains a tiny model close to fp32 AdamW, and bf16 checkpoints keep
uint8 codes and fp32 scales through load_state_dict with bit-identical continuation."""

import pytest
import torch
from helpers import assert_continues_identically, backward, batches, save_and_load, tiny_llama

import slimopt

# hidden 64: the attention/MLP weights (4096 and 8192 elements) and the embedding are really quantized
MODEL = dict(hidden=64, vocab=64)


def _final_loss(lr=3e-3, **codec):
    model = tiny_llama(**MODEL)
    opt = slimopt.build(model, "adamw", lr=lr, **codec)
    data = batches(4, vocab=64) * 10
    for ids in data:
        loss = backward(model, ids)
        opt.step()
    return loss


@pytest.fixture(scope="module")
def reference():
    loss = _final_loss()
    assert loss < 1.5  # fp32 AdamW memorises the 4 batches: ln(64) = 4.16 -> ~1.06 in 40 steps
    return loss


# Stated tolerances on the final loss, relative to fp32 at lr 3e-3 (measured on 2026-12-01: bf16, int8, int4 and
# int8 m + factored v within 1%; ternary_ef +17%; ternary_sr +64%: a ternary moment is a coarse momentum).
# The default ternary form (rms scale, block 64) clips every moment beyond its block's rms to it, so its steps are
# smaller and it wants about twice AdamW's lr (the tuned comparison of docs/reproduction.md picked 8e-3 against
# AdamW's 4e-3): at 6e-3 it ends +13% here, at AdamW's 3e-3 +97%.
@pytest.mark.parametrize("codec, lr, tol", [
    (dict(codec="bf16"), 3e-3, 0.03), (dict(state_bits=8), 3e-3, 0.03), (dict(state_bits=4), 3e-3, 0.05),
    (dict(m_codec="int8", v_codec="factored"), 3e-3, 0.05), (dict(codec="ternary"), 6e-3, 0.3),
    (dict(codec="ternary_ef"), 3e-3, 0.3), (dict(m_codec="ternary_sr", v_codec="factored"), 3e-3, 1.0),
], ids=["bf16", "int8", "int4", "int8+factored", "ternary", "ternary_ef", "ternary_sr"])
def test_codec_trains_close_to_fp32(codec, lr, tol, reference):
    loss = _final_loss(lr, **codec)
    assert loss < 4.0  # it trains at all
    assert abs(loss - reference) <= tol * reference, (codec, loss, reference)


def test_bf16_checkpoint_keeps_codes_and_scales_and_continues_bit_identically():
    data = batches(8, vocab=64)
    model = tiny_llama(dtype=torch.bfloat16, **MODEL)
    opt = slimopt.build(model, "adamw8bit")
    for ids in data[:4]:
        backward(model, ids)
        opt.step()
    saved = save_and_load({"model": model.state_dict(), "opt": opt.state_dict()})
    clone = tiny_llama(dtype=torch.bfloat16, **MODEL)
    clone.load_state_dict(saved["model"])
    opt2 = slimopt.build(clone, "adamw8bit")
    opt2.load_state_dict(saved["opt"])
    w = clone.model.layers[0].mlp.up_proj.weight
    st = opt2.state[w]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg_scale"].dtype == torch.float32 and st["exp_avg_sq_scale"].dtype == torch.float32
    assert_continues_identically(model, opt, clone, opt2, data[4:])
