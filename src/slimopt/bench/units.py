"""Memory sizes as people write them ("24GB", "24 GiB", "24000MB") and as the planner prints them.

SI units are powers of 1000 (GB = 10^9 bytes), IEC units powers of 1024 (GiB = 2^30 bytes): a card sold as
"24 GB" (RTX 4090) or "80 GB" (H100) holds 24 or 80 GiB, so write the IEC unit to be exact. A bare number has no
unit and is refused rather than guessed.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_size", "gib", "fmt_gib", "fmt_bytes"]

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # the one-letter forms nvidia-smi and torch users write (24G, 500M) are binary
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]+)\s*$")


def parse_size(text: str, name: str = "size") -> int:
    """Bytes of a size such as "24GB", "24 GiB", "24000MB", "80G", "1.5TiB".

    Raises ValueError naming `name` and the accepted forms when `text` is not one of them.
    """
    allowed = "a number and a unit, e.g. 24GiB, 24GB, 24000MB, 80G (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string like 24GiB; got {text!r}")
    m = _PATTERN.match(text)
    if m is None:
        if re.fullmatch(r"\s*[0-9.]+\s*", text):
            raise ValueError(f"{name}={text!r} has no unit: write {allowed}")
        raise ValueError(f"{name}={text!r} is not a memory size: write {allowed}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"{name}={text!r}: unknown unit {m.group(2)!r}; write {allowed}")
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"{name}={text!r} must be a positive size")
    return int(round(nbytes))


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def fmt_gib(nbytes: float, digits: int = 2) -> str:
    return f"{gib(nbytes):.{digits}f}"


def fmt_bytes(nbytes: float) -> str:
    """A short human form with a binary unit: 512 B, 3.2 MiB, 12.55 GiB."""
    n = float(nbytes)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
