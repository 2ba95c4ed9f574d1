"""verify on the record's columns (issue #14, branch verifymem): each column path must reach
exactly what the shard-by-shard path it stands in front of reaches — the same verdicts, the
same findings, the same rows in the same order — and hand anything unusual to that path."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.rank_header import begins_if_exact
from shardctl.checkpoint.source import open_source
from shardctl.io.header_raw import read_raw
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.verify import structure
from shardctl.verify.api import verify
from shardctl.verify.bitwise import walk
from shardctl.verify.dst import DstShard, RecordDstShards, open_destination
from shardctl.verify.kinds import dense, shard_kinds
from shardctl.verify.result import LevelResult
from tests._verify_fixtures import Checkpoints

CASES = [
    ("mixtral", Mesh(ep=2, tp=2)),
    ("llama", Mesh(pp=2, tp=2)),
    ("qwen2-tied", Mesh(pp=2, tp=2)),
    ("gpt2", Mesh(tp=4)),  # vocab padding
    ("gpt_oss", Mesh(ep=2, tp=2)),  # experts packed in one tensor, split over ep
]
IDS = [f"{n}-{m}" for n, m in CASES]


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-columns"))


@pytest.mark.parametrize("name,mesh", CASES, ids=IDS)
def test_column_paths_agree_with_the_shard_paths(cks: Checkpoints, name: str, mesh: Mesh) -> None:
    src_dir, dst_dir = cks.ckpt(name), cks.resharded(name, mesh)
    source, dest = open_source(src_dir), open_destination(dst_dir)
    assert isinstance(dest.shards, RecordDstShards) and dest.record is not None
    table = dest.record.table
    assert table is not None and dest.layout is not None

    # headers: reshard's own files are settled by their bytes, at the offsets parsing finds
    rows_of = rt.rows_by_file(table)
    for k, f in enumerate(dest.record.files):
        ((rank, rows),) = rows_of[k]
        raw, size = read_raw(dst_dir / f.name, 2**24)
        got = begins_if_exact(raw, size, table, rank, rows)
        assert got is not None, f.name
        header = read_header(dst_dir / f.name)
        names = [table.tensors[t].fqn for t in table.ranks[rank].tensor[rows].tolist()]
        assert names == [e.name for e in header.tensors]
        assert got[0].tolist() == [header.data_offset + e.begin for e in header.tensors]
        assert got[1] == header.metadata

    # kinds: each row's (local shape, pieces) is the record's
    for r in table.ranks:
        kinds = shard_kinds(table, r)
        assert kinds is not None
        for j in range(len(r)):
            assert kinds[1][kinds[0][j]] == (
                rt.local_shape_at(table, r, j),
                rt.pieces_at(table, r, j),
            )

    # coverage: the column check passes exactly the layouts the shard walk finds clean;
    # packed experts split over ep are left to the walk (their groups alone do not tile)
    tensors = {t.fqn: t for t in source.model.tensors}
    slow = LevelResult("structure")
    structure._coverage(slow, dest.layout, tensors)
    assert not slow.findings
    assert structure.coverage_clean(dest.layout, table, tensors) is (name != "gpt_oss")

    # walk: same tensors in the same order, same shards in the same order, same rows
    fast = walk.walk(source, dest)
    by_fqn = walk._materialized(source, dest)
    ref = walk.Walk(by_fqn.items(), by_fqn.__getitem__)
    assert list(fast.pairs()) == list(ref.pairs())
    assert (fast.shards, fast.padded) == (ref.shards, ref.padded)
    assert fast.rows == ref.rows and list(fast.rows) == list(ref.rows)
    assert fast.rows[-1] == list(ref.rows)[-1] and len(fast.rows) == len(tensors)


def test_the_files_of_an_ep_split_disagree_and_the_sort_agrees(cks: Checkpoints) -> None:
    # ep 2 x tp 2: rank 2's first file starts with experts that rank 0's files hold late, so
    # first appearance is not an order every file agrees with and the topological sort runs
    source = open_source(cks.ckpt("mixtral"))
    dest = open_destination(cks.resharded("mixtral", Mesh(ep=2, tp=2)))
    ordered = [s for ss in walk._materialized(source, dest).values() for s in ss]
    ordered.sort(key=lambda s: (str(s.path), s.begin))
    first: dict[str, None] = {}
    for s in ordered:
        first.setdefault(s.fqn)
    assert walk.file_order(ordered) != list(first)
    assert [f for f, _ in walk.walk(source, dest).pairs()] == walk.file_order(ordered)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 12), min_size=0, max_size=10),
        min_size=1,
        max_size=4,
    )
)
def test_kahn_on_arrays_is_file_order(files: list[list[int]]) -> None:
    # any files (cycles, repeats, a tensor in several files): the array sort and the
    # set-based one give the same order
    ordered = [
        DstShard(f"t{t}", "U8", (1,), (), begin, path=Path(f"f{k}"), rank=0)
        for k, seq in enumerate(files)
        for begin, t in enumerate(seq)
    ]
    want = walk.file_order(ordered)
    ids: dict[str, int] = {}
    for s in ordered:
        ids.setdefault(s.fqn, len(ids))
    seq = np.array([ids[s.fqn] for s in ordered], dtype=np.int64)
    paths = np.array([int(str(s.path)[1:]) for s in ordered], dtype=np.int64)
    same = np.diff(paths) == 0
    names = list(ids)
    got = walk.kahn(len(ids), seq, same) if len(ids) else np.zeros(0, dtype=np.int64)
    assert [names[i] for i in got.tolist()] == want


def test_dense_numbers_equal_rows_alike() -> None:
    rng = np.random.default_rng(5)
    for cols, hi in ((1, 3), (5, 4), (9, 2**40), (3, 2**62)):
        key = rng.integers(0, hi, size=(500, cols), dtype=np.int64)
        key[250:] = key[:250]  # every row twice
        ids, first = dense(key)
        assert (key[first][ids] == key).all()  # a row's id names a row equal to it
        assert len(first) == len(np.unique(key, axis=0))  # and distinct rows get distinct ids


def test_coverage_faults_go_to_the_shard_walk(cks: Checkpoints) -> None:
    dest = open_destination(cks.resharded("mixtral", Mesh(ep=2, tp=2)))
    source = open_source(cks.ckpt("mixtral"))
    assert dest.layout is not None and dest.record is not None and dest.record.table is not None
    tensors = {t.fqn: t for t in source.model.tensors}
    cases = {}
    # SRC has a tensor no rank holds; a tensor twice as long as its pieces; an expert
    # renamed so that it no longer reads as an expert (then it is missing from one ep group)
    cases["unheld"] = {**tensors, "model.extra.weight": tensors["model.norm.weight"]}
    w = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    longer = dataclasses.replace(tensors[w], shape=(2 * tensors[w].shape[0], *tensors[w].shape[1:]))
    cases["gap"] = {**tensors, w: longer}
    for why, src in cases.items():
        slow = LevelResult("structure")
        structure._coverage(slow, dest.layout, src)
        assert slow.findings, why
        assert not structure.coverage_clean(dest.layout, dest.record.table, src), why
    # an expert pattern the names no longer match: a non-expert must be in every ep group
    real = structure._EXPERT
    try:
        structure._EXPERT = __import__("re").compile(r"\.no-such-thing\.")
        slow = LevelResult("structure")
        structure._coverage(slow, dest.layout, tensors)
        assert any("replica missing" in f.message for f in slow.findings)
        assert not structure.coverage_clean(dest.layout, dest.record.table, tensors)
    finally:
        structure._EXPERT = real


def test_a_header_in_another_writers_order_is_parsed_and_passes(cks: Checkpoints) -> None:
    # the same entries and bytes, the header's keys reordered (another writer): the byte
    # comparison refuses it, the entry-by-entry check accepts it, and verify passes
    dst = cks.resharded("llama", Mesh(tp=2))
    path = dst / "rank-00000-of-00002.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    random.Random(0).shuffle(names)
    shuffled = {"__metadata__": header["__metadata__"], **{k: header[k] for k in names}}
    text = json.dumps(shuffled, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    path.write_bytes(data[:8] + text + data[8 + n :])
    dest = open_destination(dst)
    assert dest.record is not None and dest.record.table is not None
    table = dest.record.table
    ((rank, rows),) = rt.rows_by_file(table)[
        dest.record.files.index(next(f for f in dest.record.files if f.name == path.name))
    ]
    raw, size = read_raw(path, 2**24)
    assert begins_if_exact(raw, size, table, rank, rows) is None
    assert not dest.problems
    result = verify(cks.ckpt("llama"), dst, level="structure")
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]


def test_stage_placement_on_columns_agrees_with_the_shard_walk(cks: Checkpoints) -> None:
    dest = open_destination(cks.resharded("llama", Mesh(pp=2, tp=2)))
    assert dest.layout is not None and dest.record is not None and dest.record.table is not None
    layout, table = dest.layout, dest.record.table
    layers = dest.config["num_hidden_layers"]
    clean = LevelResult("structure")
    structure._stages(clean, layout, dest)
    assert not clean.findings and structure._stages_clean(layout, table, layers)
    # stage 0 claims one layer more than it holds, stage 1 one less: layer h's tensors sit on
    # stage 1 outside its range
    (s0, s1) = layout.stages
    assert s0.layers is not None and s1.layers is not None
    h = s1.layers[0]
    shifted = dataclasses.replace(
        layout,
        stages=(
            dataclasses.replace(s0, layers=(s0.layers[0], h)),
            dataclasses.replace(s1, layers=(h + 1, s1.layers[1])),
        ),
    )
    slow = LevelResult("structure")
    structure._stages(slow, shifted, dest)

    assert any(f"layer {h} on stage 1" in f.message for f in slow.findings)
    assert not structure._stages_clean(shifted, table, layers)
