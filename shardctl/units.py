"""Byte sizes: parsed from the command line (``5GB`` = 10**9, ``5GiB`` = 2**30, ``500MB``,
``123``) and printed for people (``fmt_bytes``)."""

from __future__ import annotations

import re
from fractions import Fraction

from shardctl.errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, *, option: str) -> int:
    """``"5GB"`` -> ``5_000_000_000`` (SI as transformers' ``max_shard_size``; ``GiB`` binary)."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"{option}: expected a size like 5GB, 500MiB or 1000000, got {text!r}",
        )
    value = Fraction(m.group(1)) * _UNITS[unit]
    if value < 1 or value.denominator != 1:
        raise UsageError(f"{option}: expected a whole positive number of bytes, got {text!r}")
    return int(value)


def fmt_bytes(n: int | float | None) -> str:
    """``16060522496`` -> ``"14.96 GiB"`` (binary units, as GPU memory is sold in GiB)."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- printing: one unit per output ---------------------------------------------------------

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def pick_unit(largest: float) -> tuple[str, int]:
    """The binary unit an output prints every size in, chosen by its largest size:
    ``pick_unit(80 * 2**30)`` → ``("GiB", 2**30)``; GPT-2 sizes print in MiB."""
    for name, size in _BINARY:
        if abs(largest) >= size:
            return name, size
    return "B", 1


def fmt_in(n: float, unit: tuple[str, int]) -> str:
    """``fmt_in(867_631_104, ("GiB", 2**30))`` → ``"0.81 GiB"``."""
    name, size = unit
    return f"{n:.0f} B" if size == 1 else f"{n / size:.2f} {name}"
