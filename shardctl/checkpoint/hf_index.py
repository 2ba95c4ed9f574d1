"""The safetensors index (``model.safetensors.index.json``): read strictly, compare with shards.

``read_index`` refuses an index above 10 MiB, not strict JSON, or whose ``weight_map`` is not a
string → safe-path map of ``*.safetensors`` names; ``compare_index`` lists every disagreement
with the shard headers (a tensor missing, extra, or in two files) and warns on a wrong
``metadata.total_size``; ``unreferenced_series`` finds ``*-NNNNN-of-MMMMM`` files the index
forgot. Rules and reasons: :mod:`shardctl.checkpoint.hf`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import repeat
from pathlib import Path
from typing import Any

from shardctl.checkpoint.paths import PathGuard
from shardctl.checkpoint.strict_json import read_json_strict
from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import SafetensorsHeader

MAX_INDEX_BYTES = 10 * 2**20
_SERIES = re.compile(r"^(?P<prefix>.+)-\d{5}-of-\d{5}\.safetensors$")


def read_index(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """``(metadata, weight_map)`` of a strict, path-checked index."""
    where = str(path)
    data = read_json_strict(path, max_bytes=MAX_INDEX_BYTES, what="index")
    if not isinstance(data, dict):
        raise InvalidInputError("index is not a JSON object", where=where)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise InvalidInputError(
            f"index has no 'weight_map' object (got {type(weight_map).__name__})", where=where
        )
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidInputError("index 'metadata' is not an object", where=where)
    guard = PathGuard(path.parent, follow=False)
    # Each distinct file name is checked once (100,000 entries name a few dozen files); an
    # error names the first entry that holds the bad value, as an entry-by-entry walk would.
    entries: Iterable[tuple[str, Any]] = weight_map.items()
    if all(type(rel) is str for rel in weight_map.values()):
        # each distinct name at its first entry, in the order of first entries
        first = dict(zip(reversed(weight_map.values()), reversed(weight_map.keys()), strict=True))
        entries = [(first[rel], rel) for rel in dict.fromkeys(weight_map.values())]
    for fqn, rel in entries:
        check_entry(guard, where, fqn, rel)
    return metadata, weight_map


def check_entry(guard: PathGuard, where: str, fqn: str, rel: Any) -> None:
    """One ``weight_map`` entry: a safe relative path to a ``*.safetensors`` file."""
    if not isinstance(rel, str):
        raise InvalidInputError(
            f"weight_map[{fqn!r}]: expected a file name, got {type(rel).__name__}",
            where=where,
        )
    guard.check_syntax(rel, f"{where}: weight_map[{fqn!r}]")
    if not rel.endswith(".safetensors"):
        raise InvalidInputError(
            f"index references non-safetensors file {rel!r} (weight_map[{fqn!r}])",
            where=where,
            hint="shardctl reads pickle weights only with --allow-pickle, never via an index",
        )


def compare_index(
    weight_map: dict[str, str],
    headers: list[SafetensorsHeader],
    metadata: Mapping[str, Any],
    root: Path,
) -> tuple[list[str], list[str]]:
    """Every discrepancy between the index and the shard headers; and warnings."""
    problems: list[str] = []
    files = [h.path.relative_to(root).as_posix() for h in headers]
    # The usual case first, in C: every tensor once, each where the index says.
    held: dict[str, str] = {}
    for h, file in zip(headers, files, strict=True):  # the headers' columns, in C
        held.update(zip(h.names, repeat(file)))
    if held != weight_map or len(held) != sum(len(h.names) for h in headers):
        problems = _problems(weight_map, headers, files)
    warnings: list[str] = []
    # column sums in C; parameters per distinct shape (a few dozen among 100,000 tensors)
    actual_bytes = sum(h.data_bytes for h in headers)
    shapes: Counter[tuple[int, ...]] = Counter()
    for h in headers:
        shapes.update(h.shapes)
    actual_params = sum(math.prod(shape) * n for shape, n in shapes.items())
    for key, actual in (("total_size", actual_bytes), ("total_parameters", actual_params)):
        claimed = metadata.get(key)
        if claimed is not None and claimed != actual:
            warnings.append(
                f"index metadata.{key} is {claimed!r} but the shards hold {actual} "
                f"({'bytes' if key == 'total_size' else 'parameters'}); ignored"
            )
    return problems, warnings


def _problems(
    weight_map: dict[str, str], headers: list[SafetensorsHeader], files: list[str]
) -> list[str]:
    """:func:`compare_index`'s discrepancies, tensor by tensor, in file order."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for h, file in zip(headers, files, strict=True):
        for e in h.tensors:
            if e.name in seen:
                problems.append(f"{e.name!r} is in both {seen[e.name]} and {file}")
                continue
            seen[e.name] = file
            if e.name not in weight_map:
                problems.append(f"{e.name!r} is in {file} but not in the index")
            elif weight_map[e.name] != file:
                problems.append(f"{e.name!r} is in {file} but the index says {weight_map[e.name]}")
    for fqn, file in weight_map.items():
        if fqn not in seen:
            problems.append(f"{fqn!r}: the index says {file}, which has no such tensor")
    return problems


def unreferenced_series(referenced: list[str], present: list[str]) -> list[str]:
    """Files like ``model-00003-of-00004.safetensors`` of the index's series, not in it."""
    prefixes = {m["prefix"] for n in referenced if (m := _SERIES.match(n))}
    return [
        f"shard {n} is not referenced by the index"
        for n in present
        if n not in referenced and (m := _SERIES.match(n)) and m["prefix"] in prefixes
    ]
