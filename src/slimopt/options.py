"""Settings written as text: ``KEY=VALUE`` items, ``METHOD.KEY=VALUE`` items and ``NAME+KEY=VALUE`` variants.

One parser for every place a setting arrives as a string: ``slimopt train --opt``, the ``--set`` of compare,
finetune, bench and memory, the bench's method variants (``adamw8bit+compile=true``) and the Hugging Face
Trainer's ``optim_args``. It imports nothing heavy, so the command line and the benchmark harness can both use it.

Values: ``true``/``false`` become booleans, numbers become ints or floats (``2e6`` and ``1_000`` included),
bracketed lists (``[0.9,0.95]`` or ``(0.9,0.95)``) become tuples; everything else stays the string it is.
``none`` is a string too: settings that take names (``projector=none``, ``free_rule=none``) must receive the
name, and a setting that does not take it says so when it is checked.
"""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["parse_value", "parse_int", "parse_opt", "parse_method_opts", "split_variant", "split_pairs"]


def parse_value(text: str) -> Any:
    """One value: bool, int, float, tuple of values, a dict (``{"lm_head": {"codec": "fp32"}}``, e.g. build's
    ``overrides``), or the string itself."""
    s = text.strip()
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    if s[:1] in "[({\"'":
        try:
            parsed = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return s
        return tuple(parsed) if isinstance(parsed, list) else parsed
    return s


def parse_int(text: str) -> int:
    """An integer written as ``2e6``, ``1_000_000`` or ``1000000`` (token budgets, step counts)."""
    try:
        v = float(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if v != int(v):
        raise ValueError(f"expected an integer, got {text!r}")
    return int(v)


def _key_value(item: str, what: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key or not value.strip():
        raise ValueError(f"{what} expects key=value, got {item!r}")
    return key, value.strip()


def parse_opt(items: list[str] | None, what: str = "--opt") -> dict[str, Any]:
    """``["rank=64", "projector=randomized_svd", "betas=[0.9,0.95]"]`` -> ``{"rank": 64, ...}``.

    A key given twice is an error (the second would silently win)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, value = _key_value(item, what)
        if key in out:
            raise ValueError(f"{what}: {key!r} is given twice")
        out[key] = parse_value(value)
    return out


def parse_method_opts(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--set`` items: ``["galore.rank=64", "frugal.lr=3e-3"]`` -> ``{"galore": {"rank": 64}, "frugal": {"lr": 0.003}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        head, sep, value = item.partition("=")
        method, dot, key = head.partition(".")
        if not sep or not dot or not method.strip() or not key.strip():
            raise ValueError(f"--set expects METHOD.KEY=VALUE, got {item!r}")
        opts = out.setdefault(method.strip(), {})
        parsed = parse_opt([f"{key}={value}"], "--set")
        if set(parsed) & set(opts):
            raise ValueError(f"--set: {method.strip()}.{next(iter(parsed))} is given twice")
        opts.update(parsed)
    return out


def split_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"adamw8bit+compile=true+rank=64"`` -> ``("adamw8bit", {"compile": True, "rank": 64})``: a method with
    settings of its own, run as a row of its own next to the plain method. A part without ``=`` belongs to the
    value before it (``adamw+offload=host+master=bf16+int8``: master ``bf16+int8``)."""
    base, *parts = spec.split("+")
    items: list[str] = []
    for part in parts:
        if "=" not in part and items:
            items[-1] += "+" + part
        else:
            items.append(part)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"method variant {spec!r}: expected NAME+KEY=VALUE[+KEY=VALUE...], got {item!r}")
    return base.strip(), parse_opt(items, f"method variant {spec!r}")


def split_pairs(text: str) -> list[str]:
    """Split ``"a=1,betas=(0.9,0.95)"`` on the commas outside brackets: ``["a=1", "betas=(0.9,0.95)"]``."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    return [i.strip() for i in items if i.strip()]
