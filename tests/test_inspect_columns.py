"""``inspect`` of a rank layout reads the record's columns (no ``Shard`` per shard): its
per-rank bytes, files and per-file shard counts equal what the shards themselves give."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from shardctl import inspect, reshard
from shardctl.checkpoint import record
from shardctl.io.safetensors_header import read_header
from tests._models import make_checkpoint


@pytest.mark.parametrize(
    ("arch", "mesh"), [("mixtral", {"tp": 2, "ep": 2}), ("llama", {"tp": 2, "pp": 2})]
)
def test_inspect_columns_equal_the_shards(arch: str, mesh: dict[str, int], tmp_path: Path) -> None:
    src = make_checkpoint(arch, tmp_path / "src")
    out = reshard(src, tmp_path / "out", mesh=mesh, max_shard_size="64KB").dst
    got = inspect(out).to_json()
    rec = record.read(out)
    assert rec.layout is not None and rec.table is not None
    counts = Counter(
        rec.shard_files[(i, s.fqn)] for i, r in enumerate(rec.layout.ranks) for s in r.shards
    )
    assert {f["name"]: f["tensors"] for f in got["files"]} == dict(counts)
    for i, (r, row) in enumerate(zip(rec.layout.ranks, got["layout"]["ranks"], strict=True)):
        names = sorted({rec.shard_files[(i, s.fqn)] for s in r.shards})
        assert row["files"] == names and len(names) > 1  # several files per rank at 64 KB
        assert row["bytes"] == sum(s.nbytes for s in r.shards)
        # and what the rank's files hold on disk
        assert row["bytes"] == sum(e.nbytes for n in names for e in read_header(out / n).tensors)
