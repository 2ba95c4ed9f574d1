"""The layout record is written streamed. Schema 1 rows are encoded a chunk at a time: the text
is the same whatever the chunk size, parses back to the rows it was built from, and keeps one
tensor or shard per line (diffable, ``grep``-able). Schema 2 (what reshard writes) holds the
same rows as columns: converted back it equals schema 1 field for field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardctl.checkpoint import record, record_v2, record_write
from shardctl.layout.types import Mesh
from shardctl.reshard import api
from tests._models import make_checkpoint


def test_streamed_record_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_checkpoint("mixtral", tmp_path / "src")
    seen: dict[str, Any] = {}
    build = record_write.build

    def spy(**kw: Any) -> dict[str, Any]:
        seen["kw"] = kw
        return build(**kw)

    monkeypatch.setattr(api.record_write, "build", spy)
    out = api.reshard(src, tmp_path / "s", mesh=Mesh(tp=2, ep=2)).dst
    v2_text = (out / "shardctl.layout.json").read_bytes()
    v2 = json.loads(v2_text)
    assert v2["schema"] == record.SCHEMA_V2
    rec = build(**seen["kw"], schema=record.SCHEMA)
    text = record_write._dumps(rec)
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
    # schema 2 holds exactly the schema-1 rows, and converts back and forth losslessly
    v1 = json.loads(text)
    assert {**record_v2.to_v1(v2), "created": None} == {**v1, "created": None}
    assert record_v2.to_v1(record_v2.to_v2(v1)) == v1
    assert len(v2_text) * 3 < len(text)


def test_v1_records_still_read(tmp_path: Path) -> None:
    """An output whose record is schema 1 (written before issue #14) reads as the same record,
    merges bit for bit, and verifies."""
    from shardctl.verify.api import verify

    src = make_checkpoint("mixtral", tmp_path / "src")
    out = api.reshard(src, tmp_path / "s", mesh=Mesh(tp=2, ep=2)).dst
    new = record.read(out)
    path = out / record.RECORD_NAME
    path.write_text(json.dumps(record_v2.to_v1(json.loads(path.read_text()))))
    old = record.read(out)
    assert json.loads(path.read_text())["schema"] == record.SCHEMA
    assert old.tensors == new.tensors and old.padded_shapes == new.padded_shapes
    assert old.layout is not None and new.layout is not None
    for a, b in zip(old.layout.ranks, new.layout.ranks, strict=True):
        assert (a.pp, a.ep, a.tp) == (b.pp, b.ep, b.tp) and list(a.shards) == list(b.shards)
    assert dict(old.shard_files) == dict(new.shard_files)
    merged = api.reshard(out, tmp_path / "m", fmt="hf").dst
    name = "model.safetensors"
    assert (merged / name).read_bytes() == (src / name).read_bytes()
    assert verify(src, out, level="bitwise").ok
