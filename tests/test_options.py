"""Settings written as text (slimopt.options): names stay names, numbers and lists are parsed, mistakes are errors;
and the one parser lives below the command line, which no lower layer imports."""

import ast
from pathlib import Path

import pytest

from slimopt.finetune.hf import parse_optim_args
from slimopt.options import parse_method_opts, parse_opt, parse_value, split_pairs, split_variant


@pytest.mark.parametrize("text,value", [
    ("none", "none"), ("None", "None"), ("null", "null"),  # a name, never Python None (projector=none)
    ("true", True), ("False", False), ("64", 64), ("2e6", 2e6), ("1_000", 1000), ("3e-4", 3e-4),
    ("[0.9,0.95]", (0.9, 0.95)), ("(0.9, 0.95)", (0.9, 0.95)), ("'svd'", "svd"),
    ("randomized_svd", "randomized_svd"), ("m/n", "m/n"), ("[oops", "[oops"),
    ('{"lm_head": {"codec": "fp32"}}', {"lm_head": {"codec": "fp32"}}), ("{oops", "{oops"),
])
def test_parse_value(text, value):
    parsed = parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_none_reaches_every_parser_as_a_name():
    assert parse_opt(["projector=none", "free_rule=none"]) == {"projector": "none", "free_rule": "none"}
    assert parse_method_opts(["galore.projector=none"]) == {"galore": {"projector": "none"}}
    assert split_variant("galore+projector=none") == ("galore", {"projector": "none"})
    assert parse_optim_args("projector=none,rank=8") == {"projector": "none", "rank": 8}


def test_a_plus_inside_a_variants_value_stays_in_it():
    assert split_variant("adamw+offload=host+master=bf16+int8") == ("adamw", {"offload": "host",
                                                                              "master": "bf16+int8"})
    assert split_variant("adamw+master=bf16+int8+weights=int8") == ("adamw", {"master": "bf16+int8",
                                                                              "weights": "int8"})


def test_mistakes_are_errors():
    with pytest.raises(ValueError, match="given twice"):
        parse_opt(["rank=4", "rank=8"])
    with pytest.raises(ValueError, match="given twice"):
        parse_method_opts(["galore.rank=4", "galore.rank=8"])
    with pytest.raises(ValueError, match="METHOD.KEY=VALUE"):
        parse_method_opts(["rank=4"])
    with pytest.raises(ValueError, match="key=value"):
        parse_opt(["rank"])
    with pytest.raises(ValueError, match="expected NAME\\+KEY=VALUE"):
        split_variant("adamw+compile")
    assert split_pairs("rank=8, betas=(0.9,0.95),scale=2") == ["rank=8", "betas=(0.9,0.95)", "scale=2"]


def test_no_lower_layer_imports_the_command_line():
    """slimopt.cli sits on top (docs/design.md, section 1): a module below it that imports it inverts the layers."""
    src = Path(__file__).resolve().parents[1] / "src" / "slimopt"
    offenders = []
    for path in src.rglob("*.py"):
        if "cli" in path.relative_to(src).parts or path.name == "__main__.py":  # the command line, its entry point
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(src)}: {n}" for n in names if n.startswith("slimopt.cli")]
    assert not offenders, offenders
