"""Strict JSON from untrusted files: size-capped, regular files only, no duplicate keys, no
``NaN``/``Infinity``/``1e400`` (reliability case B5).
Used for indexes, configs and layout records."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError


def read_json_strict(path: Path, *, max_bytes: int, what: str) -> Any:
    """Strict JSON from a regular file of at most ``max_bytes``: no duplicate keys, NaN or inf."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInputError(f"{what} not found", where=where) from None
    except PermissionError as exc:
        raise EnvironmentFailure(f"cannot open {what}: {exc.strerror}", where=where) from None
    except OSError as exc:
        raise InvalidInputError(f"cannot open {what}: {exc.strerror}", where=where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"{what} is not a regular file", where=where)
        if st.st_size > max_bytes:
            raise InvalidInputError(
                f"{what} is {st.st_size} bytes, above the {max_bytes // 2**20} MiB limit",
                where=where,
            )
        raw = os.pread(fd, st.st_size + 1, 0)  # +1: a file that grew since fstat shows
    finally:
        os.close(fd)
    if len(raw) != st.st_size:
        raise EnvironmentFailure(
            f"{what} changed while it was read ({st.st_size} bytes, then {len(raw)})",
            where=where,
            hint="rerun once nothing is writing to it",
        )
    try:
        return json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except RecursionError:
        raise InvalidInputError(f"{what} nests too deeply", where=where) from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{what} is not valid UTF-8", where=where) from None
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not strict JSON: {exc}", where=where) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # one C call; a record has ~450,000 objects at 90k tensors
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} overflows to infinity")
    return value
