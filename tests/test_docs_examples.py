"""The runnable examples of the docs run: the python blocks of README.md, docs/taco.md and docs/offload.md
(standalone programs; the other docs' blocks are fragments of torchrun scripts or of a fine-tuning script), and
the ``>>>`` examples of the public classes' docstrings (doctest)."""

from __future__ import annotations

import doctest
import importlib
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STANDALONE = ("README.md", "docs/taco.md", "docs/offload.md")
DOCTESTED = ("slimopt.optim.optimizer", "slimopt.optim.recipes", "slimopt.optim.layerwise", "slimopt.factory")


def python_blocks(path: str) -> list[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("path", STANDALONE)
def test_markdown_examples_run(path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's example saves a checkpoint into the working directory
    blocks = python_blocks(path)
    assert blocks, f"{path} has no python example"
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path} block {i}", "exec"), {"__name__": "__docs__"})
    if path == "docs/taco.md":  # the example prints its step counts: 8 backward passes, 2 updates
        assert capsys.readouterr().out.strip().endswith("2 8")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("module", DOCTESTED)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0 and result.failed == 0
