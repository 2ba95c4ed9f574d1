"""reshard, columnar (``shardctl/reshard/columnar.py``): an HF source cut into rank files by
kind of box, a chunk of targets per numpy call, must write exactly the bytes of the per-target
paths (short path and block path), interleave with the block path inside one file where a
tensor is too large for it, and keep the run's safety: the input checksum fed from its reads,
a source cut mid-run reported (never a crash), nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from shardctl.checkpoint.record import RECORD_NAME
from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io import faults
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.reshard import columnar, columnar_merge, copy
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._models import LLAMA3_VOCAB, MANY_QWEN3_MOE, make_checkpoint
from tests.test_reliability_input_hash import copy_dir, flip
from tests.test_reshard_roundtrip import same_checkpoint

CASES = [
    ("mixtral", Mesh(tp=2, ep=2)),  # experts whole per ep rank, w1/w3 rows, w2 columns
    ("llama", Mesh(tp=4)),  # q/k/v/gate/up rows, o/down columns, vocab rows, norms replicated
    ("qwen3_moe", Mesh(pp=2, ep=2)),  # stages: a file holds a run of layers
    ("qwen2", Mesh(tp=2)),  # q/k/v biases split with their heads
    ("gpt2", Mesh(tp=2)),  # Conv1D [in, out]: fused c_attn is several pieces (the old way)
    ("phi3", Mesh(tp=2)),  # fused qkv / gate_up: the old way, inside the same files
    ("gpt_oss", Mesh(tp=2, ep=2)),  # packed experts [E, H, 2I]: E/ep x H strided rows
    ("deepseek_v3", Mesh(tp=2, ep=2)),  # MLA projections, shared and routed experts
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("columnar-src")
    return {name: make_checkpoint(name, root / name) for name, _ in CASES}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


def _recorded(d: Path) -> dict[str, Any]:
    """The record's file list (names, sizes, digests): the same bytes, the same record."""
    rec = json.loads((d / RECORD_NAME).read_text())
    return {f["name"]: (f["size"], f["digest"]) for f in rec["files"]}


def _counted(
    monkeypatch: pytest.MonkeyPatch, on: bool, owner: Any, name: str, run: Any
) -> tuple[int, int]:
    """Call ``run()`` with the columnar paths ``on`` and spies on ``owner.name`` (a columnar
    chunk writer: ``(…, a, b)`` writes targets ``[a, b)``) and the per-target ``_group``;
    (targets the columnar path wrote, tensors the per-target paths wrote)."""
    wrote: list[int] = []
    old: list[int] = []
    write, group = getattr(owner, name), copy.Executor._group

    def spy_write(*args: Any) -> None:
        wrote.append(args[-1] - args[-2])
        write(*args)

    def spy_group(self: copy.Executor, targets: Any) -> None:
        old.append(1)
        group(self, targets)

    monkeypatch.setattr(columnar, "ENABLED", on)
    monkeypatch.setattr(owner, name, spy_write)
    monkeypatch.setattr(copy.Executor, "_group", spy_group)
    run()
    return sum(wrote), len(old)


def _run(
    src: Path, dst: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch, *, on: bool
) -> tuple[int, int]:
    """Reshard; (targets the columnar path wrote, tensors the per-target paths wrote)."""
    return _counted(monkeypatch, on, columnar.Chunks, "write", lambda: reshard(src, dst, mesh=mesh))


@pytest.mark.parametrize("size", ["default", "tiny", "many"])
@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_the_same_bytes_as_the_per_target_paths(
    sources: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    mesh: Mesh,
    size: str,
) -> None:
    if size == "tiny":
        # chunks of a few targets, every tensor over 4 KiB of SRC the block path's, reads never
        # merged across a hole and one chunk buffer: cuts, interleaving and waiting for writers
        monkeypatch.setattr(columnar, "CHUNK", 700)
        monkeypatch.setattr(columnar, "SPAN_MAX", 4096)
        monkeypatch.setattr(columnar, "GAP", 0)
        monkeypatch.setattr(columnar, "BUFFERS", 1)
    if size == "many":
        # every batch counts as one of many targets: chunks cut at CHUNK_MANY, not CHUNK
        monkeypatch.setattr(columnar, "MANY", 0)
        monkeypatch.setattr(columnar, "CHUNK_MANY", 900)
        monkeypatch.setattr(columnar, "BUFFERS", 1)
    sizes: list[int | None] = []
    real_chunks = columnar.chunks

    def chunks(cols: columnar.Columns, a: int, b: int, size: int | None = None) -> Any:
        sizes.append(size)
        return real_chunks(cols, a, b, size)

    monkeypatch.setattr(columnar, "chunks", chunks)
    src = sources[name]
    on, off = tmp_path / "on", tmp_path / "off"
    took, old = _run(src, on, mesh, monkeypatch, on=True)
    assert set(sizes) == {900 if size == "many" else columnar.CHUNK}
    took0, _ = _run(src, off, mesh, monkeypatch, on=False)
    assert took > 0 and took0 == 0
    if name in ("gpt2", "phi3") or size == "tiny":
        assert old > 0  # fused parts / large tensors went the old way in the same run
    a, b = _files(on), _files(off)
    assert a.keys() == b.keys()
    for file in a:
        assert a[file] == b[file], file
    assert _recorded(on) == _recorded(off)
    assert verify(src, on, level="bitwise").ok


def test_ten_thousand_tensors_from_dozens_of_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10,000+ tensors in 20+ SRC files: the chunks' reads span file boundaries, every target but
    # the vocabulary's goes this way, the round trip is bit-exact
    src = make_checkpoint("qwen3_moe", tmp_path / "src", **MANY_QWEN3_MOE)
    assert len(list(src.glob("*.safetensors"))) > 20
    mesh = Mesh(tp=2, ep=2)
    took, _ = _run(src, tmp_path / "on", mesh, monkeypatch, on=True)
    _run(src, tmp_path / "off", mesh, monkeypatch, on=False)
    tensors = sum(len(read_header(p).tensors) for p in src.glob("*.safetensors"))
    assert tensors > 10_000 and took > tensors  # tp halves and ep-replicated norms
    assert _files(tmp_path / "on") == _files(tmp_path / "off")
    reshard(tmp_path / "on", tmp_path / "back", fmt="hf")
    same_checkpoint(src, tmp_path / "back")


def test_real_vocabulary_and_heads_interleave_with_the_block_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Llama-3's 128,256-entry vocabulary and 32 / 8 heads (widths shrunk), tp 4: each rank's
    # 16 MiB embedding and head go the block path, the head-count cuts of attention and MLP
    # this one, inside the same rank files
    src = make_checkpoint("llama", tmp_path / "src", **LLAMA3_VOCAB)
    mesh = Mesh(tp=4)
    took, old = _run(src, tmp_path / "on", mesh, monkeypatch, on=True)
    _run(src, tmp_path / "off", mesh, monkeypatch, on=False)
    assert took > 0 and old >= 2  # embed_tokens and lm_head
    assert _files(tmp_path / "on") == _files(tmp_path / "off")
    assert verify(src, tmp_path / "on", level="bitwise").ok
    # and back: column cuts of 32 heads put into strided boxes, the vocabulary the old way
    took, old = _merge(tmp_path / "on", tmp_path / "back", monkeypatch, on=True)
    _merge(tmp_path / "on", tmp_path / "back0", monkeypatch, on=False)
    assert took > 0 and old >= 2
    assert _files(tmp_path / "back") == _files(tmp_path / "back0")
    same_checkpoint(src, tmp_path / "back")


def test_a_source_cut_mid_run_is_the_clear_error_and_leaves_nothing(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # reads are pread, not a map: a source another process cuts between chunks is the engine's
    # "input changed during run" (exit 5), never a SIGBUS
    src = copy_dir(sources["mixtral"], tmp_path / "src")
    monkeypatch.setattr(columnar, "CHUNK", 2048)
    write = columnar.Chunks.write
    calls: list[int] = []

    def cut(self: columnar.Chunks, outs: Any, cols: Any, a: int, b: int) -> None:
        calls.append(1)
        if len(calls) == 3:
            os.truncate(src / "model.safetensors", os.path.getsize(src / "model.safetensors") // 2)
        write(self, outs, cols, a, b)

    monkeypatch.setattr(columnar.Chunks, "write", cut)
    dst = tmp_path / "out"
    with pytest.raises(EnvironmentFailure, match="input changed during run"):
        reshard(src, dst, mesh=Mesh(tp=2, ep=2))
    assert len(calls) >= 3 and not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_a_writer_failure_stops_the_chunks(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a failing write (disk full) while the main thread waits for a chunk buffer: the run stops
    # with that error, not a hang, and leaves nothing
    monkeypatch.setattr(columnar, "CHUNK", 2048)
    monkeypatch.setattr(columnar, "BUFFERS", 1)
    faults.reset()
    monkeypatch.setenv("SHARDCTL_FAULT", "shard_started:2:raise:ENOSPC")
    dst = tmp_path / "out"
    with pytest.raises(EnvironmentFailure, match="no space left"):
        reshard(sources["mixtral"], dst, mesh=Mesh(tp=2, ep=2))
    faults.reset()
    assert not dst.exists()


def test_the_input_checksum_is_fed_from_the_chunks_reads(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an HF checkpoint with shardctl's record (xxh3-128 digests, hashed on the reading thread):
    # the checksum is fed from the columnar path's reads, with no second read of the file, and
    # a flipped bit never commits
    from shardctl.checkpoint import input_check

    hf = tmp_path / "hf"
    reshard(sources["mixtral"], hf, fmt="hf")
    whole: list[Path] = []
    real = input_check.hash_file
    monkeypatch.setattr(input_check, "hash_file", lambda p, *a: whole.append(p) or real(p, *a))
    mesh = Mesh(tp=2, ep=2)
    took, _ = _run(hf, tmp_path / "ok", mesh, monkeypatch, on=True)
    assert took > 0 and whole == []
    src = copy_dir(hf, tmp_path / "src")
    victim = src / "model.safetensors"
    flip(victim, victim.stat().st_size - 1)  # the last byte: the last read of the file
    with pytest.raises(InvalidInputError, match="input hash mismatch"):
        reshard(src, tmp_path / "bad", mesh=mesh)
    assert whole == [] and not (tmp_path / "bad").exists()


def test_one_tensor_per_file_never_reads_across_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # files of a few hundred bytes: the next file's first byte is nearer than GAP in the sort
    # key (file x a power of two + byte), yet a read must stop at its file's end
    from tests.test_reliability_limits import write_many_files

    src = tmp_path / "src"
    files = write_many_files(src, layers=4)
    assert files > 30
    took, _ = _run(src, tmp_path / "on", Mesh(tp=2), monkeypatch, on=True)
    _run(src, tmp_path / "off", Mesh(tp=2), monkeypatch, on=False)
    assert took > files
    assert _files(tmp_path / "on") == _files(tmp_path / "off")


def test_segments_of_a_few_targets_write_the_same_bytes(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the columns are worked out a segment of the walk at a time (memory flat in the target
    # count): segments of a handful of targets, cut where a tensor starts, kinds of box shared
    # between segments, give the bytes of one segment and of the per-target paths
    src, mesh = sources["mixtral"], Mesh(tp=2, ep=2)
    seen: list[int] = []
    real = columnar.plan
    monkeypatch.setattr(columnar, "plan", lambda b, g, *a: seen.append(g.size) or real(b, g, *a))
    monkeypatch.setattr(columnar, "SEGMENT", 5)
    took, _ = _run(src, tmp_path / "small", mesh, monkeypatch, on=True)
    assert len(seen) > 10 and max(seen) < 20
    monkeypatch.setattr(columnar, "SEGMENT", 10**9)
    took1, _ = _run(src, tmp_path / "one", mesh, monkeypatch, on=True)
    _run(src, tmp_path / "off", mesh, monkeypatch, on=False)
    assert took == took1 > 0
    assert _files(tmp_path / "small") == _files(tmp_path / "one") == _files(tmp_path / "off")


# ---- the merge back (columnar_merge): rank files to whole tensors ---------------------------

MERGES = [
    ("mixtral", Mesh(tp=2, ep=2)),  # expert halves by rows and by columns, norms replicated
    ("llama", Mesh(tp=4)),  # column cuts put back into strided boxes
    ("qwen3_moe", Mesh(pp=2, ep=2)),
    ("gpt2", Mesh(tp=2)),  # fused c_attn: several pieces a shard, the per-target way
    ("gpt_oss", Mesh(tp=2, ep=2)),  # packed experts: 3-D boxes
    ("deepseek_v3", Mesh(tp=2, ep=2)),
]


def _merge(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch, *, on: bool) -> tuple[int, int]:
    """Merge ``src`` to HF; (tensors the columnar merge wrote, tensors the old way wrote)."""
    return _counted(monkeypatch, on, columnar_merge, "write", lambda: reshard(src, dst, fmt="hf"))


@pytest.mark.parametrize("size", ["default", "tiny"])
@pytest.mark.parametrize("name,mesh", MERGES, ids=[f"{n}-{m}" for n, m in MERGES])
def test_the_merge_writes_the_same_bytes_as_the_per_target_paths(
    sources: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    mesh: Mesh,
    size: str,
) -> None:
    split = tmp_path / "split"
    reshard(sources[name], split, mesh=mesh)
    if size == "tiny":
        # chunks of a tensor or two, segments of a few tensors, one buffer, no read-through
        monkeypatch.setattr(columnar, "CHUNK", 4096)
        monkeypatch.setattr(columnar, "SEGMENT", 7)
        monkeypatch.setattr(columnar, "GAP", 0)
        monkeypatch.setattr(columnar, "BUFFERS", 1)
    took, old = _merge(split, tmp_path / "on", monkeypatch, on=True)
    took0, _ = _merge(split, tmp_path / "off", monkeypatch, on=False)
    assert took > 0 and took0 == 0
    if name == "gpt2" or size == "tiny":
        assert old > 0
    assert _files(tmp_path / "on") == _files(tmp_path / "off")
    same_checkpoint(sources[name], tmp_path / "on")


def test_the_merge_of_ten_thousand_tensors_from_many_rank_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_checkpoint("qwen3_moe", tmp_path / "src", **MANY_QWEN3_MOE)
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2, ep=2), max_shard_size=400_000)
    assert len(list(split.glob("rank-*.safetensors"))) > 8
    took, _ = _merge(split, tmp_path / "on", monkeypatch, on=True)
    assert took > 10_000
    same_checkpoint(src, tmp_path / "on")


def test_boxes_that_do_not_tile_are_left_to_the_per_target_way(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the tiling check decides per pattern; a pattern it refuses goes the old way, which writes
    # (or reports) exactly as before
    assert columnar_merge._exact([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])])
    assert columnar_merge._exact([4, 6], [([0, 0], [4, 3]), ([0, 3], [4, 3])])
    assert not columnar_merge._exact([4, 6], [([0, 0], [3, 6]), ([2, 0], [1, 6])])  # overlap
    assert not columnar_merge._exact([4, 6], [([0, 0], [2, 6]), ([1, 0], [2, 6])])  # and hole
    assert not columnar_merge._exact([4, 6], [([0, 0], [2, 6]), ([3, 0], [2, 6])])  # out
    assert not columnar_merge._exact([4, 6], [])
    split = tmp_path / "split"
    reshard(sources["mixtral"], split, mesh=Mesh(tp=2, ep=2))
    monkeypatch.setattr(columnar_merge, "_exact", lambda dims, boxes: False)
    took, old = _merge(split, tmp_path / "refused", monkeypatch, on=True)
    assert took == 0 and old > 0
    same_checkpoint(sources["mixtral"], tmp_path / "refused")
