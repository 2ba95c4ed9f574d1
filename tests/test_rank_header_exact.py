"""The byte-exact rank header check (``rank_header.begins_if_exact``) on real reshard output:
it accepts a header exactly when the header is the record's rows back to back, and then gives
the offsets a full parse gives. Mixed dtypes in one file (FP8 weights, F32 block scales, BF16
norms) so the per-kind texts are exercised; any byte changed outside ``__metadata__`` (whose
content is the file's own, checked elsewhere) must send the file to the entry-by-entry check."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shardctl.checkpoint import record
from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.rank_header import begins_if_exact
from shardctl.io.header_raw import read_raw
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests import _quant
from tests._models import make_checkpoint


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("exact")
    bf16 = make_checkpoint("qwen3", root / "bf16")
    src = _quant.fp8_block(bf16, root / "fp8", block=16)
    return src, reshard(src, root / "split", mesh=Mesh(tp=2)).dst


def _files(out: Path) -> list[tuple[Path, int, object]]:
    rec = record.read(out, exact_tiling=False)
    assert rec.table is not None
    by_file = rt.rows_by_file(rec.table)
    got = []
    for k, f in enumerate(rec.files):
        if f.name.endswith(".safetensors"):
            ((rank, rows),) = by_file[k]
            got.append((out / f.name, rank, rows))
    return got


def test_accepted_headers_give_the_parsed_offsets(split: tuple[Path, Path]) -> None:
    _, out = split
    table = record.read(out, exact_tiling=False).table
    assert table is not None
    files = _files(out)
    assert files
    for path, rank, rows in files:
        raw, size = read_raw(path, 2**24)
        got = begins_if_exact(raw, size, table, rank, rows)
        assert got is not None, path.name
        begins, meta = got
        header = read_header(path)
        assert {e.dtype for e in header.tensors} >= {"F8_E4M3", "F32", "BF16"}
        at = {e.name: header.data_offset + e.begin for e in header.tensors}
        names = [table.tensors[t].fqn for t in table.ranks[rank].tensor[rows].tolist()]
        assert begins.tolist() == [at[n] for n in names]
        assert meta == header.metadata


def test_any_byte_changed_outside_the_metadata_is_refused(split: tuple[Path, Path]) -> None:
    _, out = split
    table = record.read(out, exact_tiling=False).table
    assert table is not None
    path, rank, rows = _files(out)[0]
    raw, size = read_raw(path, 2**24)
    opening = b'{"__metadata__":'
    assert raw.startswith(opening) and raw.isascii()
    _, meta_end = json.JSONDecoder().raw_decode(raw.decode(), len(opening))
    entries = meta_end + 1  # the first entry's name, after the comma
    assert raw[entries : entries + 1] == b'"'
    rng = random.Random(0)
    spots = sorted(rng.sample(range(entries, len(raw)), 300))
    for at in spots:
        old = raw[at]
        new = ord("9") if old != ord("9") else ord("8")  # a digit: offsets and shapes stay text
        bad = raw[:at] + bytes([new]) + raw[at + 1 :]
        assert begins_if_exact(bad, size, table, rank, rows) is None, (at, raw[at - 20 : at + 20])


def test_fp8_split_verifies(split: tuple[Path, Path]) -> None:
    src, out = split
    result = verify(src, out, level="bitwise")
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]


def test_a_tensor_twice_in_the_rows_is_refused(split: tuple[Path, Path]) -> None:
    # rows naming one tensor twice (a schema-1 record is not checked for it) against a header
    # written with that entry twice, byte for byte what the rows imply: still not exact (a
    # header with a duplicate key is the strict reader's to refuse)
    import numpy as np

    from shardctl.checkpoint.plan_header import entries_text, kind_text
    from shardctl.dtypes import DTYPE_BITS

    _, out = split
    table = record.read(out, exact_tiling=False).table
    assert table is not None
    _, rank, rows = _files(out)[0]
    twice = np.concatenate([rows, rows[:1]])
    infos = [table.tensors[i] for i in table.ranks[rank].tensor[twice].tolist()]
    local = table.ranks[rank].local_shape[twice].tolist()
    shapes = [row[: len(t.shape)] for row, t in zip(local, infos, strict=True)]
    sizes = [
        DTYPE_BITS[t.dtype] // 8 * int(np.prod(sh)) for t, sh in zip(infos, shapes, strict=True)
    ]
    ends = np.cumsum(sizes).tolist()
    kinds = [kind_text(t.dtype, sh) for t, sh in zip(infos, shapes, strict=True)]
    text = entries_text([t.fqn for t in infos], kinds, ends, None)
    raw, size = text[8:], len(text) + ends[-1]
    assert begins_if_exact(raw, size, table, rank, twice) is None
    # the same construction without the repeat is accepted: the refusal is the repeat's
    once = entries_text([t.fqn for t in infos[:-1]], kinds[:-1], ends[:-1], None)
    assert begins_if_exact(once[8:], len(once) + ends[-2], table, rank, rows) is not None
