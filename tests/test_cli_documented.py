"""Every `slimopt` command line the documentation shows is run.

The documented invocations are read from README.md, docs/**/*.md and each subcommand's --help text (description
and examples). Each one is a subcommand and the set of options it passes; ``CASES`` holds one runnable case per
such set, written as the documentation writes it, plus the cases without optional arguments (and with the ones
no example shows). ``test_every_documented_invocation_has_a_case`` fails when an invocation is documented that no
case runs.

Each case runs in-process through ``slimopt.cli.main`` in a fresh working directory, so relative paths in the
docs (``--out mem/``, ``./my-model``, ``./glue_data``, ``./t5-base``) are used as written: the case creates the
local files they name (a model config, GLUE-style data, a tokenizer folder, a jsonl corpus). To keep the file
fast on a 2-core CPU, a case scales the run down: it replaces some documented values (a LLaMA size by ``tiny``,
``roberta-base`` by a tiny local BERT, steps, tokens and sample counts by a few) and adds options of the same
command that only shrink the run (``--vocab-size``, ``--seq-len``, ``--max-steps``, ``--refresh-shape``,
``--in-process``, ...). The documented options themselves are always passed. ``--device cuda`` runs on the CPU
when there is no GPU, after checking that the CUDA request is refused with one clear line.

Not repeated here: what tests/test_planner.py, test_bench.py, test_compare.py, test_finetune_cli.py and
test_train_loop.py check about the numbers; here each documented command must finish with status 0 and write
what it promises.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import itertools
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from helpers import run_cli, save_tiny_bert, sentences

from slimopt.cli import SUBCOMMANDS, build_parser

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()

# ------------------------------------------------------------------------------------------------------------
# the documented invocations


_COMMAND = re.compile(r"(?<![\w/.-])slimopt\s+(" + "|".join(SUBCOMMANDS) + r")\b([^`\n#|&;]*)")


def _commands(text: str, markdown: bool) -> list[tuple[str, list[str]]]:
    """(subcommand, arguments) of every `slimopt SUB ...` in `text`: fenced or indented lines (with backslash
    continuations) and inline code spans (which may wrap onto the next line). Prose like "# slimopt compare: tiny
    on kjv" is no invocation: what follows the subcommand must be empty or start with an option."""
    text = re.sub(r"\\[ \t]*\n", " ", text)
    if markdown:  # an inline code span that wraps: join its lines
        text = re.sub(r"(?<!`)`([^`]+)`(?!`)", lambda m: "`" + m.group(1).replace("\n", " ") + "`", text)
    out = []
    for m in _COMMAND.finditer(text):
        rest = m.group(2).replace("...", " ").strip()
        if rest and not rest.startswith("--"):
            continue
        out.append((m.group(1), shlex.split(rest)))
    return out


def _help_texts() -> list[tuple[str, str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [(f"slimopt {name} --help", f"{p.description or ''}\n{p.epilog or ''}") for name, p in sub.choices.items()]


def documented() -> dict[tuple, list[str]]:
    """{key: [where it is documented, ...]} over README.md, docs/**/*.md and the --help texts."""
    found: dict[tuple, list[str]] = {}
    sources = [(str(p.relative_to(ROOT)), p.read_text(), True)
               for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]]
    sources += [(where, text, False) for where, text in _help_texts()]
    for where, text, markdown in sources:
        for sub, argv in _commands(text, markdown):
            found.setdefault(key(sub, argv), []).append(f"{where}: slimopt {sub} {' '.join(argv)}".rstrip())
    return found


def key(sub: str, argv: list[str]) -> tuple:
    """A subcommand and the options it passes. --out only says where the files go: every subcommand that writes
    files has cases with and without it (``test_out_with_and_without``)."""
    return (sub, frozenset(a for a in argv if a.startswith("--")) - {"--out"})


# ------------------------------------------------------------------------------------------------------------
# the cases


@dataclass
class Case:
    """One invocation as documented (`doc`), scaled down: `replace` gives documented options new values, `add`
    appends options the documented line does not pass. `files`: local files to create first (see ``Resources``).
    `then`: a second documented invocation that runs after the first in the same folder. `xfail`: why a `then`
    invocation is known to fail (the test checks that it still does)."""

    id: str
    doc: str
    replace: dict[str, str] = field(default_factory=dict)
    add: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    check: Callable | None = None
    slow: bool = False
    then: "Case | None" = None
    xfail: str | None = None

    @property
    def sub(self) -> str:
        return shlex.split(self.doc)[1]

    @property
    def doc_args(self) -> list[str]:
        return shlex.split(self.doc)[2:]

    def argv(self) -> list[str]:
        args = list(self.doc_args)
        for flag, value in self.replace.items():
            assert flag in args, f"{self.id}: {flag} is not in the documented line"
            i = args.index(flag) + 1
            if i < len(args) and not args[i].startswith("--"):
                args[i] = value
            else:  # an option documented without its optional value (--check-planner)
                args.insert(i, value)
        if not HAS_CUDA and "--device" in args and args[args.index("--device") + 1].startswith("cuda"):
            args[args.index("--device") + 1] = "cpu"
        for a in self.add:
            assert not a.startswith("--") or a not in args, f"{self.id}: {a} is documented; use replace"
        return [self.sub, *args, *self.add]


# Options that only shrink a run (each command's own): a LLaMA-pretraining run of 2 steps of 8 x 32 tokens with
# a 512-token BPE; a fine-tuning run of 1 step of 4 examples; a benchmark of 1 step and a small refresh matrix.
TRAIN_SMALL = ("--vocab-size", "512", "--seq-len", "32", "--batch-size", "8", "--eval-tokens", "512")
TRAIN_STEPS = ("--max-steps", "2")
TRAIN_QUIET = ("--threads", "1", "--no-progress")
FT_SMALL = ("--max-train-samples", "8", "--max-eval-samples", "8", "--max-length", "16", "--batch-size", "4")
BENCH_REFRESH = ("--refresh-shape", "48x80", "--refresh-rank", "8")
# a documented SmolLM2 comparison as the tests run it: the tiny LLaMA, short blocks, 2 steps
SMOLLM2_AS_TINY = {"--model": "tiny", "--seq-len": "32", "--max-steps": "2", "--eval-tokens": "512"}
# Over every method a benchmark takes half a minute even on a tiny model (each method's gc.collect in a process
# that has imported transformers costs a few tenths of a second): a 1.2 s budget runs the first method or two and
# gives the others their "skipped" row (test_bench.py runs every method).
BENCH_MINUTES = "0.02"


def _small(doc_args: list[str], small: tuple[str, ...]) -> tuple[str, ...]:
    """`small` less the options the documented line passes itself (their values are replaced instead)."""
    out, it = [], iter(range(len(small)))
    for i in it:
        if small[i].startswith("--") and small[i] in doc_args:
            if i + 1 < len(small) and not small[i + 1].startswith("--"):
                next(it)
            continue
        out.append(small[i])
    return tuple(out)


def train_case(id, doc, replace=None, add=(), steps=True, **kw) -> Case:
    args = shlex.split(doc)[2:]
    extra = _small(args, TRAIN_SMALL + (TRAIN_STEPS if steps and "--tokens" not in args else ()) + TRAIN_QUIET)
    return Case(id, doc, replace or {}, extra + tuple(add), check=kw.pop("check", check_train), **kw)


def compare_case(id, doc, replace=None, add=(), **kw) -> Case:
    args = shlex.split(doc)[2:]
    extra = _small(args, TRAIN_SMALL + (() if "--tokens" in args else TRAIN_STEPS) + ("--no-progress",))
    return Case(id, doc, replace or {}, extra + ("--in-process",) + tuple(add), check=check_compare, **kw)


def finetune_case(id, doc, replace=None, add=(), **kw) -> Case:
    args = shlex.split(doc)[2:]
    replace = dict(replace or {})
    adding = list(add)
    if "--model" in args:
        replace.setdefault("--model", "./tiny-bert")
    else:
        adding += ["--model", "./tiny-bert"]
    if "--epochs" not in args and "--max-steps" not in args:
        adding += ["--max-steps", "1"]
    extra = _small(args, FT_SMALL + ("--threads", "1"))
    return Case(id, doc, replace, extra + tuple(adding), files=("tiny-bert", *kw.pop("files", ())),
                check=check_finetune, **kw)


def bench_case(id, doc, replace=None, add=(), **kw) -> Case:
    args = shlex.split(doc)[2:]
    replace = {"--steps": "1", "--warmup": "0", **({"--model": "tiny"} if "--model" in args else {}),
               **(replace or {})}
    replace = {k: v for k, v in replace.items() if k in args}
    extra = ("--steps", "1", "--warmup", "0") if "--steps" not in args else ()
    if "--max-minutes" in args:
        replace.setdefault("--max-minutes", BENCH_MINUTES)
    elif "--methods" not in args:
        extra += ("--max-minutes", BENCH_MINUTES)
    if "--model" not in args:
        extra += ("--model", "tiny")
    if "--vocab-size" not in args:  # 32000 by default: most of a tiny model, and MemTracker counts it slowly
        extra += ("--vocab-size", "512")
    if "--no-refresh" not in args:
        extra += BENCH_REFRESH
    if "--check-planner" in args and "--batch" not in args:
        extra += ("--batch", "2", "--seq", "16")
    return Case(id, doc, replace, extra + tuple(add), check=check_bench, **kw)


# ------------------------------------------------------------------------------------------------------------
# what each command must have done


def _flag(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def check_memory(argv, rc, out, err, cwd):
    from slimopt.bench.planner import planner_methods

    assert rc == 0, err
    assert out.startswith("## Planned memory: "), out
    method = _flag(argv, "--method", "all")
    methods = planner_methods() if method == "all" else method.split(",")
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = list(itertools.takewhile(lambda line: line.startswith("| "), lines[first:]))  # the first table
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in table[2:]}
    assert list(rows) == methods
    assert header[:8] == ["method", "state B/param", "weights", "grads", "opt. state", "projections",
                          "activations", "peak"]
    for cells in rows.values():
        assert float(cells[7]) > 0  # the peak
    if "--gpu-memory" in argv:  # the verdict for every method
        assert header[8].startswith("fits ")
        assert all(cells[8] == "yes" or cells[8].startswith("no (+") for cells in rows.values())
    seq = "--seq" in argv
    if seq:
        assert "Activations: LLaMA exact" in out and all(cells[6] != "-" for cells in rows.values())
        if "--gpu-memory" in argv:
            assert header[-1] == "max batch" and all(cells[-1].isdigit() for cells in rows.values())
    else:
        assert "Activations: left out (no --seq)" in out and all(cells[6] == "-" for cells in rows.values())
    if "--layerwise" in argv and _flag(argv, "--offload", "none") == "none":
        assert "layer-wise updates" in out.splitlines()[0]
    if _flag(argv, "--offload", "none") == "host":  # the device / host / PCIe table and the host's verdict
        assert "Device, host and PCIe per step" in out and "| PCIe / step |" in out
        assert any(line.startswith("Host memory: ") for line in lines)
    elif _flag(argv, "--weights", "dtype") == "int8":
        assert "int8 weights" in lines[0] and "Device (GiB" in out
    if "--out" in argv:
        folder = cwd / _flag(argv, "--out")
        data = json.loads((folder / "memory.json").read_text())
        assert [p["method"] for p in data["plans"]] == methods
        assert (folder / "memory.md").read_text() in out
        assert (folder / "memory.png").stat().st_size > 10_000


def check_memory_needs_model(argv, rc, out, err, cwd):
    assert rc == 2 and "the following arguments are required: --model" in err, err


def check_methods(argv, rc, out, err, cwd):
    from slimopt.catalog import known_methods

    assert rc == 0, err
    kind = _flag(argv, "--kind", "all")
    names = [n for n, (k, _) in known_methods().items() if kind in ("all", k)]
    listed = [line.split()[0] for line in out.splitlines()[2:] if line and not line.startswith(" ")]
    assert listed[:len(names)] == names


def check_train(argv, rc, out, err, cwd):
    assert rc == 0, err
    method = _flag(argv, "--method", "adamw")
    assert re.search(rf"^{re.escape(method)}: \d+ steps, [\d,]+ tokens \| val loss \d", out, re.M), out
    if "--out" in argv:
        folder = cwd / _flag(argv, "--out")
        log = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert log[0]["event"] == "config" and log[-1]["event"] == "final"
        assert log[-1]["steps"] > 0 and log[-1]["val_loss"] > 0
        if "--save-every" in argv:
            assert (folder / ("checkpoint.dcp" if "--fsdp" in argv else "checkpoint.pt")).exists()
        if "--no-save-model" not in argv:
            assert (folder / "final" / "config.json").is_file()
    if "--fsdp" in argv:  # the one-process group it made is gone
        assert not torch.distributed.is_initialized()


def check_compare(argv, rc, out, err, cwd):
    from slimopt.compare.report import read_results

    assert rc == 0, err
    folder = cwd / _flag(argv, "--out", "runs/compare")
    rows = read_results(folder / "results.csv")
    if "--methods" in argv:  # in the order given (a control row may come with them)
        asked = _flag(argv, "--methods").split(",")
        assert [r["method"] for r in rows if r["method"] in asked] == asked
    assert rows and all(r["status"] == "ok" for r in rows), [(r["method"], r["status"]) for r in rows]
    for name in ("results.md", "loss_curves.png", "memory.png"):
        assert (folder / name).stat().st_size > 0
    if "--no-control" in argv:
        assert "frozen" not in [r["method"] for r in rows]
    if "--tune-lr" in argv:  # one short run per method and multiplier of its lr, and each extension past an edge
        sweep = (folder / "lr_sweep.csv").read_text().splitlines()
        from slimopt.cli.honest import parse_lr_grid
        from slimopt.compare.config import DEFAULT_CONTROL_LR_GRID
        from slimopt.compare.protocol import DEFAULT_LR_EXTENSIONS
        extensions = int(_flag(argv, "--lr-extensions")) if "--lr-extensions" in argv else DEFAULT_LR_EXTENSIONS
        grid = len(parse_lr_grid(_flag(argv, "--lr-grid"))) if "--lr-grid" in argv else None
        control_grid = (len(parse_lr_grid(_flag(argv, "--control-lr-grid"))) if "--control-lr-grid" in argv
                        else len(DEFAULT_CONTROL_LR_GRID))  # the control sweeps a grid of its own
        for r in rows:
            tried = [line for line in sweep[1:] if line.split(",")[0] == r["method"]]
            expected = control_grid if r["method"] == "frozen" else grid
            assert tried and (expected is None or expected <= len(tried) <= expected + extensions), (r["method"],
                                                                                                     sweep)
    if "--seeds" in argv:
        per_seed = (folder / "results_per_seed.csv").read_text().splitlines()
        assert len(per_seed) - 1 == len(rows) * int(_flag(argv, "--seeds"))
    for i, a in enumerate(argv):
        if a == "--set":  # METHOD.KEY=VALUE shows in that method's settings; an lr is the centre of its grid
            m, setting = argv[i + 1].split(".", 1)
            row = next(r for r in rows if r["method"] == m)
            if setting.startswith("lr="):
                assert row["lr_source"] == "--set" or "of --set " in row["lr_source"], row["lr_source"]
            else:
                assert setting in row["settings"]


def check_finetune(argv, rc, out, err, cwd):
    from slimopt.finetune.run import read_results

    assert rc == 0, err
    folder = cwd / _flag(argv, "--out", "slimopt-finetune")
    rows = read_results(folder / "results.csv")
    tasks = _flag(argv, "--tasks", "bbc").split(",")
    methods = _flag(argv, "--methods", "adamw,galore,frugal,lora").split(",")
    methods = (["head"] if "--no-control" not in argv and "head" not in methods else []) + methods
    assert [(r["task"], r["method"]) for r in rows] == [(t, m) for t in tasks for m in methods]
    assert all(r["status"] == "ok" for r in rows), [(r["task"], r["method"], r["status"]) for r in rows]
    assert (folder / "results.md").is_file() and (folder / "config.json").is_file()


def check_bench(argv, rc, out, err, cwd):
    assert rc == 0, err
    table = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    methods = _flag(argv, "--methods", "all")
    if methods != "all":
        assert set(methods.split(",")) <= set(table)
    ok = ("ok", "not installed", "needs CUDA", "skipped")
    if "--out" in argv:
        folder = cwd / _flag(argv, "--out")
        data = json.loads((folder / "bench.json").read_text())
        assert data["rows"][0]["status"] == "ok"
        if methods != "all":
            assert [r["method"] for r in data["rows"]] == methods.split(",")
        assert all(r["status"].startswith(ok) for r in data["rows"]), [(r["method"], r["status"])
                                                                     for r in data["rows"]]
        assert (folder / "bench.md").is_file() and (folder / "bench.png").stat().st_size > 10_000
    if "--check-planner" in argv:  # the planner against a real training step, one row per method
        assert "Planner against a real training step" in out
        section = out.split("Planner against a real training step")[1].split("Goals")[0]
        rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
        assert rows and all(re.match(r"\| \S+ \| \d+x\d+ \| (\d|not installed|needs CUDA)", r) for r in rows), rows


# ------------------------------------------------------------------------------------------------------------
# the table


CASES = [
    # --- memory: a model config only, nothing allocated; the documented sizes are kept
    Case("memory-bare", "slimopt memory", check=check_memory_needs_model),  # named in prose; --model is required
    Case("memory-model-only", "slimopt memory --model 7b", check=check_memory),
    # docs/reproduction.md: SmolLM2's planned peaks at the KJV table's batch (its architecture, no file needed)
    Case("memory-smollm2-fp32", "slimopt memory --model smollm2-135m --batch 8 --seq 64 --dtype fp32",
         check=check_memory),
    Case("memory-no-seq", "slimopt memory --model 7b --method adamw", check=check_memory),
    Case("memory-no-seq-budget", "slimopt memory --model 7b --method adamw --gpu-memory 24GiB", check=check_memory),
    Case("memory-all-budget", "slimopt memory --model 7b --method all --gpu-memory 24GiB --batch 1 --seq 256",
         check=check_memory),
    # every method on 7B takes seconds: the runs that also draw the chart plan the 60M model
    Case("memory-all-budget-out", "slimopt memory --model 7b --method all --gpu-memory 24GiB --batch 1 --seq 256 "
         "--out mem/", replace={"--model": "60m"}, check=check_memory),
    Case("memory-all-layerwise-out", "slimopt memory --model 7b --method all --gpu-memory 24GiB --batch 1 "
         "--seq 256 --layerwise --out docs/bench/memory-7b", replace={"--model": "60m"}, check=check_memory),
    Case("memory-layerwise", "slimopt memory --model 7b --method adamw,adamw8bit,galore8bit --layerwise --batch 1 "
         "--seq 256 --out mem/", check=check_memory),
    Case("memory-peers", "slimopt memory --model 7b --method torch-adamw-fused,bnb-adamw8bit --batch 1 --seq 1024",
         check=check_memory),
    Case("memory-galore-peers-layerwise", "slimopt memory --model 7b --method galore-torch-8bit,galore8bit "
         "--layerwise --batch 1 --seq 256", check=check_memory),
    Case("memory-local-config-layerwise", "slimopt memory --model ./my-model --method galore,frugal "
         "--set galore.rank=256 --layerwise --seq 2048", files=("my-model",), check=check_memory),
    Case("memory-local-config-budget", "slimopt memory --model ./my-model --method galore,frugal "
         "--set galore.rank=256 --gpu-memory 80GB --seq 2048", files=("my-model",), check=check_memory),
    # the line a comparison's results.md gives for its planned columns
    Case("memory-compare-plan", "slimopt memory --model 7b --method adamw --dtype bf16 --batch 1 --seq 256 "
         "--layerwise --gpu-memory 24GiB", check=check_memory),
    # ... and for a comparison whose first row holds int8 weights on a host master
    # (docs/results/compare-smollm2-kjv-int8-embeddings)
    Case("memory-compare-plan-int8", "slimopt memory --model smollm2-135m --method adamw --dtype bf16 --batch 1 "
         "--seq 256 --layerwise --gpu-memory 24GiB --weights int8 --offload host", check=check_memory),
    # ... and for a row run with --set (docs/results/compare-smollm2-kjv-galore)
    Case("memory-compare-plan-set", "slimopt memory --model 7b --method galore --dtype bf16 --batch 1 --seq 256 "
         "--layerwise --gpu-memory 24GiB --set galore.update_gap=8", check=check_memory),
    Case("memory-1b-all", "slimopt memory --model 1b --method all --batch 8 --seq 512", check=check_memory),
    Case("memory-7b-16gb", "slimopt memory --model 7b --method frugal_head,frugal_rho0,taco,signsgd,galore8bit,"
         "galore-torch-8bit --layerwise --checkpointing --batch 1 --seq 1024 --gpu-memory 16GB", check=check_memory),
    # issue 46: int8 weights on the device, the master copy and the state on the host (docs/benchmarks.md, section 7)
    Case("memory-int8-host-plain", "slimopt memory --model 7b --method galore8bit --weights int8 --offload host "
         "--checkpointing --batch 1 --seq 2048", check=check_memory),
    Case("memory-int8-host", "slimopt memory --model 7b --method galore8bit,frugal_head --weights int8 --offload host "
         "--master bf16+int8 --checkpointing --batch 1 --seq 2048 --gpu-memory 8GiB", check=check_memory),
    Case("memory-int8-host-sliced", "slimopt memory --model 8b --method galore8bit,frugal_head --weights int8 "
         "--offload host --master bf16+int8 --checkpointing --batch 1 --seq 2048 --vocab-slice 8192 "
         "--gpu-memory 10GiB", check=check_memory),
    Case("memory-bf16-host", "slimopt memory --model 7b --method torch-adamw-fused --offload host --master bf16 "
         "--checkpointing --batch 1 --seq 2048", check=check_memory),
    Case("memory-int8-device", "slimopt memory --model 7b --method galore8bit --weights int8 --layerwise "
         "--checkpointing --batch 1 --seq 2048", check=check_memory),
    Case("memory-fsdp-ranks", "slimopt memory --model 1b --method adamw8bit,galore,taco --fsdp-ranks 64",
         check=check_memory),
    Case("memory-undocumented-options", "slimopt memory --model tiny --method frugal,badam --dtype fp32 "
         "--checkpointing --step 1 --vocab-size 1000 --batch 2 --seq 64", check=check_memory),
    # --- methods
    Case("methods", "slimopt methods", check=check_methods),
    Case("methods-kind", "slimopt methods --kind peer", check=check_methods),
    # --- train: the built-in KJV corpus, a 512-token BPE cached for the whole module, 2 steps
    train_case("train", "slimopt train"),
    train_case("train-out", "slimopt train --method frugal --out runs/frugal"),
    train_case("train-int8-host", "slimopt train --weights int8 --offload host --master fp32"),
    train_case("train-int8-host-default-master", "slimopt train --weights int8 --offload host"),
    train_case("train-tokens", "slimopt train --method galore --tokens 2e6 --out runs/galore",
               replace={"--tokens": "512"}),
    train_case("train-save-then-resume",
               "slimopt train --method frugal --density 0.25 --update-gap 200 --save-every 100 --out runs/frugal",
               replace={"--save-every": "1"},
               then=train_case("resume", "slimopt train --method frugal --density 0.25 --update-gap 200 "
                               "--out runs/frugal --resume")),
    # docs/results/compare-kjv/results.md (compare-bbc/results.md: the same with --data bbc, run below)
    train_case("train-reproduce-row", "slimopt train --model tiny --data kjv --seq-len 64 --batch-size 16 "
               "--max-steps 128 --vocab-size 2048 --seed 0 --dtype fp32 --eval-tokens 8192 --method METHOD",
               replace={"--seq-len": "32", "--batch-size": "8", "--max-steps": "2", "--vocab-size": "512",
                        "--eval-tokens": "512", "--method": "adamw"}),
    # docs/results/compare-kjv-v512/results.md: results written since the lr column can hold a tuned lr
    train_case("train-reproduce-row-lr", "slimopt train --model tiny --data kjv --seq-len 64 --batch-size 16 "
               "--max-steps 512 --vocab-size 512 --seed 0 --dtype fp32 --eval-tokens 8192 --method METHOD --lr LR",
               replace={"--seq-len": "32", "--batch-size": "8", "--max-steps": "2", "--eval-tokens": "512",
                        "--method": "adamw", "--lr": "1e-3"}),
    train_case("train-local-jsonl-tokenizer", "slimopt train --model 60m --data ./c4-shard.jsonl "
               "--tokenizer ./t5-base --dtype bf16-autocast --batch-size 512 --grad-accum 4 --tokens 1.1e9 "
               "--method frugal --device cuda", files=("c4-shard.jsonl", "t5-base"),
               replace={"--model": "tiny", "--batch-size": "8", "--tokens": "512"}),
    train_case("train-hf-json", "slimopt train --model 60m --data hf:json:/data/c4/*.json.gz --tokenizer ./t5-base "
               "--dtype bf16-autocast --batch-size 512 --grad-accum 2 --tokens 1.1e9 --method frugal "
               "--save-every 1000 --out runs/frugal-60m", files=("c4/*.json.gz", "t5-base"),
               replace={"--model": "tiny", "--data": "hf:json:./c4/*.json.gz", "--batch-size": "8",
                        "--tokens": "512", "--save-every": "1"}),
    # continued pretraining of the offline SmolLM2 (tests/test_pretrained.py loads it): here the tiny LLaMA
    train_case("train-model", "slimopt train --model smollm2-135m", replace={"--model": "tiny"}),
    train_case("train-fsdp", "slimopt train --fsdp"),
    train_case("train-fsdp-model", "slimopt train --fsdp --model 1b --method galore", replace={"--model": "tiny"}),
    train_case("train-fsdp-save", "slimopt train --fsdp --model 1b --method galore --opt proj_side=right "
               "--save-every 500 --out runs/galore-fsdp", replace={"--model": "tiny", "--save-every": "1"}),
    # --- compare: methods in this process (test_compare.py runs them each in its own), 2 steps
    compare_case("compare", "slimopt compare", slow=True),
    compare_case("compare-model", "slimopt compare --model smollm2-135m", replace={"--model": "tiny"},
                 add=("--methods", "adamw")),
    # docs/reproduction.md: SmolLM2 continued on KJV (here the tiny LLaMA, 2 steps, a one-point grid)
    compare_case("compare-smollm2-table", "slimopt compare --model smollm2-135m --data kjv --methods "
                 "adamw,adamw8bit,galore,frugal,taco,ternary_adamw,lora --seq-len 64 --batch-size 8 --max-steps 24 "
                 "--eval-tokens 4096 --tune-lr --lr-grid 1/4,1,4 --control-lr-grid 1/4,1,4 --lr-extensions 1 "
                 "--tune-fraction 0.34 --set adamw.lr=1e-4 --set adamw8bit.lr=1e-4 --set ternary_adamw.lr=2e-4 "
                 "--set galore.lr=1e-3 --set frugal.lr=1e-4 --set taco.lr=1e-4 --set lora.lr=1e-3 "
                 "--set frozen.lr=1e-4 --plan-model smollm2-135m",
                 replace={**SMOLLM2_AS_TINY, "--lr-grid": "1", "--control-lr-grid": "1", "--tune-fraction": "0.5",
                          "--lr-extensions": "0"}, slow=True),
    # docs/reproduction.md: that table's seeds 1 and 2 (here the tiny LLaMA, 2 steps, one seed)
    compare_case("compare-smollm2-seeds", "slimopt compare --model smollm2-135m --data kjv --methods "
                 "adamw,frugal,taco,ternary_adamw --seq-len 64 --batch-size 8 --max-steps 24 --eval-tokens 4096 "
                 "--seed 1 --seeds 2 --set adamw.lr=1e-4 --set frugal.lr=4e-4 --set taco.lr=1e-4 "
                 "--set ternary_adamw.lr=2e-4 --set frozen.lr=8e-4 --plan-model smollm2-135m",
                 replace={**SMOLLM2_AS_TINY, "--seeds": "1"}, slow=True),
    # docs/reproduction.md: int8 weights on SmolLM2 continued on KJV, 3 seeds (here the tiny LLaMA, 2 steps, 1 seed)
    compare_case("compare-smollm2-int8", "slimopt compare --model smollm2-135m --data kjv --methods "
                 "adamw,adamw+weights=int8+offload=host,adamw+weights=int8 --seq-len 64 --batch-size 8 "
                 "--max-steps 24 --eval-tokens 4096 --set adamw.lr=1e-4 --set frozen.lr=8e-4 "
                 "--plan-model smollm2-135m --seeds 3",
                 replace={**SMOLLM2_AS_TINY, "--seeds": "1"}, slow=True),
    compare_case("compare-bbc", "slimopt compare --data bbc", add=("--methods", "adamw,galore"), slow=True),
    compare_case("compare-int8-variants", "slimopt compare --methods adamw,adamw+weights=int8+offload=host,"
                 "adamw+weights=int8 --seeds 3", replace={"--seeds": "2"}),
    compare_case("compare-methods-tokens", "slimopt compare --methods adamw,galore,frugal,torch-adamw,galore-torch "
                 "--tokens 4e6", replace={"--tokens": "512"}, slow=True),
    compare_case("compare-vocab-steps", "slimopt compare --vocab-size 512 --max-steps 512",
                 replace={"--max-steps": "2"}, add=("--methods", "adamw,galore"), slow=True),
    compare_case("compare-tune-seeds", "slimopt compare --methods adamw,galore,frugal --tune-lr --seeds 3",
                 replace={"--seeds": "2"}, slow=True),
    compare_case("compare-stagger-seeds", "slimopt compare --methods galore,galore+stagger_refresh=True+lr=0.04 "
                 "--seeds 3", replace={"--seeds": "2"}, slow=True),
    compare_case("compare-bf16-variants", "slimopt compare --dtype bf16 --vocab-size 512 --max-steps 512 --methods "
                 "adamw,adamw+param_rounding=stochastic,adamw+param_rounding=kahan --no-control",
                 replace={"--max-steps": "2", "--methods": "adamw,adamw+param_rounding=kahan"}, slow=True),
    compare_case("compare-vocab-tune-seeds", "slimopt compare --vocab-size 512 --max-steps 512 --methods "
                 "adamw,frugal_rho0,frugal_head --tune-lr --seeds 3",
                 replace={"--max-steps": "4", "--seeds": "2", "--methods": "frugal_head"}, slow=True),
    compare_case("compare-default-tuned", "slimopt compare --vocab-size 512 --max-steps 512 --tune-lr --seeds 3",
                 replace={"--max-steps": "4", "--seeds": "2"}, add=("--methods", "adamw"), slow=True),
    compare_case("compare-ternary-forms", "slimopt compare --vocab-size 512 --max-steps 512 --tune-lr --lr-grid "
                 "0.5,1,2,4,8 --seeds 3 --methods \"adamw,adamw4bit,adamw+v_codec=factored,"
                 "ternary_adamw+codec=ternary_sr_rms64,ternary_adamw+codec=ternary_ef_mean64,"
                 "adamw+rule=lion+m_codec=ternary_sr_rms64+lr=2.5e-4\"",
                 replace={"--max-steps": "4", "--seeds": "2", "--lr-grid": "1,2",
                          "--methods": "ternary_adamw+codec=ternary_sr_rms64,adamw+rule=lion+lr=2.5e-4"}, slow=True),
    compare_case("compare-tune-grid", "slimopt compare --tune-lr --lr-grid 1/3,1,3 --tune-fraction 0.5 --no-control",
                 add=("--methods", "adamw,galore"), slow=True),
    compare_case("compare-own-text", "slimopt compare --data technical.txt --methods adamw,ternary_adamw,"
                 "ternary_adamw+lr=0.001", files=("technical.txt",), slow=True),
    compare_case("compare-own-text-tuned", "slimopt compare --data technical.txt --methods adamw,ternary_adamw "
                 "--tune-lr", files=("technical.txt",), slow=True),
    compare_case("compare-local-data", "slimopt compare --model 60m --data ./c4.jsonl --tokenizer ./t5-base "
                 "--device cuda --batch-size 512 --tokens 1.1e9 --dtype bf16-autocast --set galore.rank=128",
                 replace={"--model": "tiny", "--batch-size": "8", "--tokens": "512"},
                 add=("--methods", "adamw,galore", "--out", "runs/c4"), files=("c4.jsonl", "t5-base"), slow=True),
    # --- finetune: a 2-layer BERT with the MiniLM tokenizer instead of MiniLM / roberta-base, 1 step
    finetune_case("finetune", "slimopt finetune"),
    finetune_case("finetune-two-tasks", "slimopt finetune --tasks bbc,kjv-testament "
                  "--methods adamw,galore,frugal,lora,taco --threads 1 --out results/ft",
                  replace={"--tasks": "kjv-testament"}),  # a table of two tasks: test_finetune_cli.py
    finetune_case("finetune-results-command", "slimopt finetune --tasks bbc,kjv-testament "
                  "--methods adamw,galore,frugal,lora,taco,ternary_adamw,frugal_rho0 "
                  "--set frugal_rho0.state_full=head --max-train-samples 480 --max-eval-samples 256 --max-length 32 "
                  "--threads 1", replace={"--tasks": "bbc", "--max-train-samples": "8", "--max-eval-samples": "8",
                                          "--max-length": "16"}, slow=True),
    finetune_case("finetune-glue-dir", "slimopt finetune --model roberta-base --tasks mrpc,rte "
                  "--data-dir ./glue_data --max-train-samples 0 --max-eval-samples 0 --max-length 512 --epochs 30 "
                  "--rank 4 --methods adamw,galore,lora", replace={"--max-length": "16", "--epochs": "1"},
                  files=("glue_data",), slow=True),
    finetune_case("finetune-glue-dir-batch", "slimopt finetune --model roberta-base --tasks mrpc,rte "
                  "--data-dir ./glue_data --max-train-samples 0 --max-eval-samples 0 --max-length 512 --epochs 30 "
                  "--batch-size 16 --rank 4 --methods adamw,galore,lora",
                  replace={"--tasks": "rte", "--max-length": "16", "--epochs": "1"}, files=("glue_data",)),
    # the model itself loads in tests/test_pretrained.py (slow; skipped without its package): here a tiny BERT
    finetune_case("finetune-smollm2", "slimopt finetune --model smollm2-135m --tasks bbc --methods adamw,taco "
                  "--max-steps 2", replace={"--max-steps": "1"}),
    finetune_case("finetune-honest", "slimopt finetune --model smollm2-135m --methods adamw,taco,lora --tune-lr "
                  "--lr-grid 1/4,1,4 --seeds 3", replace={"--lr-grid": "1,2", "--seeds": "2"},
                  add=("--lr-extensions", "0")),
    # docs/finetune.md and docs/reproduction.md: SmolLM2 on BBC (here the tiny BERT, one step, one seed)
    finetune_case("finetune-smollm2-table", "slimopt finetune --model smollm2-135m --tasks bbc --methods "
                  "adamw,adamw8bit,galore,frugal,taco,ternary_adamw,lora --seeds 3 --max-steps 16 --batch-size 8 "
                  "--max-length 64 --max-train-samples 320 --max-eval-samples 200 --threads 2",
                  replace={"--seeds": "1", "--max-steps": "1", "--batch-size": "4", "--max-length": "16",
                           "--max-train-samples": "8", "--max-eval-samples": "8", "--threads": "1"}),
    finetune_case("finetune-lora-plus", "slimopt finetune --methods lora,lora+adamw8bit "
                  "--set lora+adamw8bit.lr=5e-4 --max-steps 50", replace={"--max-steps": "1"}),
    finetune_case("finetune-int8-host", "slimopt finetune --methods adamw,galore --weights int8 --offload host "
                  "--master bf16"),
    finetune_case("finetune-own-files", "slimopt finetune --tasks reviews --train-file train.csv "
                  "--validation-file dev.csv --text-columns text --num-labels 3", files=("reviews",)),
    # --- bench: tiny LLaMA, 1 step per method, a 48 x 80 refresh; torchao's rows are made "not installed"
    # (its kernels compile per shape: a minute on CPU; test_bench.py runs them)
    bench_case("bench", "slimopt bench"),
    bench_case("bench-cpu-docs", "slimopt bench --model small --vocab-size 8192 --steps 5 --warmup 2 --threads 1 "
               "--max-minutes 7 --out docs/bench/cpu"),
    bench_case("bench-cpu-recorded", "slimopt bench --model small --methods all --device cpu --dtype bf16 --steps 5 "
               "--warmup 2 --vocab-size 8192 --threads 1 --max-minutes 7 --out docs/bench/cpu"),
    bench_case("bench-cpu-ternary", "slimopt bench --model small --methods adamw,adamw8bit,ternary_adamw,"
               "frugal_ternary,torch-adamw-fused --device cpu --dtype bf16 --steps 5 --warmup 2 --vocab-size 8192 "
               "--threads 1 --out docs/bench/cpu-ternary"),
    bench_case("bench-cpu-routes-ab", "slimopt bench --model small --vocab-size 8192 --steps 5 --warmup 2 --threads 1 "
               "--methods torch-adamw-fused,adamw,adamw8bit,adamw4bit,ternary_adamw,galore,frugal,taco --no-refresh"),
    bench_case("bench-cpu-help", "slimopt bench --model small --vocab-size 8192 --steps 3 --warmup 1"),
    bench_case("bench-cpu-kernel-ab", "slimopt bench --model small --methods adamw4bit,galore8bit,adamw8bit,"
               "ternary_adamw,torch-adamw-fused --device cpu --dtype bf16 --steps 15 --warmup 2 --vocab-size 8192 "
               "--threads 1 --no-refresh"),
    bench_case("bench-tiny-no-refresh", "slimopt bench --model tiny --methods adamw,adamw8bit,torch-adamw-fused,"
               "bnb-adamw8bit --no-refresh", slow=True),  # bitsandbytes' import compiles kernels
    bench_case("bench-gpu", "slimopt bench --model 1b --device cuda --steps 20 --warmup 3 --out $OUT/bench",
               replace={"--out": "out/bench"}),
    bench_case("bench-gpu-check-planner", "slimopt bench --model 1b --device cuda --dtype bf16 --steps 20 "
               "--warmup 3 --max-minutes 4 --check-planner --batch 8 --seq 512",
               replace={"--batch": "2", "--seq": "16"}, slow=True),
    # the planner check of the default methods runs above; here only of the two benchmarked
    bench_case("bench-gpu-methods-check-planner", "slimopt bench --model 1b --device cuda --methods adamw,galore "
               "--check-planner --batch 8 --seq 512",
               replace={"--check-planner": "adamw,galore", "--batch": "2", "--seq": "16"}, slow=True),
]

# Documented invocations that need the Hugging Face hub (C4 streamed, the t5-base tokenizer): without it they
# must stop with one line naming what is missing; with it they are left alone here (they download).
NEEDS_HUB = [Case("train-c4-hub", "slimopt train --model 60m --data c4 --tokenizer t5-base")]


def test_every_documented_invocation_has_a_case():
    cases = {key(c.sub, c.doc_args) for c in CASES + NEEDS_HUB}
    cases |= {key(c.then.sub, c.then.doc_args) for c in CASES if c.then}
    docs = documented()
    missing = {k: v for k, v in docs.items() if k not in cases}
    assert not missing, "documented invocations without a case in tests/test_cli_documented.py:\n" + "\n".join(
        v[0] for v in missing.values())
    # the extraction finds what it should: each subcommand, a fenced block, a wrapped inline span, --help
    assert {k[0] for k in docs} == set(SUBCOMMANDS)
    assert ("memory", frozenset({"--model", "--method", "--gpu-memory", "--batch", "--seq"})) in docs
    assert ("bench", frozenset({"--model", "--device", "--dtype", "--steps", "--warmup", "--max-minutes",
                                "--check-planner", "--batch", "--seq"})) in docs
    assert ("train", frozenset({"--method", "--density", "--update-gap", "--resume"})) in docs
    assert len({c.id for c in CASES + NEEDS_HUB}) == len(CASES + NEEDS_HUB)


def test_out_with_and_without():
    """Each command that writes files runs both into --out and into its default place (or nowhere)."""
    for sub in ("memory", "train", "compare", "finetune", "bench"):
        outs = {"--out" in c.argv() for c in CASES if c.sub == sub}
        assert outs == {True, False}, sub


# ------------------------------------------------------------------------------------------------------------
# running them


class Resources:
    """The local files the documented lines name, each made once for the module (on first use) and copied into a
    case's folder by ``copy``."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[str, Path] = {}

    def copy(self, name: str, cwd: Path) -> None:
        if name not in self.made:
            self.made[name] = getattr(self, "_" + re.sub(r"\W", "_", name))(self.root / "files" / name)
        src = self.made[name]
        if name == "reviews":  # train.csv and dev.csv in the working directory
            for f in src.iterdir():
                shutil.copy(f, cwd / f.name)
        elif src.is_dir():
            shutil.copytree(src, cwd / name.split("/")[0])
        else:
            shutil.copy(src, cwd / name)

    @functools.cached_property
    def documents(self) -> list[str]:
        from slimopt.train.data import iter_documents

        return list(itertools.islice(iter_documents("kjv"), 150))

    def _jsonl(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in self.documents))
        return path

    _c4_jsonl = _c4_shard_jsonl = _jsonl

    def _technical_txt(self, path: Path) -> Path:  # a user's own plain-text corpus
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(self.documents))
        return path

    def _c4___json_gz(self, path: Path) -> Path:  # c4/*.json.gz: a folder of gzipped json lines
        folder = path.parent
        folder.mkdir(parents=True)
        with gzip.open(folder / "c4-train.00000-of-01024.json.gz", "wt") as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in self.documents))
        return folder

    def _t5_base(self, path: Path) -> Path:  # a tokenizer folder: a 512-token BPE on the same documents
        from slimopt.train.tokenizer import load_tokenizer

        load_tokenizer(None, self.documents, 512, cache_dir=self.root / "tok").save_pretrained(path)
        return path

    def _my_model(self, path: Path) -> Path:  # a config.json only, as the memory planner reads
        from transformers import LlamaConfig

        LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096).save_pretrained(path)
        return path

    def _tiny_bert(self, path: Path) -> Path:  # a 2-layer BERT with the offline MiniLM's tokenizer
        save_tiny_bert(path)
        return path

    def _glue_data(self, path: Path) -> Path:  # GLUE's folder names, sentence pairs as json lines
        for folder, seed in (("MRPC", 1), ("RTE", 2)):
            (path / folder).mkdir(parents=True)
            for split, n in (("train", 16), ("dev", 8)):
                a, b = sentences(n, seed), sentences(n, seed + 10)
                with open(path / folder / f"{split}.jsonl", "w") as f:
                    for i in range(n):
                        f.write(json.dumps({"sentence1": a[i], "sentence2": b[i], "label": i % 2}) + "\n")
        return path

    def _reviews(self, path: Path) -> Path:  # a task of one's own: csv with a text column, 3 classes
        path.mkdir(parents=True)
        for name, n, seed in (("train.csv", 12, 3), ("dev.csv", 6, 4)):
            rows = ["text,label"] + [f"{s},{i % 3}" for i, s in enumerate(sentences(n, seed))]
            (path / name).write_text("\n".join(rows) + "\n")
        return path


@pytest.fixture(scope="module")
def resources(tmp_path_factory):
    """The module's files (``Resources``), and one slimopt cache (tokenizers, packed data) for all its runs."""
    root = tmp_path_factory.mktemp("documented")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIMOPT_CACHE", str(root / "cache"))
        yield Resources(root)


def _cases():
    for c in CASES:
        marks = [pytest.mark.slow] if c.slow else []
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", list(_cases()))
def test_documented_invocation(case, resources, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if case.sub == "bench":
        monkeypatch.setitem(sys.modules, "torchao", None)
    for name in case.files:
        resources.copy(name, tmp_path)
    argv = case.argv()
    if not HAS_CUDA and "cuda" in case.doc_args:
        cuda = [*argv]
        cuda[cuda.index("--device") + 1] = "cuda"
        rc, out, err = run_cli(cuda, capsys)
        assert rc == 2 and "CUDA" in err and len(err.strip().splitlines()) == 1, err
    rc, out, err = run_cli(argv, capsys)
    case.check(argv[1:], rc, out, err, tmp_path)
    if case.then is not None:
        argv = case.then.argv()
        rc, out, err = run_cli(argv, capsys)
        if case.then.xfail:  # a known failure: it must still fail this way, or the xfail goes
            assert rc != 0, f"{case.then.id} works now: remove its xfail"
            assert "settings differ from the checkpoint" in err, err
            pytest.xfail(f"{case.then.xfail} ({err.strip()})")
        case.then.check(argv[1:], rc, out, err, tmp_path)


@pytest.mark.parametrize("case", NEEDS_HUB, ids=lambda c: c.id)
def test_documented_invocation_needing_the_hub(case, tmp_path, monkeypatch, capsys):
    from slimopt.models.hub import hub_offline

    if not hub_offline():
        pytest.skip("the Hugging Face hub is reachable: this invocation would download")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(case.argv(), capsys)
    assert rc == 2 and err.startswith(f"slimopt {case.sub}: error: ") and "t5-base" in err, err
    assert not any(tmp_path.iterdir())
