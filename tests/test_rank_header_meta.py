"""A rank file's ``__metadata__`` names its rank and points at the record, without repeating
the record's shard rows (issue #14: those were ~8 MB of JSON per 16k-tensor file); torch DCP's
``saved_offsets`` still describe every one-piece shard, and verify still catches two rank files
swapped by their header's rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shardctl.checkpoint import record, record_v2
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._models import make_checkpoint


def test_rank_header_names_rank_and_record(tmp_path: Path) -> None:
    src = make_checkpoint("mixtral", tmp_path / "src")
    out = reshard(src, tmp_path / "s", mesh=Mesh(tp=2, ep=2)).dst
    record.read(out)  # valid
    raw = record_v2.to_v1(record.load_json(out / record.RECORD_NAME))
    for i, r in enumerate(raw["ranks"]):
        name = f"rank-{i:05d}-of-00004.safetensors"
        h = read_header(out / name)
        meta = json.loads((h.metadata or {})["shardctl"])
        assert meta == {
            "schema": "shardctl.layout/1",
            "rank": i,
            "coord": r["coord"],
            "mesh": {"pp": 1, "dp": 1, "tp": 2, "ep": 2},
            "record": "shardctl.layout.json",
            "tensors": len(h.tensors),
        }
        dcp = json.loads((h.metadata or {})["DCP_SHARDING_INFO"])
        assert dcp == {s["fqn"]: {"saved_offsets": s["pieces"][0]["offsets"]} for s in r["shards"]}


def test_swapped_rank_files_still_caught(tmp_path: Path) -> None:
    src = make_checkpoint("mixtral", tmp_path / "src")
    out = reshard(src, tmp_path / "s", mesh=Mesh(tp=2)).dst
    a, b = out / "rank-00000-of-00002.safetensors", out / "rank-00001-of-00002.safetensors"
    os.rename(a, out / "x")
    os.rename(b, a)
    os.rename(out / "x", b)
    result = verify(src, out, level="structure")
    assert not result.ok
    assert "renamed or swapped" in json.dumps(result.to_json())
