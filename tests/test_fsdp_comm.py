"""The communication table of docs/distributed.md is what `slimopt.bench.fsdp_comm` predicts (the prediction itself
is checked against counted collectives by the torchrun tests), and the prediction's basic facts hold."""

from __future__ import annotations

import os

from slimopt.bench.fsdp_comm import DOC_METHODS, markdown_table, volume_table

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "distributed.md")


def test_the_llama_1b_table_in_the_docs_is_the_prediction():
    rows = volume_table("1b", 8, DOC_METHODS)
    with open(DOCS, encoding="utf-8") as f:
        assert markdown_table(rows) in f.read()
    by = {r["method"]: r for r in rows}
    for name in ("adamw", "adamw8bit", "adamw4bit", "frugal", "badam", "signsgd"):
        assert by[name]["per_step"] == by[name]["per_refresh"] == 0
    # a right projection all-gathers its basis (n x r, kept in chunks of ceil(n / 8) rows) a step: n = 2048 for the
    # attention and up / gate projections, 5461 (683 rows a rank) for down_proj under proj_side="right"
    assert by["galore, proj_side=right"]["per_step"] == 24 * 4 * 512 * (6 * 2048 + 8 * 683)
    # GaLore's left ones (down_proj under "std") reduce-scatter r x n a step into each rank's r / W rows (the
    # payload: its 64 rows) and all-gather the direction's rows (all 512); its six m >= n matrices gather their bases
    assert by["galore"]["per_step"] == 24 * 4 * ((64 + 512) * 5461 + 6 * 2048 * 512)
    assert by["taco, taco_k=0"]["per_step"] == 8 * 24 * (4 * 2048 + 2 * 2048 + 5461)  # one key per column


def test_taco_candidates_do_not_grow_with_the_world_size():
    # the tiny LLaMA's TACO matrices have 128 or 352 columns: 2 to 16 ranks split them evenly, so what a step sends
    # (the keys, and the history's all-gather) is the same; at 64 ranks the gather pads the down projections' 352
    # columns to chunks of 6 (384; 4 bytes a column: uint8 rows of 128, fp8 values, bf16 scales; one a layer, 2)
    sent = {w: volume_table("tiny", w, {"taco": {}})[0]["per_step"] for w in (2, 4, 8, 16, 64)}
    assert len({sent[w] for w in (2, 4, 8, 16)}) == 1 and sent[2] > 0
    assert sent[64] - sent[2] == 2 * 4 * (384 - 352)
