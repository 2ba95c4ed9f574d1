"""The safetensors index (``model.safetensors.index.json``): read strictly, compare with shards.

``read_index`` refuses an index above 10 MiB, not strict JSON, or whose ``weight_map`` is not a
string → safe-path map of ``*.safetensors`` names; ``compare_index`` lists every disagreement
with the shard headers (a tensor missing, extra, or in two files) and warns on a wrong
``metadata.total_size``; ``unreferenced_series`` finds ``*-NNNNN-of-MMMMM`` files the index
forgot. Rules and reasons: :mod:`shardctl.checkpoint.hf`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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
    for fqn, rel in weight_map.items():
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
    return metadata, weight_map


def compare_index(
    weight_map: dict[str, str],
    headers: list[SafetensorsHeader],
    metadata: Mapping[str, Any],
    root: Path,
) -> tuple[list[str], list[str]]:
    """Every discrepancy between the index and the shard headers; and warnings."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for h in headers:
        file = h.path.relative_to(root).as_posix()
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

    warnings: list[str] = []
    actual_bytes = sum(e.nbytes for h in headers for e in h.tensors)
    actual_params = sum(e.numel for h in headers for e in h.tensors)
    for key, actual in (("total_size", actual_bytes), ("total_parameters", actual_params)):
        claimed = metadata.get(key)
        if claimed is not None and claimed != actual:
            warnings.append(
                f"index metadata.{key} is {claimed!r} but the shards hold {actual} "
                f"({'bytes' if key == 'total_size' else 'parameters'}); ignored"
            )
    return problems, warnings


def unreferenced_series(referenced: list[str], present: list[str]) -> list[str]:
    """Files like ``model-00003-of-00004.safetensors`` of the index's series, not in it."""
    prefixes = {m["prefix"] for n in referenced if (m := _SERIES.match(n))}
    return [
        f"shard {n} is not referenced by the index"
        for n in present
        if n not in referenced and (m := _SERIES.match(n)) and m["prefix"] in prefixes
    ]
