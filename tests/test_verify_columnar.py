"""verify bitwise, columnar (``shardctl/verify/bitwise/columnar.py``): a clean HF-to-ranks
verify settled on the record's arrays must report exactly what the span and block paths report
(verdict, figures, rows), and anything it cannot settle — a difference, a checksum that does not
match, a layout it does not cover — must reach the other paths' findings unchanged."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from shardctl.verify.bitwise import columnar
from tests._verify_fixtures import Checkpoints
from tests.test_verify_spans import _flip

FIGURES = ("tensors", "shards", "padded_shards", "src_bytes", "dst_bytes", "hash")


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-columnar"))


def _flipped_copy(src: Path, tmp_path: Path, fqn: str, byte: int, bit: int) -> Path:
    """A copy of HF checkpoint ``src`` with one bit of tensor ``fqn`` flipped."""
    changed = tmp_path / "src"
    shutil.copytree(src, changed)
    [path] = [p for p in changed.glob("*.safetensors") if fqn in read_header(p).names]
    _flip(path, fqn, byte, bit)
    return changed


def _settled(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Spy on ``columnar.check``: per call, whether it settled the level."""
    settled: list[bool] = []
    real = columnar.check

    def spy(*args: Any) -> Any:
        got = real(*args)
        settled.append(got is not None)
        return got

    monkeypatch.setattr(columnar, "check", spy)
    return settled


def _run(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch, *, on: bool) -> Any:
    """(ok, findings, figures, rows, whether the columnar path settled it)."""
    monkeypatch.setattr(columnar, "ENABLED", on)
    settled = _settled(monkeypatch)
    result = verify(src, dst, level="bitwise")
    bw = result.level_result("bitwise")
    findings = sorted((f.message, f.fqn or "", f.rank or 0, f.file or "") for f in bw.findings)
    figures = {k: bw.figures.get(k) for k in FIGURES}
    return result.ok, findings, figures, list(bw.rows), settled == [True]


CLEAN = [
    ("mixtral", Mesh(ep=2, tp=2)),  # experts whole per ep rank, halves by rows (w1/w3) or
    ("llama", Mesh(tp=4)),  # columns (w2: strided in SRC); vocab rows split, norms replicated
    ("qwen3_moe", Mesh(pp=2, ep=2)),
    ("qwen2", Mesh(tp=2)),  # q/k/v biases split with their heads
]


@pytest.mark.parametrize("window", ["default", "tiny", "in-place"])
@pytest.mark.parametrize("name,mesh", CLEAN, ids=[f"{n}-{m}" for n, m in CLEAN])
def test_clean_layouts_are_settled_with_the_same_report(
    cks: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    mesh: Mesh,
    window: str,
) -> None:
    if window == "tiny":
        # windows of a few shards and every shard "large": the window cuts, the checksum fed
        # range by range, and the slab-by-slab path of large shards (runs and strided boxes)
        monkeypatch.setattr(columnar, "WINDOW", 300)
        monkeypatch.setattr(columnar, "LARGE", 64)
        monkeypatch.setattr(columnar, "GATHER", 100)  # a kind's shards a few at a time
    if window == "in-place":  # every shard compared by itself, with no gathered copy
        monkeypatch.setattr(columnar, "BY_SHARD", 1)
        monkeypatch.setattr(columnar, "BY_SHARD_RUN", 1)
    src, dst = cks.ckpt(name), cks.resharded(name, mesh)
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, settled0 = _run(src, dst, monkeypatch, on=False)
    assert ok and ok0 and not findings and not findings0
    assert settled and not settled0
    assert figures == figures0 and rows == rows0
    assert figures["hash"] == "xxh3-128"


ENDS = ("w3.weight", "w2.weight", "post_attention_layernorm.weight")


@pytest.mark.parametrize("window", ["default", "tiny"])
@pytest.mark.parametrize("mesh", [Mesh(ep=2), Mesh(ep=2, tp=2)], ids=["ep2", "ep2-tp2"])
def test_without_the_record_checksums_every_shard_is_still_read_and_compared(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, window: str, mesh: Mesh
) -> None:
    # hashes off (bench/verify.py --hashes 0): with no checksum to feed, the bytes between
    # shards (headers) are passed over, not read; every shard is still read and compared, so
    # a flipped bit in a whole expert (ep 2: a stretch of experts), a column-cut half (tp 2:
    # strided in SRC) or a replicated norm (gathered) is found and named as the other paths
    # name it
    if window == "tiny":
        monkeypatch.setattr(columnar, "WINDOW", 300)
        monkeypatch.setattr(columnar, "LARGE", 64)
    src, dst = cks.ckpt("mixtral"), cks.resharded("mixtral", mesh)
    settled = _settled(monkeypatch)
    clean = verify(src, dst, level="bitwise", hashes=False)
    assert clean.ok and settled == [True]
    assert clean.level_result("bitwise").figures["shards"] > 0
    path = sorted(dst.glob("rank-*.safetensors"))[1]
    names = read_header(path).names
    # the last of each in the file: past the first window at the tiny size
    picks = [sorted(n for n in names if n.endswith(end))[-1] for end in ENDS]
    for fqn in picks:
        _flip(path, fqn, 4099, 2)
        settled.clear()
        got = verify(src, dst, level="bitwise", hashes=False)
        bw = got.level_result("bitwise")
        assert not got.ok and settled == [False]
        assert [f.fqn for f in bw.findings if f.fqn] == [fqn]
        _flip(path, fqn, 4099, 2)  # back: the next pick is the only difference
    assert verify(src, dst, level="bitwise", hashes=False).ok


def test_a_flipped_bit_anywhere_is_handed_over_and_named(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = cks.ckpt("mixtral"), cks.resharded("mixtral", Mesh(ep=2, tp=2))
    rng = random.Random(11)
    files = sorted(dst.glob("rank-*.safetensors"))
    for path in files:
        names = [e.name for e in read_header(path).tensors]
        # a whole-expert half by rows, a strided half by columns, a replicated norm
        for pick in ("w1.weight", "w2.weight", "input_layernorm.weight"):
            fqn = rng.choice([n for n in names if n.endswith(pick)])
            _flip(path, fqn, rng.randrange(1 << 16), rng.randrange(8))
    for window, gather in ((columnar.WINDOW, columnar.GATHER), (300, 100)):
        monkeypatch.setattr(columnar, "WINDOW", window)
        monkeypatch.setattr(columnar, "GATHER", gather)
        ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
        ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
        assert not ok and not ok0 and not settled
        assert findings == findings0 and len([f for f in findings if f[1]]) == 3 * len(files)
        assert figures == figures0 and rows == rows0


def test_a_source_that_differs_is_found_by_the_compare_itself(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # DST intact (its checksums match), SRC changed: only the shard-by-shard compare can see
    # it, in whichever gathered part of a kind the changed tensor falls
    src, dst = cks.ckpt("mixtral"), cks.resharded("mixtral", Mesh(ep=2, tp=2))
    changed = tmp_path / "src"
    shutil.copytree(src, changed)
    rng = random.Random(5)
    for path in sorted(changed.glob("*.safetensors")):
        names = [e.name for e in read_header(path).tensors]
        for pick in ("w1.weight", "w2.weight"):
            # the last expert of the last layer: past the first gathered part of its kind
            fqn = sorted(n for n in names if n.endswith(pick))[-1]
            _flip(path, fqn, rng.randrange(1 << 10), rng.randrange(8))
    w, g, b, r = columnar.WINDOW, columnar.GATHER, columnar.BY_SHARD, columnar.BY_SHARD_RUN
    # defaults, small gathers, small windows, then every shard in place
    for ways in ((w, g, b, r), (w, 100, b, r), (300, 100, b, r), (w, g, 1, 1)):
        for attr, value in zip(("WINDOW", "GATHER", "BY_SHARD", "BY_SHARD_RUN"), ways, strict=True):
            monkeypatch.setattr(columnar, attr, value)
        ok, findings, _, _, settled = _run(changed, dst, monkeypatch, on=True)
        ok0, findings0, _, _, _ = _run(changed, dst, monkeypatch, on=False)
        assert not ok and not ok0 and not settled
        assert findings == findings0 and any(f[1] for f in findings)


def _stretched(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Spy on ``columnar._compare_runs``: per call, the shards it settled as stretches (None:
    it found a difference)."""
    taken: list[int | None] = []
    real = columnar._compare_runs

    def spy(*args: Any) -> Any:
        left = real(*args)
        taken.append(None if left is None else int((~left).sum()))
        return left

    monkeypatch.setattr(columnar, "_compare_runs", spy)
    return taken


@pytest.mark.parametrize("where", ["clean", "dst", "src"])
def test_whole_experts_in_source_order_are_compared_as_stretches(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    # An ep split keeps each expert whole (12 KiB here) and in SRC's order: a rank's experts
    # follow one another in its file and in SRC, and are compared as one stretch of each side
    # (at the default thresholds). A bit flipped inside a stretch, in DST (its checksum then
    # differs too) or in SRC (DST intact: only the compare can see it), is handed over and
    # named exactly as the other paths name it.
    src, dst = cks.ckpt("mixtral"), cks.resharded("mixtral", Mesh(ep=2))
    fqn = "model.layers.1.block_sparse_moe.experts.0.w3.weight"  # between experts 0's w2, 1's w1
    if where == "dst":
        _flip(dst / "rank-00000-of-00002.safetensors", fqn, 4097, 3)
    if where == "src":
        src = _flipped_copy(src, tmp_path, fqn, 4097, 3)
    taken = _stretched(monkeypatch)
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert findings == findings0 and figures == figures0 and rows == rows0
    if where == "clean":
        assert ok and ok0 and settled and not findings
        # both layers' two experts of 3 weights, on each rank
        assert sum(n or 0 for n in taken) >= 2 * 2 * 3 * 2
    else:
        assert not ok and not ok0 and not settled
        assert None in taken  # found by the stretch compare (the other file may stop first)
        assert [f[1] for f in findings if f[1]] == [fqn]


def test_a_checksum_that_does_not_match_is_handed_over(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every shard equal but a recorded checksum wrong: the record, not the data, differs; the
    # other path words it ("the file is not what reshard wrote"), exactly as before
    src, dst = cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=2))
    path = dst / "shardctl.layout.json"
    doc = json.loads(path.read_text())
    doc["files"][0]["digest"] = "0" * len(doc["files"][0]["digest"])
    path.write_text(json.dumps(doc))
    ok, findings, _, _, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, _, _, _ = _run(src, dst, monkeypatch, on=False)
    assert not ok and not ok0 and not settled and findings == findings0
    assert any("differs from the record" in f[0] for f in findings)


@pytest.mark.parametrize("fault", ["drop-expert", "swap-gate-up", "fused"])
def test_layouts_it_does_not_cover_are_left_to_the_other_paths(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # a record whose structure is wrong (an expert missing), shards of two pieces (each rank's
    # [up; gate] of phi3 swapped; GPT-2's fused c_attn, its q, k and v thirds cut per rank):
    # nothing compared here, the same report either way
    if fault == "fused":
        name, dst = "gpt2", cks.resharded("gpt2", Mesh(tp=2))
    else:
        name, mesh = ("mixtral", Mesh(ep=2)) if fault == "drop-expert" else ("phi3", Mesh(tp=2))
        dst = cks.hand_split(name, mesh, fault)
    got = _run(cks.ckpt(name), dst, monkeypatch, on=True)
    want = _run(cks.ckpt(name), dst, monkeypatch, on=False)
    assert not got[4] and got[:4] == want[:4]


def test_sharded_sources_are_left_to_the_span_path(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shardctl.reshard.api import reshard

    src = cks.resharded("mixtral", Mesh(ep=2, tp=2))
    dst = tmp_path / "ep4"
    reshard(src, dst, mesh=Mesh(ep=4))
    ok, findings, _, _, settled = _run(src, dst, monkeypatch, on=True)
    assert ok and not findings and not settled


@pytest.mark.parametrize("mesh", [Mesh(ep=2, tp=2), Mesh(ep=2)], ids=["ep2-tp2", "ep2"])
def test_a_many_file_source_of_ten_thousand_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mesh: Mesh
) -> None:
    # HF SRC in dozens of files (each window gathers per SRC file and kind of box), 10,000+
    # tensors: settled, with the span path's figures and rows. Split by ep alone, each rank's
    # whole experts run in SRC's order: compared as stretches; then a bit flipped in one
    # expert of a stretch is handed over and named as the other paths name it.
    from shardctl.reshard.api import reshard
    from tests._models import MANY_QWEN3_MOE, make_checkpoint

    src = make_checkpoint("qwen3_moe", tmp_path / "src", **MANY_QWEN3_MOE)
    assert len(list(src.glob("*.safetensors"))) > 20
    dst = tmp_path / "dst"
    reshard(src, dst, mesh=mesh)
    taken = _stretched(monkeypatch)
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert ok and ok0 and settled and not findings and not findings0
    assert figures == figures0 and rows == rows0
    assert figures["tensors"] > 10_000
    if mesh.tp > 1:
        return
    assert sum(n or 0 for n in taken) > 1_000  # whole experts, settled in stretches
    fqn = "model.layers.7.mlp.experts.105.up_proj.weight"  # among experts 100-109 of rank 0
    _flip(dst / "rank-00000-of-00002.safetensors", fqn, 77, 5)
    taken.clear()
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert not ok and not ok0 and not settled and None in taken
    assert findings == findings0 and figures == figures0 and rows == rows0
    assert [f[1] for f in findings if f[1]] == [fqn]


@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_file_that_shrinks_mid_run_is_handed_over_not_a_crash(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, side: str
) -> None:
    # The columnar path reads with preadv (no map: no SIGBUS past a truncated file's end); a
    # file cut under it is a short read, which hands the run to the other paths, which
    # report it as they always did (their "short read ... the file changed during the run"
    # error, or a failing verdict).
    import os
    import shutil

    from shardctl.errors import ShardctlError

    src = tmp_path / "src"
    shutil.copytree(cks.ckpt("mixtral"), src)
    dst = cks.resharded("mixtral", Mesh(ep=2, tp=2))
    victim = src / "model.safetensors" if side == "src" else sorted(dst.glob("rank-*"))[-1]
    monkeypatch.setattr(columnar, "WINDOW", 300)  # many windows
    real = columnar._compare_window
    calls: list[int] = []

    def cut_after_first(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            os.truncate(victim, os.path.getsize(victim) // 2)
        return real(*args)

    monkeypatch.setattr(columnar, "_compare_window", cut_after_first)
    settled: list[bool] = []
    check = columnar.check
    monkeypatch.setattr(columnar, "check", lambda *a: settled.append(1) or check(*a))
    try:
        result = verify(src, dst, level="bitwise")
    except (ShardctlError, OSError) as exc:
        assert "changed" in str(exc) or isinstance(exc, ShardctlError)
    else:
        assert not result.ok
    assert len(calls) >= 2 and settled  # the columnar path ran, and handed over


def test_real_vocabulary_and_heads_are_settled_and_flips_handed_over(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Llama-3's 128,256-entry vocabulary and 32 / 8 heads (widths shrunk), tp 4: each rank's
    # embedding and head rows are 16 MiB, over LARGE, so they go slab by slab; the attention
    # and MLP shards are real head-count cuts (rows for q/k/v/gate/up, columns for o/down).
    from shardctl.reshard.api import reshard
    from tests._models import LLAMA3_VOCAB, make_checkpoint

    src = make_checkpoint("llama", tmp_path / "src", **LLAMA3_VOCAB)
    dst = tmp_path / "tp4"
    reshard(src, dst, mesh=Mesh(tp=4))
    big = [e for p in dst.glob("rank-*.safetensors") for e in read_header(p).tensors]
    assert max(e.nbytes for e in big) > columnar.LARGE  # the slab path runs
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert ok and ok0 and settled and not findings and not findings0
    assert figures == figures0 and rows == rows0
    # a bit deep in a rank's embedding slab, and one in a column-cut o_proj
    path = sorted(dst.glob("rank-*.safetensors"))[2]
    _flip(path, "model.embed_tokens.weight", 12 * 2**20 + 5, 3)
    _flip(path, "model.layers.1.self_attn.o_proj.weight", 777, 6)
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert not ok and not ok0 and not settled
    assert findings == findings0 and len([f for f in findings if f[1]]) == 2
    assert figures == figures0 and rows == rows0


@pytest.mark.parametrize("span", [1, 7, 4096, 40_000])
def test_src_spans_reads_each_box_stretch_exactly(tmp_path: Path, span: int) -> None:
    # The gathers' SRC bytes: stretches [a, a + span) for starts in any order, repeated,
    # overlapping, next to one another and far apart (merged when less than SPAN_GAP apart,
    # read apart otherwise), each found where ``where`` says in the one buffer.
    import numpy as np

    data = np.random.default_rng(span).integers(0, 256, 3 * 2**20, dtype=np.uint8)
    path = tmp_path / "src.bin"
    path.write_bytes(data.tobytes())
    size = data.size - span
    gap = columnar.SPAN_GAP
    starts = np.array(
        [size, 0, 5, 5, span, 3 * span + gap + 1, 2**20, 2**20 + gap, 17, size // 2, 1],
        dtype=np.int64,
    )
    reads = columnar._Reads()
    try:
        got, where = reads.src_spans(path, starts, span)
        for a, w in zip(starts.tolist(), where.tolist(), strict=True):
            assert np.array_equal(got[w : w + span], data[a : a + span]), a
        # merged stretches only where they are close: never much more than the boxes cover
        covered = np.zeros(data.size, dtype=bool)
        for a in starts.tolist():
            covered[a : a + span] = True
        assert where.max() + span <= int(covered.sum()) + gap * starts.size
        # a start past the end is a short read (the run is handed over), never garbage
        with pytest.raises(OSError, match="short read"):
            reads.src_spans(path, np.array([size + 1], dtype=np.int64), span)
    finally:
        reads.close()


def test_a_box_spanning_many_src_rows_is_read_slab_by_slab(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A column cut's box spans whole SRC rows: a tp-8 cut of 4 MiB spans 32 MiB of them. One
    # whose span is over 2 x LARGE goes slab by slab, a few SRC rows at a time, so no buffer
    # grows to its span (read whole, it would stay that size on each thread for the run):
    # settled with the other paths' report, and a bit flipped in one still found and named.
    monkeypatch.setattr(columnar, "LARGE", 6000)  # down_proj's tp-4 cut: 5,120 B, spans 20,240
    monkeypatch.setattr(columnar, "BY_SHARD", 1)  # compared in place, not gathered
    monkeypatch.setattr(columnar, "BY_SHARD_RUN", 1)
    src, dst = cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=4))
    slabbed: list[int] = []
    large = columnar._compare_large

    def spy_large(plan: Any, r: int, *args: Any) -> Any:
        slabbed.append(r)
        return large(plan, r, *args)

    src_reads: list[int] = []
    src_bytes = columnar._Reads.src_bytes

    def spy_reads(self: Any, path: Path, offset: int, n: int) -> Any:
        src_reads.append(n)
        return src_bytes(self, path, offset, n)

    monkeypatch.setattr(columnar, "_compare_large", spy_large)
    monkeypatch.setattr(columnar._Reads, "src_bytes", spy_reads)
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    assert ok and settled and not findings
    assert slabbed and max(src_reads) <= 2 * columnar.LARGE
    ok0, _, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert ok0 and figures == figures0 and rows == rows0
    fqn = "model.layers.1.mlp.down_proj.weight"
    _flip(sorted(dst.glob("rank-*.safetensors"))[3], fqn, 4000, 1)
    ok, findings, _, _, settled = _run(src, dst, monkeypatch, on=True)
    assert not ok and not settled and [f[1] for f in findings if f[1]] == [fqn]


@pytest.mark.parametrize("where", ["clean", "src", "dst"])
@pytest.mark.parametrize(
    "mesh", [Mesh(tp=4), Mesh(tp=2, ep=2)], ids=["llama-tp4", "mixtral-ep2-tp2"]
)
def test_column_cuts_are_compared_by_their_tensor_rows_read_once(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str, mesh: Mesh
) -> None:
    # A tensor cut by columns (o_proj, down_proj, an expert's w2) is compared by a job of its
    # own: its SRC rows read once, a slab at a time, against every shard's DST bytes (each
    # shard's file job still reads them, for the checksum). Clean, the report is the other
    # paths'; a flipped bit in SRC (DST intact, its checksums match: only the compare sees
    # it) or in DST, checksums off (only the compare sees it there too), is found by that
    # job, handed over and named as the other paths name it.
    name = "llama" if mesh.ep == 1 else "mixtral"
    monkeypatch.setattr(columnar, "BY_TENSOR", 1)  # the small test tensors qualify
    monkeypatch.setattr(columnar, "LARGE", 1000)  # and their rows go in several slabs
    src, dst = cks.ckpt(name), cks.resharded(name, mesh)
    pick = {
        "llama": "model.layers.1.mlp.down_proj.weight",
        "mixtral": "model.layers.1.block_sparse_moe.experts.2.w2.weight",
    }[name]
    if where == "src":
        src = _flipped_copy(src, tmp_path, pick, 3001, 4)
    if where == "dst":
        [path] = [p for p in sorted(dst.glob("rank-*")) if pick in read_header(p).names][-1:]
        _flip(path, pick, 301, 6)
    jobs: list[bool] = []
    real = columnar._compare_tensor

    def spy(*args: Any) -> Any:
        got = real(*args)
        jobs.append(got)
        return got

    monkeypatch.setattr(columnar, "_compare_tensor", spy)
    settled = _settled(monkeypatch)
    # an expert's w2 is cut in 2: its job would read its DST bytes a second time when they
    # feed a checksum, for one read of SRC saved, so it gets one only with checksums off
    hashes = where != "dst" and mesh.tp > 2
    result = verify(src, dst, level="bitwise", hashes=hashes)
    ran = list(jobs)
    monkeypatch.setattr(columnar, "ENABLED", False)
    other = verify(src, dst, level="bitwise", hashes=hashes)
    assert settled[1:] == [False]  # the other paths' run
    bw, bw0 = result.level_result("bitwise"), other.level_result("bitwise")
    assert ran  # the tensor jobs ran
    assert sorted(map(str, bw.findings)) == sorted(map(str, bw0.findings))
    assert list(bw.rows) == list(bw0.rows)
    if where == "clean":
        assert result.ok and settled[0] and all(ran)
        assert {k: bw.figures[k] for k in FIGURES} == {k: bw0.figures[k] for k in FIGURES}
    else:
        assert not result.ok and not settled[0] and False in ran
        assert [f.fqn for f in bw.findings if f.fqn] == [pick]


def test_a_tensor_cut_in_two_gets_its_own_job_only_without_checksums(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(columnar, "BY_TENSOR", 1)
    src, dst = cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=2))
    jobs: list[bool] = []
    real = columnar._compare_tensor
    monkeypatch.setattr(columnar, "_compare_tensor", lambda *a: jobs.append(real(*a)) or jobs[-1])
    assert verify(src, dst, level="bitwise").ok and not jobs
    assert verify(src, dst, level="bitwise", hashes=False).ok and jobs and all(jobs)


def test_real_widths_take_the_column_cut_jobs_at_the_default_sizes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Llama-3's head counts (32 query, 8 kv heads) at width 512 and a 4x MLP, tp 4, written by
    # save_pretrained: each down_proj is 2 MiB, over BY_TENSOR, cut by columns into 4 shards,
    # so its job runs at the shipped thresholds (no constant shrunk), with checksums on. The
    # report is the other paths'; a bit flipped deep in SRC's down_proj is found by that job
    # and named.
    from shardctl.reshard.api import reshard
    from tests._models import make_checkpoint

    src = make_checkpoint(
        "llama",
        tmp_path / "src",
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=2,
    )
    dst = tmp_path / "tp4"
    reshard(src, dst, mesh=Mesh(tp=4))
    fqn = "model.layers.1.mlp.down_proj.weight"
    [whole] = [
        e for p in src.glob("*.safetensors") for e in read_header(p).tensors if e.name == fqn
    ]
    assert whole.nbytes >= columnar.BY_TENSOR
    jobs: list[bool] = []
    real = columnar._compare_tensor
    monkeypatch.setattr(columnar, "_compare_tensor", lambda *a: jobs.append(real(*a)) or jobs[-1])
    ok, findings, figures, rows, settled = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert ok and ok0 and settled and not findings and not findings0
    assert figures == figures0 and rows == rows0
    assert len(jobs) == 2 and all(jobs)  # one down_proj a layer
    jobs.clear()
    # in SRC: DST's checksums still match, so only the compare, that job's, can see it
    changed = _flipped_copy(src, tmp_path / "changed", fqn, 1_300_001, 5)
    ok, findings, figures, rows, settled = _run(changed, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(changed, dst, monkeypatch, on=False)
    assert not ok and not ok0 and not settled and False in jobs
    assert findings == findings0 and [f[1] for f in findings if f[1]] == [fqn]
    assert figures == figures0 and rows == rows0
