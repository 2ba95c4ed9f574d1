"""Property tests of the box-copy engine against numpy slicing: random shapes, dtypes, source
and target layouts (grid splits, several pieces per shard as fused parts, padding, replicas),
and block sizes down to one element, so every code path (direct, gather, deep blocks) runs."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardctl.checkpoint import plan_files
from shardctl.checkpoint.source import SourceShard
from shardctl.errors import InvalidInputError
from shardctl.io.checksum import new_hash
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.layout.types import Piece, Shard
from shardctl.reshard.boxes import plan_boxes
from shardctl.reshard.copy import Executor

DTYPES = {"U8": 1, "BF16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8}


@st.composite
def layouts(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """Shards as (local_shape, pieces): a grid split, cells grouped, concatenated, padded."""
    nd = len(shape)
    cuts = []
    for n in shape:
        k = draw(st.integers(0, min(2, max(0, n - 1))))
        inner = (
            sorted(draw(st.sets(st.integers(1, n - 1), min_size=k, max_size=k))) if n > 1 else []
        )
        cuts.append([0, *inner, n])
    cells = [
        tuple((c[i], c[i + 1] - c[i]) for c, i in zip(cuts, idx, strict=True))
        for idx in np.ndindex(*[len(c) - 1 for c in cuts])
    ]
    order = draw(st.permutations(range(len(cells))))
    shards: list[tuple[tuple[int, ...], list[Piece]]] = []
    i = 0
    while i < len(order):
        take = draw(st.integers(1, 2))
        group = [cells[j] for j in order[i : i + take]]
        i += take
        cat = draw(st.integers(0, max(0, nd - 1)))
        pieces, pos = [], 0
        local = [0] * nd
        for cell in group:
            lo = [0] * nd
            if nd:
                lo[cat] = pos
                pos += cell[cat][1]
            pieces.append(Piece(tuple(c[0] for c in cell), tuple(c[1] for c in cell), tuple(lo)))
            for d in range(nd):
                local[d] = max(local[d], lo[d] + cell[d][1])
        pad = [draw(st.integers(0, 1)) for _ in range(nd)]
        shards.append((tuple(n + p for n, p in zip(local, pad, strict=True)), pieces))
        if draw(st.booleans()):  # a replica on another rank
            shards.append(shards[-1])
    return shards


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    src = draw(layouts(shape))
    dst = draw(layouts(shape))
    s = DTYPES[dtype]
    block = draw(st.sampled_from([s, 3 * s, 64, 4096]))
    return shape, dtype, src, dst, block


def _fill(local: tuple[int, ...], pieces: list[Piece], glob: np.ndarray, s: int, pad: int) -> bytes:
    """Expected bytes of a local tensor: ``pad`` bytes where no piece lands."""
    shape = local or (1,)
    arr = np.full((*shape, s), pad, dtype=np.uint8)
    g = glob.reshape((*(glob.shape[:-1] or (1,)), s))
    for p in pieces:
        off, siz, lo = (p.offsets or (0,)), (p.sizes or (1,)), (p.local_offsets or (0,))
        dst = tuple(slice(a, a + n) for a, n in zip(lo, siz, strict=True))
        srcs = tuple(slice(a, a + n) for a, n in zip(off, siz, strict=True))
        arr[dst] = g[srcs]
    return arr.tobytes()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_box_copy_matches_numpy(tmp_path_factory: pytest.TempPathFactory, case: tuple) -> None:
    shape, dtype, src_layout, dst_layout, block = case
    s = DTYPES[dtype]
    tmp = tmp_path_factory.mktemp("engine")
    rng = np.random.default_rng(len(src_layout) * 31 + len(dst_layout))
    glob = rng.integers(0, 256, size=(*shape, s), dtype=np.uint8)
    # sources: every shard in one file, padding filled with 0xAB (must never reach a target)
    entries, blobs, cursor = [], [], 0
    for k, (local, pieces) in enumerate(src_layout):
        data = _fill(local, pieces, glob, s, 0xAB)
        entries.append(HeaderEntry(f"s{k}", dtype, local, cursor, cursor + len(data)))
        blobs.append(data)
        cursor += len(data)
    head = header_bytes(entries)
    (tmp / "src.safetensors").write_bytes(head + b"".join(blobs))
    sources = tuple(
        SourceShard("w", dtype, local, tuple(pieces), begin=len(head) + e.begin, file=0)
        for (local, pieces), e in zip(src_layout, entries, strict=True)
    )
    # targets: two output files, shards spread over them, lockstep on one fqn
    items = [Shard("w", dtype, shape, local, tuple(pieces), "test") for local, pieces in dst_layout]
    files = [
        plan_files._file(f"out{j}.safetensors", [(x, x.pieces)], {}, j) for j, x in enumerate(items)
    ]
    out = tmp / "out"
    out.mkdir()
    ex = Executor(
        out, [tmp / "src.safetensors"], {"w": sources}, hash_name="sha256", block_bytes=block
    )
    digests = ex.run(files)
    for f, (local, pieces) in zip(files, dst_layout, strict=True):
        data = (out / f.name).read_bytes()
        assert data[: len(f.header)] == f.header
        assert data[len(f.header) :] == _fill(local, pieces, glob, s, 0)
        h = new_hash("sha256")
        h.update(data)
        assert digests[f.name] == h.hexdigest()


def test_zero_size_and_scalar(tmp_path: Path) -> None:
    """A ``[0, 4]`` tensor has no bytes to copy; a scalar is one element."""
    scalar = SourceShard("x", "F32", (), (Piece((), (), ()),), begin=8, file=0)
    assert plan_boxes("x", (Piece((), (), ()),), [scalar])[0].sizes == (1,)
    empty = SourceShard("e", "F32", (0, 4), (Piece((0, 0), (0, 4), (0, 0)),), begin=8, file=0)
    assert plan_boxes("e", (Piece((0, 0), (0, 4), (0, 0)),), [empty]) == []


def test_uncovered_or_overlapping_sources_refused() -> None:
    half = SourceShard("w", "U8", (2, 4), (Piece((0, 0), (2, 4), (0, 0)),), begin=0, file=0)
    with pytest.raises(InvalidInputError, match="cover 8 of the 16"):
        plan_boxes("w", (Piece((0, 0), (4, 4), (0, 0)),), [half])
    skew = SourceShard("w", "U8", (3, 4), (Piece((1, 0), (3, 4), (0, 0)),), begin=0, file=0)
    with pytest.raises(InvalidInputError, match="overlapping"):
        plan_boxes("w", (Piece((0, 0), (4, 4), (0, 0)),), [half, skew])


def test_short_read_is_input_changed(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"\0" * 8)
    src = SourceShard("w", "U8", (64,), (Piece((0,), (64,), (0,)),), begin=0, file=0)
    f = plan_files._file(
        "o.safetensors", [(Shard("w", "U8", (64,), (64,), src.pieces, "R"), src.pieces)], {}, 0
    )
    (tmp_path / "o").mkdir()
    ex = Executor(tmp_path / "o", [tmp_path / "src"], {"w": (src,)}, hash_name="sha256")
    with pytest.raises(Exception, match="input changed during run"):
        ex.run([f])
    assert math.prod((1,)) == 1 and os.path.exists(tmp_path / "o")
