"""What a newcomer's first `slimopt compare` runs fell into (issue 43): the machine line's threads, the loss curves'
axes, a variant's bad lr, a variant's lr and a short run's update gap, and TACO in a pretraining comparison."""

from __future__ import annotations

import pytest
from pretrain_helpers import fast_config, write_corpus

from slimopt.train.compare import (
    CompareConfig,
    run_compare,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traps")
    return write_corpus(folder), folder / "cache"


# ------------------------------------------------------------------------------ (6b) the runs' torch threads

def test_the_machine_line_gives_the_threads_the_runs_used(data, tmp_path):
    """The report's machine line said the comparing process's torch threads (one per core), not the runs'."""
    import torch
    corpus, cache = data
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # this process's count, which the runs (--threads 1) do not use
    try:
        cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=2, threads=1), methods=["adamw"],
                            control=False, out=str(tmp_path / "o"), isolate=True, progress=False, plan=None)
        run_compare(cfg, log=lambda *_: None)
    finally:
        torch.set_num_threads(before)
    machine_line = next(line for line in (tmp_path / "o" / "results.md").read_text().splitlines()
                        if "Machine:" in line)
    assert "1 torch thread per run" in machine_line and "3 torch threads" not in machine_line
