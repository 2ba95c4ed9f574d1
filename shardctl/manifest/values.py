"""Typed readers: a YAML node plus the type its key expects → a Python value, or :class:`Invalid`.

A scalar means what its key says it means (YAML 1.2 core spellings), never what YAML 1.1 guesses:

- integers are plain decimal: ``8``, ``-3``. Leading zeros (``010``: 8 in YAML 1.1, 10 in 1.2),
  hex ``0x10``, octal ``0o10``, binary ``0b1``, sexagesimal ``1:30`` and digit separators
  ``1_000`` are **refused everywhere** — ambiguous across YAML versions, and never needed here;
- booleans are ``true``/``false`` (``True``, ``TRUE``); ``yes``/``no``/``on``/``off`` are refused
  where a boolean or a number is expected (they are strings in YAML 1.2, booleans in 1.1);
- a boolean is never an integer: ``tp: true`` is an error;
- scientific notation (``7.5e9``) only where documented: ``model.parameters``, byte sizes, link
  bandwidths, and inline HF config fields (config.json writes ``1e-05``). Elsewhere:
  ``expected a number, got string '1e3'``;
- ``.inf``, ``.nan`` and overflowing spellings (``1e309``) are refused everywhere;
- integers above 2**63 − 1 are ``out of range``; numbers are converted exactly (``7.5e9`` →
  ``7500000000``), never through a float.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from shardctl.manifest.yamlstrict import Map, Node, Scalar, Seq

INT_MAX = 2**63 - 1
_MAX_NUMBER_CHARS = 48  # a 38-digit integer plus sign, point and exponent; longer is hostile
_MAX_EXPONENT = 40

_NULL = frozenset({"", "~", "null", "Null", "NULL"})
_TRUE = frozenset({"true", "True", "TRUE"})
_FALSE = frozenset({"false", "False", "FALSE"})
_YAML11_BOOLS = frozenset({"yes", "no", "on", "off", "y", "n"})

_DEC_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_DEC_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)")
_SCI = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+")
_NON_FINITE = re.compile(r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
_AMBIGUOUS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"[-+]?0[0-9]+(?:\.[0-9]*)?"), "leading zero: octal in YAML 1.1"),
    (re.compile(r"[-+]?0[xX][0-9a-fA-F_]+"), "hexadecimal"),
    (re.compile(r"[-+]?0[oO][0-7_]+"), "octal"),
    (re.compile(r"[-+]?0[bB][01_]+"), "binary"),
    (re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"), "sexagesimal in YAML 1.1"),
    (re.compile(r"[-+]?[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?"), "digit separators"),
)


class Invalid(Exception):
    """One problem at one key path; collected, then raised as one :class:`ManifestError`."""

    def __init__(self, path: str, message: str, line: int | None, hint: str | None = None):
        self.path = path
        self.problem = message
        self.line = line
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = f" (line {self.line})" if self.line is not None else ""
        hint = f"; {self.hint}" if self.hint else ""
        return f"{self.path}: {self.problem}{where}{hint}"


def describe(node: Node) -> str:
    """How an error names what it got: ``'yes'``, ``true``, ``string '2'``, ``a list``."""
    if isinstance(node, Seq):
        return "a list"
    if isinstance(node, Map):
        return "a mapping"
    if not node.plain:
        return f"string {_short(node.text)}"
    if node.text in _NULL:
        return "null"
    if node.text in _TRUE or node.text in _FALSE:
        return f"{node.text.lower()} (a boolean)"
    if _SCI.fullmatch(node.text):
        return f"string {_short(node.text)}"
    return _short(node.text)


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def ambiguous_spelling(text: str) -> str | None:
    """Why a plain scalar is refused as a number (``'010'`` → ``leading zero: ...``), or None."""
    for pattern, why in _AMBIGUOUS:
        if pattern.fullmatch(text):
            return why
    return None


def _refuse_spelling(node: Scalar, path: str) -> None:
    if not node.plain:
        return
    if _NON_FINITE.fullmatch(node.text):
        raise Invalid(path, f"non-finite number {node.text!r} not allowed", node.line)
    why = ambiguous_spelling(node.text)
    if why is not None:
        raise Invalid(
            path,
            f"non-decimal number spelling {node.text!r} ({why})",
            node.line,
            "write it in plain decimal without leading zeros, or quote it if it is a string",
        )


def exact_number(text: str, *, scientific: bool) -> Fraction | None:
    """``"7.5e9"`` → ``Fraction(7500000000)``; None when ``text`` is not a decimal spelling.

    Raises :class:`OverflowError` for spellings too long or exponents too large to be sane.
    """
    if not (
        _DEC_INT.fullmatch(text)
        or _DEC_FLOAT.fullmatch(text)
        or (scientific and _SCI.fullmatch(text))
    ):
        return None
    if len(text) > _MAX_NUMBER_CHARS:
        raise OverflowError(text)
    mantissa, _, exponent = text.lower().partition("e")
    if exponent and abs(int(exponent)) > _MAX_EXPONENT:
        raise OverflowError(text)
    return Fraction(mantissa) * Fraction(10) ** int(exponent or "0")


def _scalar(node: Node, path: str, expected: str) -> Scalar:
    if not isinstance(node, Scalar):
        raise Invalid(path, f"expected {expected}, got {describe(node)}", node.line)
    if node.plain and node.text in _NULL:
        raise Invalid(path, f"expected {expected}, got null", node.line)
    return node


def read_int(node: Node, path: str, *, minimum: int = 1, maximum: int = INT_MAX) -> int:
    """A plain decimal integer in ``[minimum, maximum]``."""
    expected = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, "an integer")
    scalar = _scalar(node, path, expected)
    _refuse_spelling(scalar, path)
    if not scalar.plain or not _DEC_INT.fullmatch(scalar.text):
        raise Invalid(path, f"expected {expected}, got {describe(scalar)}", scalar.line)
    if len(scalar.text) > _MAX_NUMBER_CHARS:
        raise Invalid(path, f"{_short(scalar.text)} out of range", scalar.line)
    value = int(scalar.text)
    _check_range(value, path, scalar.line, minimum, maximum)
    return value


def _check_range(value: float, path: str, line: int, minimum: float, maximum: float) -> None:
    if value > maximum:
        raise Invalid(path, f"{value} out of range (at most {maximum})", line)
    if value < minimum:
        raise Invalid(path, f"must be at least {minimum}, got {value}", line)


def read_float(
    node: Node,
    path: str,
    *,
    minimum: float,
    maximum: float,
    exclusive_minimum: bool = False,
) -> float:
    """A plain decimal number (``0.9``, ``1``) in range; no scientific notation."""
    scalar = _scalar(node, path, "a number")
    _refuse_spelling(scalar, path)
    try:
        exact = exact_number(scalar.text, scientific=False) if scalar.plain else None
    except OverflowError:
        raise Invalid(path, f"{_short(scalar.text)} out of range", scalar.line) from None
    if exact is None:
        hint = (
            "scientific notation is accepted only for model.parameters, byte sizes and bandwidths"
            if _SCI.fullmatch(scalar.text)
            else None
        )
        raise Invalid(path, f"expected a number, got {describe(scalar)}", scalar.line, hint)
    value = float(exact)
    low = "greater than" if exclusive_minimum else "at least"
    if value > maximum or value < minimum or (exclusive_minimum and value == minimum):
        raise Invalid(
            path,
            f"expected a number {low} {minimum} and at most {maximum}, got {value:g}",
            scalar.line,
        )
    return value


def read_bool(node: Node, path: str) -> bool:
    scalar = _scalar(node, path, "true or false")
    if scalar.plain and scalar.text in _TRUE:
        return True
    if scalar.plain and scalar.text in _FALSE:
        return False
    hint = (
        "YAML 1.1 words like yes/on are not booleans here"
        if (scalar.text.lower() in _YAML11_BOOLS)
        else None
    )
    raise Invalid(path, f"expected true or false, got {describe(scalar)}", scalar.line, hint)


def read_str(node: Node, path: str) -> str:
    scalar = _scalar(node, path, "a string")
    if scalar.text.strip() == "":
        raise Invalid(path, "expected a non-empty string, got ''", scalar.line)
    return scalar.text


def read_enum(node: Node, path: str, choices: Iterable[str]) -> str:
    options = tuple(choices)
    text = read_str(node, path)
    if text not in options:
        raise Invalid(
            path,
            f"expected one of {', '.join(options)}; got {describe(node)}",
            node.line,
            did_you_mean(text, options),
        )
    return text


def did_you_mean(word: str, options: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


# ----------------------------------------------------------------------------- sizes and rates
_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}
_BIT_UNITS = ("Kb", "kb", "Mb", "Gb", "Tb", "bit", "Kbit", "Mbit", "Gbit", "Tbit")
_RATE_UNITS: dict[str, Fraction] = {
    **{f"{unit}/s": Fraction(factor) for unit, factor in _SIZE_UNITS.items()},
    **{
        f"{p}b/s": Fraction(f, 8)
        for p, f in (("K", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12))
    },
    **{
        f"{p}bit/s": Fraction(f, 8)
        for p, f in (("K", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12))
    },
    **{
        f"{p}bps": Fraction(f, 8)
        for p, f in (("K", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12))
    },
}
_QUANTITY = re.compile(r"\s*([-+]?[0-9.][0-9.eE+-]*)\s*([A-Za-z/]+)?\s*")


def _quantity(
    node: Node, path: str, units: Mapping[str, Fraction | int], expected: str
) -> tuple[Fraction, Scalar]:
    scalar = _scalar(node, path, expected)
    _refuse_spelling(scalar, path)
    match = _QUANTITY.fullmatch(scalar.text)
    if match is None:
        raise Invalid(path, f"expected {expected}, got {describe(scalar)}", scalar.line)
    number, unit = match.groups()
    try:
        value = exact_number(number, scientific=True)
    except OverflowError:
        raise Invalid(path, f"{_short(scalar.text)} out of range", scalar.line) from None
    if value is None:
        raise Invalid(path, f"expected {expected}, got {describe(scalar)}", scalar.line)
    if unit is not None and unit not in units:
        hint = f"units: {', '.join(units)}"
        if unit in _BIT_UNITS or unit.endswith(("b/s", "bps")):
            hint = f"{unit!r} counts bits; {hint}"
        raise Invalid(path, f"unknown unit {unit!r} in {scalar.text!r}", scalar.line, hint)
    return value * (units[unit] if unit is not None else 1), scalar


def _whole(value: Fraction, scalar: Scalar, path: str, what: str) -> int:
    if value.denominator != 1:
        raise Invalid(path, f"{scalar.text!r} is not a whole number of {what}", scalar.line)
    return int(value)


def read_size(node: Node, path: str, *, minimum: int = 0, maximum: int = 2**60) -> int:
    """Bytes: ``80GiB`` (2**30), ``80GB`` / ``80 GB`` (10**9), ``85899345920``, ``8.5e10``."""
    value, scalar = _quantity(node, path, _SIZE_UNITS, "a size such as 80GiB or 85899345920")
    size = _whole(value, scalar, path, "bytes")
    if size > maximum:
        raise Invalid(path, f"{scalar.text!r} out of range (at most {maximum} bytes)", scalar.line)
    if size < minimum:
        raise Invalid(
            path,
            f"{scalar.text!r} is {size} bytes, below the minimum of {minimum}",
            scalar.line,
            "give a unit, e.g. 80GiB",
        )
    return size


def read_rate(node: Node, path: str) -> int:
    """Bytes per second: ``450GB/s`` (bytes), ``400Gb/s`` / ``400Gbps`` (bits), ``5e10``."""
    value, scalar = _quantity(node, path, _RATE_UNITS, "a bandwidth such as 450GB/s or 400Gb/s")
    rate = _whole(value, scalar, path, "bytes per second")
    if rate <= 0 or rate > 2**60:
        raise Invalid(
            path, f"{scalar.text!r} out of range (positive, at most 2**60 B/s)", scalar.line
        )
    return rate


def read_count(node: Node, path: str, *, maximum: int = 10**15) -> int:
    """A positive whole number, decimal or scientific: ``7.5e9`` → ``7500000000`` exactly."""
    scalar = _scalar(node, path, "a positive number such as 7.5e9")
    _refuse_spelling(scalar, path)
    try:
        value = exact_number(scalar.text.strip(), scientific=True)
    except OverflowError:
        raise Invalid(path, f"{_short(scalar.text)} out of range", scalar.line) from None
    if value is None:
        raise Invalid(
            path, f"expected a positive number such as 7.5e9, got {describe(scalar)}", scalar.line
        )
    count = _whole(value, scalar, path, "parameters")
    if count > maximum:
        raise Invalid(path, f"{scalar.text!r} out of range (at most {maximum:.0e})", scalar.line)
    if count < 1:
        raise Invalid(path, f"expected a positive number, got {scalar.text!r}", scalar.line)
    return count


# ----------------------------------------------------------------------------- free-form values
def to_plain(node: Node, path: str) -> Any:
    """A free-form value (inline HF config) as frozen Python: mappings → read-only mappings,
    lists → tuples, scalars per YAML 1.2 core with the refusals above (scientific allowed)."""
    if isinstance(node, Map):
        return MappingProxyType(
            {key: to_plain(value, f"{path}.{key}") for key, value in node.entries.items()}
        )
    if isinstance(node, Seq):
        return tuple(to_plain(item, f"{path}[{i}]") for i, item in enumerate(node.items))
    if not node.plain:
        return node.text
    text = node.text
    if text in _NULL:
        return None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text.lower() in _YAML11_BOOLS:
        raise Invalid(
            path,
            f"ambiguous value {text!r} (a boolean in YAML 1.1, a string in 1.2)",
            node.line,
            "write true or false, or quote it",
        )
    _refuse_spelling(node, path)
    if _DEC_INT.fullmatch(text):
        if len(text) > _MAX_NUMBER_CHARS or abs(int(text)) > INT_MAX:
            raise Invalid(path, f"{_short(text)} out of range", node.line)
        return int(text)
    if _DEC_FLOAT.fullmatch(text) or _SCI.fullmatch(text):
        value = float(text) if len(text) <= _MAX_NUMBER_CHARS else math.inf
        if not math.isfinite(value):
            raise Invalid(path, f"{_short(text)} out of range (not a finite number)", node.line)
        return value
    return text


def thaw(value: Any) -> Any:
    """A deep, mutable, JSON-ready copy of a :func:`to_plain` value."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thaw(item) for item in value]
    return value
