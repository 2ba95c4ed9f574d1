"""The files around the tensor data: carried files, the index digest, the source identity.

``carry`` copies config.json, tokenizer and generation files byte for byte into staging; a pickle
input converted to safetensors carries the original directory's files (``with_carried``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardctl.checkpoint import record
from shardctl.checkpoint.hf import PICKLE_SUFFIXES
from shardctl.checkpoint.source import Source
from shardctl.io import atomic
from shardctl.io.checksum import new_hash


def carry(source: Source, staging: Path) -> list[str]:
    """config.json, tokenizer and generation files, byte for byte (fsynced)."""
    names: list[str] = []
    for rel in source.carried:
        if rel.name == record.RECORD_NAME:
            continue
        with open(source.root / rel, "rb") as f:
            atomic.write_file(staging / rel.name, f.read())
        names.append(rel.name)
    return names


def digest_file(path: Path, hash_name: str) -> record.FileDigest:
    h = new_hash(hash_name)
    data = path.read_bytes()
    h.update(data)
    return record.FileDigest(path.name, len(data), h.hexdigest())


def with_carried(source: Source, root: Path) -> Source:
    """A converted pickle input carries the original root's files (absolute paths)."""
    carried = tuple(
        root / n
        for n in sorted(os.listdir(root))
        if (root / n).is_file()
        and not n.startswith(".")
        and not n.endswith(PICKLE_SUFFIXES)
        and not n.endswith(".index.json")
    )
    return replace(source, carried=carried)


def identity(source: Source, src: Path, kind: str) -> dict[str, Any]:
    ident = source.identity()
    if kind == "pickle":
        ident["kind"] = "pickle"
        ident["path"] = str(Path(os.path.abspath(src)))
        ident["files"] = []
    return ident
