"""The layout record is written streamed, rows encoded a chunk at a time: the text is the same
whatever the chunk size, parses back to the rows it was built from, and keeps one tensor or
shard per line (diffable, ``grep``-able)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardctl.checkpoint import record_write
from shardctl.layout.types import Mesh
from shardctl.reshard import api
from tests._models import make_checkpoint


def test_streamed_record_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_checkpoint("mixtral", tmp_path / "src")
    seen: dict[str, Any] = {}
    write = record_write.write

    def spy(directory: Path, rec: dict[str, Any]) -> Path:
        seen["rec"] = rec
        return write(directory, rec)

    monkeypatch.setattr(api.record_write, "write", spy)
    out = api.reshard(src, tmp_path / "s", mesh=Mesh(tp=2, ep=2)).dst
    rec = seen["rec"]
    text = (out / "shardctl.layout.json").read_bytes()
    for k in (1, 3, 10_000):
        monkeypatch.setattr(record_write, "ROWS_PER_CALL", k)
        assert record_write._dumps(rec) == text, k
    plain = dict(rec)
    plain["tensors"] = list(rec["tensors"])
    plain["ranks"] = [dict(r, shards=list(r["shards"])) for r in rec["ranks"]]
    assert json.loads(text) == json.loads(json.dumps(plain))
    lines = text.decode().splitlines()
    rows = len(plain["tensors"]) + sum(len(r["shards"]) for r in plain["ranks"])
    assert sum(1 for x in lines if x.lstrip().startswith('{"fqn"')) == rows
    empty = dict(plain, tensors=[], ranks=[])
    assert json.loads(record_write._dumps(empty)) == json.loads(json.dumps(empty))
