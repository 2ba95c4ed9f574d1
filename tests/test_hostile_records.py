"""Group I (issue 13): the layout record ``shardctl.layout.json`` is hostile input.

Every case edits a real record (a llama tp=2 output) and asserts: exit 3 naming the field,
nothing written to DST, the input unchanged. In process; docs/reliability.md lists the IDs.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.checkpoint import record, record_v2
from shardctl.checkpoint.source import SourceShard
from shardctl.console import exit_code_for
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh, Piece
from shardctl.reshard import boxes as boxes_mod
from shardctl.reshard import copy as copy_mod
from shardctl.reshard.api import reshard
from tests._hostile import cli, one_line, tree_sha
from tests._models import make_checkpoint

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("i-src") / "llama")


@pytest.fixture(scope="module")
def tp2(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("i-tp2") / "tp2"
    reshard(llama, out, mesh=Mesh(tp=2))
    return out


def tampered(tp2: Path, tmp_path: Path, edit: Edit, form: str = "v1") -> Path:
    """A copy of ``tp2`` whose record went through ``edit``.

    ``form``: ``"v1"`` edits (and writes) the record as schema 1 rows (older outputs);
    ``"v2"`` edits the schema-2 record reshard writes as it is; ``"v2rows"`` edits its rows
    as schema 1 and writes them back as schema-2 columns."""
    out = tmp_path / "tampered"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tp2, out)
    rec = json.loads((out / record.RECORD_NAME).read_text())
    assert rec["schema"] == record.SCHEMA_V2
    if form != "v2":
        rec = record_v2.to_v1(rec)
    edit(rec)
    if form == "v2rows":
        rec = record_v2.to_v2(rec)
    (out / record.RECORD_NAME).write_text(json.dumps(rec))
    return out


FORMS = pytest.mark.parametrize("form", ["v1", "v2"])
ROW_FORMS = pytest.mark.parametrize("form", ["v1", "v2rows"])


def refused(src: Path, tmp_path: Path, match: str) -> str:
    """Merging ``src`` is exit 3 with ``match`` in the one line; nothing written; src intact."""
    before = tree_sha(src)
    with pytest.raises(InvalidInputError) as info:
        reshard(src, tmp_path / "merged", fmt="hf")
    code, line = exit_code_for(info.value)
    assert code == 3 and "\n" not in line
    assert match in line, line
    assert not (tmp_path / "merged").exists()
    assert [n for n in os.listdir(tmp_path) if "staging" in n] == []
    assert tree_sha(src) == before
    return line


def _shard(rec: dict[str, Any], rank: int, fqn: str) -> dict[str, Any]:
    return next(s for s in rec["ranks"][rank]["shards"] if s["fqn"] == fqn)


GATE = "model.layers.0.mlp.gate_proj.weight"  # S(0) of [160, 64]: rank 1 holds rows 80..159


def _set(path: str, value: Any) -> Edit:
    def edit(rec: dict[str, Any]) -> None:
        node: Any = rec
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


# ---- I1: wrong types, each named -----------------------------------------------------------


HEAD_CASES = [
    ("mesh.tp", "two", "mesh.tp"),
    ("mesh.tp", 2.0, "mesh.tp"),
    ("mesh.tp", True, "mesh.tp"),
    ("files.0.size", "big", "files[0].size"),
    ("stages.0.layers", ["a", 3], "stages[0].layers[0]"),
    ("source.files", [1], "source.files[0]"),
    ("ranks.0.shards", {"a": 1}, "ranks[0].shards"),
    ("ranks.0.shards", [], "ranks[0].shards"),
    ("ranks.0.coord", None, "ranks[0].coord"),
    ("options.pipeline", 7, "options.pipeline"),
    ("carried", ["../../etc/passwd"], "carried[0]"),
    ("hash", ["xxh3-128"], "hash"),
]


@FORMS
@pytest.mark.parametrize(("path", "value", "field"), HEAD_CASES, ids=lambda v: str(v)[:24])
def test_I1_wrong_types_name_the_field(
    tp2: Path, tmp_path: Path, path: str, value: Any, field: str, form: str
) -> None:
    if form == "v1" and value == []:
        return  # an empty rank is a valid schema-1 row list (the tiling check refuses it)
    refused(tampered(tp2, tmp_path, _set(path, value), form), tmp_path, field)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("tensors.0.global_shape", "x", "tensors[0].global_shape"),
        ("tensors.0.dtype", "Q7", "tensors[0].dtype"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_I1_wrong_types_in_rows_v1(
    tp2: Path, tmp_path: Path, path: str, value: Any, field: str
) -> None:
    refused(tampered(tp2, tmp_path, _set(path, value)), tmp_path, field)


@pytest.mark.parametrize(
    ("path", "value", "what"),
    [
        ("tensors.ndim", "x", "tensors.ndim: expected an object"),
        ("tensors.dtypes.0", "Q7", "tensors.dtypes[0]: unknown dtype"),
        ("tensors.count", -1, "tensors.count"),
        ("tensors.fqn", ["a"], "tensors.fqn: 1 names"),
        ("ranks.1.shards.tensor.data", "!!not base64!!", "ranks[1].shards.tensor.data"),
        ("ranks.1.shards.offsets.type", "<i8", "ranks[1].shards.offsets.type"),
        ("ranks.1.shards.count", 1, "ranks[1].shards.tensor: "),
        ("ranks.1.shards.placements", [], "ranks[1].shards.placement"),
        ("ranks.0.shards.sizes", {"type": "<u1", "data": ""}, "ranks[0].shards.sizes: 0 values"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_I1_v2_columns_name_the_field(
    tp2: Path, tmp_path: Path, path: str, value: Any, what: str
) -> None:
    refused(tampered(tp2, tmp_path, _set(path, value), "v2"), tmp_path, what)


def test_I1_v2_indexes_in_range(tp2: Path, tmp_path: Path) -> None:
    """Every index column is bounded by its table; a tensor held twice by one rank is refused."""

    def col(path: str, values: list[int]) -> Edit:
        return _set(path, record_v2.column(values))

    rec = json.loads((tp2 / record.RECORD_NAME).read_text())
    n = rec["ranks"][1]["shards"]["count"]
    big = len(rec["tensors"]["fqn"])
    for path, values, what in [
        ("ranks.1.shards.tensor", [big] * n, f"ranks[1].shards.tensor[0]: {big} is out of range"),
        ("ranks.1.shards.tensor", [0] * n, "ranks[1].shards[1]: a second shard"),
        (
            "ranks.1.shards.tensor",
            [*range(n - 1), 0],
            f"ranks[1].shards[{n - 1}]: a second shard",
        ),
        ("ranks.1.shards.file", [7] * n, "ranks[1].shards.file[0]: 7 is out of range"),
        ("tensors.dtype", [9] * big, "tensors.dtype[0]: 9 is out of range"),
        ("tensors.ndim", [65] * big, "tensors.ndim[0]: 65 is out of range"),
    ]:
        refused(tampered(tp2, tmp_path, col(path, values), "v2"), tmp_path, what)


def test_I1_v2_shards_in_a_dot_file_are_refused(tp2: Path, tmp_path: Path) -> None:
    """A rank's shards may point only at the files reshard wrote: a name starting with "." (the
    staging and resume files) is refused, for a rank in one file and for a rank across files."""
    rec = json.loads((tp2 / record.RECORD_NAME).read_text())
    n = rec["ranks"][1]["shards"]["count"]
    for values, j in [([2] * n, 0), ([1] * (n - 1) + [2], n - 1)]:

        def edit(rec: dict[str, Any], values: list[int] = values) -> None:
            rec["files"].append({"name": ".x.safetensors", "size": 8, "digest": "0" * 32})
            rec["ranks"][1]["shards"]["file"] = record_v2.column(values)

        what = f"ranks[1].shards[{j}].file: '.x.safetensors' is not a recorded file"
        refused(tampered(tp2, tmp_path, edit, "v2"), tmp_path, what)


# ---- I2: degrees ---------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [-2, 0, 2**20 + 1, 2**70])
@FORMS
def test_I2_degrees_must_be_in_range(tp2: Path, tmp_path: Path, tp: int, form: str) -> None:
    refused(tampered(tp2, tmp_path, _set("mesh.tp", tp), form), tmp_path, "mesh.tp")


@FORMS
def test_I2_degrees_consistent_with_the_rank_list(tp2: Path, tmp_path: Path, form: str) -> None:
    def t(path: str, value: Any) -> Path:
        return tampered(tp2, tmp_path, _set(path, value), form)

    refused(t("mesh.tp", 4), tmp_path, "4 model-parallel ranks")
    refused(t("ranks.1.coord.tp", 0), tmp_path, "ranks[1].coord.tp")
    refused(t("ranks.1.coord.tp", -1), tmp_path, "ranks[1].coord.tp")
    refused(t("ranks.0.rank", 1), tmp_path, "ranks[0].rank")


# ---- I3–I5: exact tiling ---------------------------------------------------------------------


@ROW_FORMS
def test_I3_overlapping_pieces(tp2: Path, tmp_path: Path, form: str) -> None:
    """The red-team case: one offset 80 → 70. Same element count, rows 70..79 twice, 150..159
    never; it used to merge with exit 0 and stale buffer bytes."""

    def edit(rec: dict[str, Any]) -> None:
        _shard(rec, 1, GATE)["pieces"][0]["offsets"] = [70, 0]

    line = refused(tampered(tp2, tmp_path, edit, form), tmp_path, "overlaps")
    assert "ranks[1].shards[" in line and GATE in line


@ROW_FORMS
def test_I4_gap_in_pieces(tp2: Path, tmp_path: Path, form: str) -> None:
    def edit(rec: dict[str, Any]) -> None:
        p = _shard(rec, 1, GATE)["pieces"][0]
        p["sizes"] = [70, 64]  # rows 150..159 held by nobody

    refused(tampered(tp2, tmp_path, edit, form), tmp_path, "a gap")


@ROW_FORMS
def test_I5_piece_outside_global_shape(tp2: Path, tmp_path: Path, form: str) -> None:
    def edit(rec: dict[str, Any]) -> None:
        _shard(rec, 1, GATE)["pieces"][0]["offsets"] = [90, 0]  # rows 90..169 of 160

    refused(tampered(tp2, tmp_path, edit, form), tmp_path, "box outside the global")


@ROW_FORMS
def test_I5_overlap_inside_the_local_tensor(tp2: Path, tmp_path: Path, form: str) -> None:
    def edit(rec: dict[str, Any]) -> None:
        s = _shard(rec, 0, GATE)
        s["pieces"] = [
            {"offsets": [0, 0], "sizes": [40, 64], "local_offsets": [0, 0]},
            {"offsets": [40, 0], "sizes": [40, 64], "local_offsets": [20, 0]},
        ]

    refused(tampered(tp2, tmp_path, edit, form), tmp_path, "inside the local tensor")


# ---- I6: file names confined to DST ---------------------------------------------------------


@FORMS
@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "a/b", "..", ".", "", "a\\b"])
def test_I6_file_names_stay_inside_dst(tp2: Path, tmp_path: Path, name: str, form: str) -> None:
    def edit(rec: dict[str, Any]) -> None:
        rec["files"][0]["name"] = name

    refused(tampered(tp2, tmp_path, edit, form), tmp_path, "files[0].name")


def test_I6_verify_never_reads_outside_dst(
    llama: Path, tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"\0" * 16)

    def edit(rec: dict[str, Any]) -> None:
        rec["files"].append({"name": "../outside.safetensors", "size": 16, "digest": "00"})

    dst = tampered(tp2, tmp_path, edit)
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *a: Any, **k: Any) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    code, _out, err = cli("verify", str(llama), str(dst), "--level", "structure")
    monkeypatch.undo()
    one_line(code, err, 3)
    assert "files[" in err
    assert not any("outside" in p for p in opened), opened


# ---- I7: depth and size ---------------------------------------------------------------------


def test_I7_deep_json_record_config_and_metadata(llama: Path, tp2: Path, tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    dst = tmp_path / "deep"
    shutil.copytree(tp2, dst)
    (dst / record.RECORD_NAME).write_text('{"schema": "shardctl.layout/1", "x": ' + deep + "}")
    refused(dst, tmp_path, "nests too deeply")
    # DST config.json 100k deep: verify exit 3, one line (was a RecursionError, exit 70)
    dst2 = tmp_path / "deep-config"
    shutil.copytree(tp2, dst2)
    (dst2 / "config.json").write_text(deep)
    code, _out, err = cli("verify", str(llama), str(dst2), "--level", "structure")
    one_line(code, err, 3)
    assert "nests too deeply" in err


def test_I7_record_size_capped(tp2: Path, tmp_path: Path) -> None:
    dst = tmp_path / "big"
    shutil.copytree(tp2, dst)
    with open(dst / record.RECORD_NAME, "r+b") as f:
        f.truncate(record.MAX_RECORD_BYTES + 1)  # sparse: costs no disk
    refused(dst, tmp_path, "limit")


# ---- I8: names and shapes inside the record -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "what"),
    [
        ("tensors.0.fqn", "w\ud800", "lone surrogate"),
        ("tensors.0.global_shape", [1] * 65, "above the limit"),
        ("tensors.0.global_shape", [2**41, 1], "out of range"),
        ("tensors.0.fqn", "", "empty name"),
    ],
    ids=["surrogate", "65-dims", "huge-dim", "empty-fqn"],
)
@ROW_FORMS
def test_I8_names_and_shapes(
    tp2: Path, tmp_path: Path, path: str, value: Any, what: str, form: str
) -> None:
    if form == "v2rows" and what == "above the limit":
        what = "tensors.ndim[0]: 65 is out of range"  # schema 2 stores the dim count
    if form == "v2rows" and path == "tensors.0.fqn":  # shards refer to tensors by index
        form, path = "v2", "tensors.fqn.0"
    refused(tampered(tp2, tmp_path, _set(path, value), form), tmp_path, what)


# ---- I9: the copy asserts exact tiling before writing a byte --------------------------------


def _src(pieces: list[tuple[int, int]]) -> list[SourceShard]:
    return [
        SourceShard("w", "U8", (n, 4), (Piece((o, 0), (n, 4), (0, 0)),), begin=0, file=i)
        for i, (o, n) in enumerate(pieces)
    ]


def test_I9_copy_refuses_overlap_with_the_right_count() -> None:
    target = [Piece((0, 0), (16, 4), (0, 0))]
    assert len(boxes_mod.plan_boxes("w", target, _src([(0, 8), (8, 8)]))) == 2
    with pytest.raises(InvalidInputError, match="overlapping"):
        boxes_mod.plan_boxes("w", target, _src([(0, 8), (6, 8), (14, 2)]))  # 8+8+2 != 16
    with pytest.raises(InvalidInputError, match="overlapping"):
        boxes_mod.plan_boxes("w", target, _src([(0, 8), (6, 8)]))  # 16 = 16, rows 6,7 twice


def test_I9_no_output_byte_comes_from_an_earlier_block(
    llama: Path, tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pooled buffer is poisoned with 0xA5 before use, blocks are tiny (many reuses), and
    the merged and re-split outputs still equal the source bit for bit: every byte of every
    block was written by this block (data or explicit zero padding)."""
    real_init = copy_mod.Executor.__init__

    def poisoned(self: Any, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        bufs = []
        while not self.pool.empty():
            b = self.pool.get()
            b[:] = b"\xa5" * len(b)
            bufs.append(b)
        for b in bufs:
            self.pool.put(b)
        self.scratch_buf[:] = b"\xa5" * len(self.scratch_buf)

    monkeypatch.setattr(copy_mod.Executor, "__init__", poisoned)
    merged = tmp_path / "merged"
    reshard(tp2, merged, fmt="hf", block_bytes=4096)
    assert (merged / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()
    gpt = make_checkpoint("gpt2", tmp_path / "gpt2", vocab_size=250)  # padded vocab at tp=4
    tp4 = tmp_path / "gpt-tp4"
    reshard(gpt, tp4, mesh=Mesh(tp=4), block_bytes=4096)
    back = tmp_path / "gpt-back"
    reshard(tp4, back, fmt="hf", block_bytes=4096)
    assert (back / "model.safetensors").read_bytes() == (gpt / "model.safetensors").read_bytes()
    for name in os.listdir(tp4):
        if name.endswith(".safetensors"):
            data = np.frombuffer((tp4 / name).read_bytes(), dtype=np.uint8)
            assert not (np.convolve(data == 0xA5, np.ones(64), "valid") == 64).any(), name


# ---- I10: a valid record still reads (no false refusals) ------------------------------------


def test_I10_valid_records_of_every_layout_pass(llama: Path, tmp_path: Path) -> None:
    mix = make_checkpoint("mixtral", tmp_path / "mix") if "mixtral" in _configs() else None
    for src, mesh in [(llama, Mesh(tp=4)), (llama, Mesh(pp=2, tp=2)), (llama, Mesh(tp=8))]:
        out = tmp_path / f"ok-{mesh.pp}-{mesh.tp}"
        reshard(src, out, mesh=mesh)
        record.read(out)
    if mix is not None:
        out = tmp_path / "mix-ep2"
        reshard(mix, out, mesh=Mesh(ep=2, tp=2))
        record.read(out)


def _configs() -> dict[str, Any]:
    from tests._models import CONFIGS

    return CONFIGS


def test_I7_v2_allocation_is_bounded(
    tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Columns are int64 in memory: a few bytes of JSON must not ask for GBs. Piece counts a
    rank's offsets column cannot back are refused before anything is sized by them, and the
    cells a table may hold are capped (a small cap here stands in for 2^26)."""
    rec = json.loads((tp2 / record.RECORD_NAME).read_text())
    n = rec["ranks"][1]["shards"]["count"]
    edit = _set("ranks.1.shards.pieces", record_v2.column([2**16] * n))
    refused(tampered(tp2, tmp_path, edit, "v2"), tmp_path, "ranks[1].shards.offsets: ")
    monkeypatch.setattr(record_v2, "MAX_CELLS", 60)  # 39 tensors x 2 dims fit 78 cells
    refused(tampered(tp2, tmp_path, lambda r: None, "v2"), tmp_path, "tensors: 39 tensors")
    monkeypatch.setattr(record_v2, "MAX_CELLS", 100)
    refused(tampered(tp2, tmp_path, edit, "v2"), tmp_path, "ranks[1].shards.pieces: ")


@ROW_FORMS
def test_I4_verify_reports_a_gap_as_a_finding(
    llama: Path, tp2: Path, tmp_path: Path, form: str
) -> None:
    """verify reads DST's record without the tiling refusal (both schemas): a gap is a
    structure finding, exit 1 naming the tensor, not exit 3."""

    def edit(rec: dict[str, Any]) -> None:
        _shard(rec, 1, GATE)["pieces"][0]["sizes"] = [70, 64]

    dst = tampered(tp2, tmp_path, edit, form)
    code, out, err = cli("verify", str(llama), str(dst), "--level", "structure")
    assert code == 1, (out, err)
    assert GATE in out


@ROW_FORMS
def test_I10_record_and_rank_files_must_agree(tp2: Path, tmp_path: Path, form: str) -> None:
    """A record whose shard the rank file holds in another shape, or a recorded rank file
    gone: the merge refuses before writing (verify reports the same as findings)."""

    def edit(rec: dict[str, Any]) -> None:
        _shard(rec, 1, GATE)["local_shape"] = [81, 64]  # a valid record; its file says [80, 64]

    line = refused(tampered(tp2, tmp_path, edit, form), tmp_path, "file header disagrees")
    assert GATE in line and "[81, 64]" in line
    gone = tampered(tp2, tmp_path, lambda r: None, form)
    (gone / "rank-00001-of-00002.safetensors").unlink()
    refused(gone, tmp_path, "recorded file missing")


COLUMNS = [
    "tensor",
    "file",
    "placement",
    "local_shape",
    "pieces",
    "offsets",
    "sizes",
    "local_offsets",
]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_I11_v2_column_values_fuzzed(
    llama: Path, tp2: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Random values written into a schema-2 record's columns (kept well-formed base64 of the
    right length): merging it succeeds bit for bit or is refused with one line, exit 3."""
    rec = json.loads((tp2 / record.RECORD_NAME).read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            cols = rec["tensors"]
            key = data.draw(st.sampled_from(["dtype", "ndim", "global_shape", "padded_shape"]))
        else:
            cols = rec["ranks"][data.draw(st.integers(0, 1))]["shards"]
            key = data.draw(st.sampled_from(COLUMNS))
        values = np.frombuffer(
            base64.b64decode(cols[key]["data"]), dtype=np.dtype(cols[key]["type"])
        ).astype(np.int64)
        if values.size:
            k = data.draw(st.integers(0, values.size - 1))
            values[k] = data.draw(st.integers(0, 2**16))
        cols[key] = record_v2.column(values)
    tmp = tmp_path_factory.mktemp("fz")
    out = tmp / "tampered"
    shutil.copytree(tp2, out)
    (out / record.RECORD_NAME).write_text(json.dumps(rec))
    try:
        reshard(out, tmp / "merged", fmt="hf")
    except InvalidInputError as exc:
        code, line = exit_code_for(exc)
        assert code == 3 and "\n" not in line
        assert not (tmp / "merged").exists()
        return
    name = "model.safetensors"  # accepted: then the merge is exact
    assert (tmp / "merged" / name).read_bytes() == (llama / name).read_bytes()


@ROW_FORMS
def test_I11_record_placing_a_shard_in_another_ranks_file(
    llama: Path, tp2: Path, tmp_path: Path, form: str
) -> None:
    """lm_head's rank-0 shard pointed at rank 1's file: same name, shape and dtype there, other
    rows. Found by fuzzing (it merged with exit 0 and wrong rows): the rank files' headers name
    their rank, so the merge refuses and verify reports it."""
    head = "lm_head.weight"

    def edit(rec: dict[str, Any]) -> None:
        _shard(rec, 0, head)["file"] = "rank-00001-of-00002.safetensors"

    dst = tampered(tp2, tmp_path, edit, form)
    refused(dst, tmp_path, "holds rank 1's: rank files renamed or swapped, or the record edited")
    code, out, err = cli("verify", str(llama), str(dst), "--level", "structure")
    assert code == 1 and "renamed or swapped" in out, (out, err)
