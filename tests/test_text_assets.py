"""The offline assets a torchtitan job reads (slimopt.integrations.text_assets) and the table of its GPU run
(benchmarks/torchtitan_report.py). Neither needs torchtitan; tests/test_torchtitan.py reads the assets with it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from slimopt.integrations.text_assets import main, write_assets
from slimopt.train.data import is_held_out

ROOT = Path(__file__).resolve().parents[1]


def test_the_assets_hold_a_tokenizer_and_the_training_documents_only(tmp_path):
    tokenizer_dir, text_dir = write_assets(tmp_path / "kjv", "kjv", vocab_size=512, max_chars=50_000)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert tokenizer.get_vocab_size() == 512 and tokenizer.token_to_id(config["eos_token"]) is not None
    docs = [json.loads(line)["text"] for line in (text_dir / "train.jsonl").read_text().splitlines()]
    assert 50_000 <= sum(map(len, docs)) < 50_000 + max(map(len, docs))
    assert not any(is_held_out(d) for d in docs)
    assert sorted(p.name for p in (tmp_path / "kjv").iterdir()) == ["text", "tokenizer"]  # nothing staged is left


def test_existing_asset_folders_and_a_bad_budget_are_refused(tmp_path, capsys):
    main(["--data", "kjv", "--out", str(tmp_path), "--vocab-size", "512", "--max-chars", "1000"])
    assert "tokenizer:" in capsys.readouterr().out
    with pytest.raises(FileExistsError, match="tokenizer exists"):
        write_assets(tmp_path, "kjv", vocab_size=512)
    with pytest.raises(ValueError, match="max_chars must be positive"):
        write_assets(tmp_path / "other", "kjv", max_chars=0)


def _report_module():
    spec = importlib.util.spec_from_file_location("torchtitan_report", ROOT / "benchmarks" / "torchtitan_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(step: int, loss: float, gib: float, tps: int) -> str:
    # torchtitan 0.3.0's MetricsProcessor.log line, colours included
    return (f"[rank0]:[titan] 2026-12-03 INFO - \x1b[31mstep: {step:2}  \x1b[32mloss: {loss:8.5f}  \x1b[33mgrad_norm: "
            f" 1.2345  \x1b[36mmemory: {gib:5.2f}GiB(9.10%)  \x1b[34mtps: {tps:,}  \x1b[36mtflops: 123.45  "
            f"\x1b[35mmfu: 12.34%\x1b[39m")


def test_the_torchtitan_report_reads_torchtitans_log_lines(tmp_path):
    report = _report_module()
    (tmp_path / "torch-adamw.log").write_text("\n".join([_line(1, 11.9, 30.5, 1_000), _line(5, 9.5, 31.0, 20_000),
                                                         _line(10, 8.25, 30.9, 22_000)]))
    (tmp_path / "taco.log").write_text("\n".join([_line(1, 11.9, 20.0, 900), _line(5, 9.9, 21.5, 11_000),
                                                  "\x1b[33mvalidate step:  5  loss:  9.0000  memory: 99.00GiB(1%)"
                                                  "  tps: 5", _line(10, 8.5, 21.0, 33_000)]))
    failed = "Traceback (most recent call last):\nRuntimeError: CUDA error: out of memory\n"
    (tmp_path / "frugal.log").write_text(failed)
    report.main([str(tmp_path), "--md", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json")])
    rows = {r["run"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert rows["torch-adamw"] == {"run": "torch-adamw", "logged_steps": 3, "step": 10, "loss": 8.25,
                                   "tokens_per_s": 21_000, "peak_reserved_gib": 31.0}
    assert rows["taco"]["tokens_per_s"] == 22_000 and rows["taco"]["peak_reserved_gib"] == 21.5
    assert rows["frugal"]["failed"] == "RuntimeError: CUDA error: out of memory"
    table = (tmp_path / "t.md").read_text().splitlines()
    assert table[2].startswith("| torch-adamw | 10 | 8.2500 | 21,000 | 1.00 | 31.00 |")
    assert "| taco | 10 | 8.5000 | 22,000 | 1.05 | 21.50 |" in table
