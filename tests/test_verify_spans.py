"""verify bitwise, spans (``shardctl/verify/bitwise/spans.py``): plain small tensors checked in
batches must reach exactly the verdicts, findings and byte counts of the per-block path."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from shardctl.verify.bitwise import pipeline, spans
from tests._verify_fixtures import Checkpoints


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-spans"))


@pytest.fixture(autouse=True)
def _no_columnar(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests hold the span path to the block path: the columnar path (which settles a
    clean HF-to-ranks verify before either runs) stays out of the way."""
    from shardctl.verify.bitwise import columnar

    monkeypatch.setattr(columnar, "ENABLED", False)


def _flip(path: Path, fqn: str, byte: int, bit: int) -> None:
    header = read_header(path)
    entry = next(e for e in header.tensors if e.name == fqn)
    at = header.data_offset + entry.begin + byte % entry.nbytes
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def _run(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch, *, on: bool):  # type: ignore[no-untyped-def]
    calls = []
    real = pipeline.compare_span

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(spans, "ENABLED", on)
    monkeypatch.setattr(pipeline, "compare_span", counted)
    result = verify(src, dst, level="bitwise")
    bw = result.level_result("bitwise")
    findings = sorted((f.message, f.fqn or "", f.rank or 0, f.file or "") for f in bw.findings)
    figures = {k: bw.figures[k] for k in ("tensors", "shards", "src_bytes", "dst_bytes")}
    return result.ok, findings, figures, bw.rows, len(calls)


def test_spans_match_the_block_path_clean_and_with_flips(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = cks.ckpt("mixtral")
    dst = cks.resharded("mixtral", Mesh(ep=2, tp=2))
    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    assert ok and not findings and calls > 0
    ok0, findings0, figures0, rows0, calls0 = _run(src, dst, monkeypatch, on=False)
    assert ok0 and calls0 == 0 and figures == figures0 and rows == rows0
    # every tensor read once from SRC (spans read each plain tensor once, replicas or not)
    tensor_bytes = sum(e.nbytes for p in src.glob("*.safetensors") for e in read_header(p).tensors)
    assert figures["src_bytes"] == tensor_bytes
    # a clean span is settled by one memcmp against what the batch fills built from SRC, so
    # every way of filling (one strided copy, a gather, box by box) must build exactly DST
    slow = []
    real_compare = spans._compare_shards
    monkeypatch.setattr(spans, "_compare_shards", lambda *a: slow.append(1) or real_compare(*a))
    for direct in (0, 1 << 40):
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        assert _run(src, dst, monkeypatch, on=True)[0]
    assert not slow
    monkeypatch.setattr(spans, "_compare_shards", real_compare)

    # flips in expert halves (w1 S(0): contiguous; w2 S(1): strided in SRC), a replicated
    # norm, and two flips in one shard (counted together, the first named)
    rng = random.Random(3)
    files = sorted(p.name for p in dst.glob("rank-*.safetensors"))
    flipped = 0
    for name in files:
        header = read_header(dst / name)
        names = [e.name for e in header.tensors]
        for pick in ("w1.weight", "w2.weight", "post_attention_layernorm.weight"):
            fqn = next(n for n in names if n.endswith(pick))
            _flip(dst / name, fqn, rng.randrange(1 << 16), rng.randrange(8))
            flipped += 1
        fqn = [n for n in names if n.endswith("w3.weight")][-1]
        _flip(dst / name, fqn, 1, 0)
        _flip(dst / name, fqn, 300, 7)
        flipped += 1
    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert not ok and not ok0 and calls > 0
    assert findings == findings0  # same shards named, same counts, same first element
    assert figures == figures0 and rows == rows0
    # the batch fills of a span (strided gather; box by box): same verdicts either way
    for direct in (0, 1 << 40):
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        assert _run(src, dst, monkeypatch, on=True)[1] == findings
    named = [f for f in findings if f[1]]
    assert len(named) == flipped
    assert sum(f[0].startswith("2 of") for f in named) == len(files)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # each DST shard inside one SRC shard (halves of whole experts)
        (Mesh(ep=4), Mesh(ep=2, tp=2)),
        # each DST shard made of two SRC halves (parts), ep regrouped
        (Mesh(ep=2, tp=2), Mesh(ep=4)),
        # merged back whole: every tensor from all its SRC shards
        (Mesh(ep=2, tp=2), None),
    ],
    ids=["inside", "parts", "merged"],
)
def test_sharded_src_spans_match_the_block_path(
    cks: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    first: Mesh,
    second: Mesh | None,
) -> None:
    # A sharded SRC (a split verified against a re-split or a merge of it) goes through spans
    # too: its shards are read as a few stretches, one per SRC file, and a DST shard may be
    # filled from several of them. Verdicts, findings (shard, count, first element), figures
    # and rows are the per-block path's.
    from shardctl.reshard.api import reshard

    src = cks.resharded("mixtral", first)
    dst = tmp_path / "dst"
    if second is None:
        reshard(src, dst, fmt="hf")
    else:
        reshard(src, dst, mesh=second)
    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, calls0 = _run(src, dst, monkeypatch, on=False)
    assert ok and ok0 and not findings and calls > 0 and calls0 == 0
    assert figures == figures0 and rows == rows0
    # SRC bytes: each element once, replicas not counted (as the block path)
    tensor_bytes = sum(
        e.nbytes for p in cks.ckpt("mixtral").glob("*.safetensors") for e in read_header(p).tensors
    )
    assert figures["src_bytes"] == tensor_bytes
    for direct in (0, 1 << 40):  # every way of filling builds exactly DST
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        assert _run(src, dst, monkeypatch, on=True)[0]

    rng = random.Random(5)
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    for name in files:
        names = [e.name for e in read_header(dst / name).tensors]
        for pick in ("w1.weight", "w2.weight", "input_layernorm.weight", "q_proj.weight"):
            hits = [n for n in names if n.endswith(pick)]
            if hits:
                _flip(dst / name, rng.choice(hits), rng.randrange(1 << 16), rng.randrange(8))
    for direct in (0, 1 << 40):
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
        ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
        assert not ok and not ok0 and calls > 0
        assert findings == findings0 and len(findings) >= len(files)
        assert figures == figures0 and rows == rows0


def test_geometry_parts_tile_each_dst_box_or_refuse() -> None:
    shape = (4, 6)
    halves = (((0, 0), (4, 3)), ((0, 3), (4, 3)))
    rows = (((0, 0), (2, 6)), ((2, 0), (2, 6)))
    # a row half from two column halves: two parts, each its own SRC shard's box
    got = spans.geometry(shape, halves, rows)
    assert got == (
        ((0, (0, 0), (0, 0), (2, 3)), (1, (0, 0), (0, 3), (2, 3))),
        ((0, (2, 0), (0, 0), (2, 3)), (1, (2, 0), (0, 3), (2, 3))),
    )
    # replicas: the first holder serves the box
    assert spans.geometry(shape, (((0, 0), shape), ((0, 0), shape)), rows) == (
        ((0, (0, 0), (0, 0), (2, 6)),),
        ((0, (2, 0), (0, 0), (2, 6)),),
    )
    # SRC boxes that do not tile the tensor: a gap, an overlap (volume right, one missing),
    # one outside it; a DST box outside it
    assert spans.geometry(shape, halves[:1], rows) is None
    assert (
        spans.geometry(shape, (((0, 0), (4, 3)), ((0, 2), (4, 3)), ((0, 5), (4, 1))), rows) is None
    )
    assert spans.geometry(shape, (((0, 3), (4, 4)), ((0, 0), (4, 3))), rows) is None
    assert spans.geometry(shape, halves, (((3, 0), (2, 6)),)) is None


def test_span_takes_shards_that_follow_each_file_stretch() -> None:
    p = Path("f")
    span = spans.Span()
    first = [(0, p, 100, 10, (5,)), (1, p, 0, 10, (5,))]
    assert span.fits(first, 64)
    span.add(first)
    assert span.ranges == {0: [p, 100, 110], 1: [p, 0, 10]} and span.src_bytes == 20
    assert span.fits([(1, p, 10, 8, (4,)), (2, p, 7, 8, (4,))], 64)  # file 2 is new
    assert not span.fits([(1, p, 12, 8, (4,))], 64)  # a gap in file 1
    assert not span.fits([(0, p, 110, 50, (25,))], 64)  # over the cap
    # one tensor's two shards in one file: only back to back, in either order
    assert spans.Span().fits([(3, p, 8, 8, (4,)), (3, p, 0, 8, (4,))], 64)
    assert not spans.Span().fits([(3, p, 9, 8, (4,)), (3, p, 0, 8, (4,))], 64)


def test_span_parts_are_capped(cks: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny tensors (FP8 block scales split tp 8: 16 B a shard) must not pile up in one span:
    # 2 MiB of them were 130,000 shards and ~30 MB of objects a span. A span closes once it
    # holds SPAN_PARTS parts; the verdict and the figures do not change.
    from shardctl.verify.bitwise import level

    src = cks.ckpt("mixtral")
    dst = cks.resharded("mixtral", Mesh(ep=2, tp=2))
    sizes: list[int] = []
    real = pipeline.compare_span

    def sized(span, w, out):  # type: ignore[no-untyped-def]
        sizes.append(len(span.parts))
        return real(span, w, out)

    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    monkeypatch.setattr(level, "SPAN_PARTS", 5)
    monkeypatch.setattr(spans, "ENABLED", True)
    monkeypatch.setattr(pipeline, "compare_span", sized)
    result = verify(src, dst, level="bitwise")
    bw = result.level_result("bitwise")
    assert result.ok and ok and not findings
    assert {k: bw.figures[k] for k in figures} == figures and bw.rows == rows
    assert len(sizes) > calls
    # at most SPAN_PARTS before the last tensor joined, and a tensor has at most 4 shards here
    assert max(sizes) < 5 + 4


def _cuts(draw, n: int) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    inner = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    edges = [0, *inner, n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


@st.composite
def _tilings(draw):  # type: ignore[no-untyped-def]
    shape = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))

    def grid():  # type: ignore[no-untyped-def]
        rows, cols = _cuts(draw, shape[0]), _cuts(draw, shape[1])
        boxes = [((r0, c0), (rn, cn)) for r0, rn in rows for c0, cn in cols]
        return tuple(draw(st.permutations(boxes)))

    return shape, grid(), grid()


@given(_tilings())
@settings(max_examples=200, deadline=None)
def test_geometry_maps_every_dst_element_to_its_src_element(case) -> None:  # type: ignore[no-untyped-def]
    # Any grid tiling of SRC and of DST: each DST element is filled exactly once, from the SRC
    # shard holding it, at the right place in that shard's local tensor.
    shape, src, dst = case
    got = spans.geometry(shape, src, dst)
    assert got is not None
    for (o, z), parts in zip(dst, got, strict=True):
        filled = {}
        for i, src_off, dst_off, sizes in parts:
            (qo, qz) = src[i]
            for a in range(sizes[0]):
                for b in range(sizes[1]):
                    local = (dst_off[0] + a, dst_off[1] + b)
                    glob = (o[0] + local[0], o[1] + local[1])
                    assert local not in filled  # filled once
                    filled[local] = glob
                    # the same element, as SRC shard i holds it
                    assert (qo[0] + src_off[0] + a, qo[1] + src_off[1] + b) == glob
                    assert 0 <= src_off[0] + a < qz[0] and 0 <= src_off[1] + b < qz[1]
        assert len(filled) == z[0] * z[1]
