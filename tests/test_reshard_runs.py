"""Byte runs (``shardctl/reshard/runs.py``): a target's parts as strided byte copies, executed
a group at a time through numpy views, give exactly the bytes of slicing the global tensor.

Hypothesis draws a global tensor, a source layout that cuts it along one dim (``S(d)`` shards,
several per file, other tensors' bytes between them) and a target box along another; the target
is filled only through ``runs_of`` + ``Pending`` and compared with numpy slicing of the global
tensor. A real reshard at 90k tensors is in ``test_reshard_many_tensors.py``; byte-identity
with the general path in ``test_reshard_short_path.py``."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.checkpoint.source import SourceShard
from shardctl.layout.types import Piece
from shardctl.reshard import runs as runs_module
from shardctl.reshard.runs import Pending, extent, runs_of

DTYPES = {1: "U8", 2: "BF16", 4: "F32"}


def _cuts(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` (offset, size) runs tiling ``[0, n)`` (``k`` at most ``n``)."""
    step = math.ceil(n / k)
    return [(a, min(step, n - a)) for a in range(0, n, step)]


@st.composite
def _case(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    item = draw(st.sampled_from([1, 2, 4]))
    src_dim = draw(st.integers(0, len(shape) - 1))
    dst_dim = draw(st.integers(0, len(shape) - 1))
    n_src = draw(st.integers(1, shape[src_dim]))
    n_dst = draw(st.integers(1, shape[dst_dim]))
    pick = draw(st.integers(0, 100))
    gap = draw(st.integers(0, 7))  # other bytes between source shards in their file
    return shape, item, src_dim, n_src, dst_dim, n_dst, pick, gap


@settings(max_examples=300, deadline=None)
@given(_case())
def test_runs_fill_a_target_like_slicing(case) -> None:  # type: ignore[no-untyped-def]
    shape, item, src_dim, n_src, dst_dim, n_dst, pick, gap = case
    rng = np.random.default_rng(pick)
    glob = rng.integers(0, 256, size=(*shape[:-1], shape[-1] * item), dtype=np.uint8)

    def box(dim: int, a: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets = tuple(a if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(n if d == dim else shape[d] for d in range(len(shape)))
        return offsets, sizes

    def cut(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        index = [slice(o, o + z) for o, z in zip(offsets[:-1], sizes[:-1], strict=True)]
        index.append(slice(offsets[-1] * item, (offsets[-1] + sizes[-1]) * item))
        return glob[tuple(index)]

    # Source shards back to back in two "files", ``gap`` foreign bytes before each.
    files = [bytearray(), bytearray()]
    srcs = []
    for i, (a, n) in enumerate(_cuts(shape[src_dim], n_src)):
        f = i % 2
        files[f] += bytes(rng.integers(0, 256, size=gap, dtype=np.uint8))
        offsets, sizes = box(src_dim, a, n)
        srcs.append(
            SourceShard(
                "t",
                DTYPES[item],
                sizes,
                (Piece(offsets, sizes, (0,) * len(shape)),),
                len(files[f]),
                f,
            )
        )
        files[f] += cut(offsets, sizes).tobytes()
    a, n = _cuts(shape[dst_dim], n_dst)[pick % len(_cuts(shape[dst_dim], n_dst))]
    t_off, t_sizes = box(dst_dim, a, n)
    # The parts ``Batching._parts`` gives: each source's overlap with the target box.
    parts = []
    for sh in srcs:
        q = sh.pieces[0]
        lo = tuple(max(x, y) for x, y in zip(t_off, q.offsets, strict=True))
        hi = tuple(
            min(x + p, y + r) for x, p, y, r in zip(t_off, t_sizes, q.offsets, q.sizes, strict=True)
        )
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            continue
        sizes = tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))
        src_lo = tuple(x - y for x, y in zip(lo, q.offsets, strict=True))
        dst_lo = tuple(x - y for x, y in zip(lo, t_off, strict=True))
        parts.append((sh, src_lo, dst_lo, sizes))
    runs = runs_of(parts, srcs, t_sizes, item, window=1 << 20)
    if runs is None:
        # a 3-d box cut in two outer dims with a cut dim between them is not one strided run
        # (the general path's case); a 1-d or 2-d box always is
        assert len(shape) == 3
        return
    assert len(runs) == len(parts)
    for k, src, _, shape_, span in runs:
        assert span == extent(shape_) and src + span <= srcs[k].nbytes  # inside its shard
    want = cut(t_off, t_sizes).tobytes()
    # both ways of executing a group: gather + scatter, and run by run (large runs)
    for direct in (1 << 40, 0):
        out = bytearray(math.prod(t_sizes) * item)
        pending = Pending()
        windows = {f: (0, len(b), b) for f, b in enumerate(files)}
        for k, src, dst, shape_, _ in runs:
            sh = srcs[k]
            g = pending.groups.setdefault((sh.file, id(out), shape_), (out, [], []))
            g[1].append(sh.begin + src)
            g[2].append(dst)
        saved, runs_module.DIRECT_BYTES = runs_module.DIRECT_BYTES, direct
        try:
            pending.run(windows)
        finally:
            runs_module.DIRECT_BYTES = saved
        assert not pending.groups
        assert bytes(out) == want


def test_runs_refuse_a_box_cut_in_two_dims() -> None:
    """A part cut in two outer dims (an ``S(0)`` target of an ``S(1)``-and-``S(0)`` 3-d source)
    is not one strided run: the short path declines it (the general path copies it)."""
    shape = (4, 4, 4)
    sh = SourceShard("t", "BF16", shape, (Piece((0, 0, 0), shape, (0, 0, 0)),), 0, 0)
    part = (sh, (0, 0, 0), (0, 0, 0), (2, 2, 4))
    # [2, 2, 4] of [4, 4, 4]: rows 0-1, each 2x4 contiguous elements: one strided run
    assert runs_of([part], [sh], (2, 2, 4), 2, window=1 << 20) == ((0, 0, 0, (2, 16, 32, 16), 48),)
    part = (sh, (0, 0, 0), (0, 0, 0), (2, 2, 2))
    assert runs_of([part], [sh], (2, 2, 2), 2, window=1 << 20) is None
    # packed experts [E, H, I]: the ep half of E and the tp half of I, H whole: E/ep · H rows
    part = (sh, (2, 0, 2), (0, 0, 0), (2, 4, 2))
    assert runs_of([part], [sh], (2, 4, 2), 2, window=1 << 20) == ((0, 68, 0, (8, 4, 8, 4), 60),)
    wide = SourceShard("t", "BF16", (2, 1 << 20), (Piece((0, 0), (2, 1 << 20), (0, 0)),), 0, 0)
    part = (wide, (0, 0), (0, 0), (2, 8))
    assert runs_of([part], [wide], (2, 8), 2, window=1 << 20) is None  # spans over a window


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 15), st.integers(0, 15)),
        min_size=2,
        max_size=60,
    ),
    st.sampled_from([1, 2, 8]),
)
def test_runs_back_to_back_on_both_sides_copy_as_one(steps, width) -> None:  # type: ignore[no-untyped-def]
    """Contiguous runs of one group, each after the last in source and in target or not (a
    jump drawn 1 in 16 on each side: whole experts moving together, mostly): executed, the
    target holds each run's bytes, coalesced or not."""
    src = np.random.default_rng(len(steps)).integers(0, 256, size=8192, dtype=np.uint8)
    src_at, dst_at, a, b = [], [], 5, 0
    for gap, jump_src, jump_dst in steps:
        a += (gap + 1) * width if jump_src == 0 else 0
        b += (gap + 1) * width if jump_dst == 0 else 0
        src_at.append(a)
        dst_at.append(b)
        a += width
        b += width
    want = np.zeros(b + width, dtype=np.uint8)
    for x, y in zip(src_at, dst_at, strict=True):
        want[y : y + width] = src[x : x + width]
    for direct in (1 << 40, 0):
        got = np.zeros_like(want)
        saved, runs_module.DIRECT_BYTES = runs_module.DIRECT_BYTES, direct
        try:
            runs_module.execute(src, got, (1, width, width, width), src_at, dst_at, 0)
        finally:
            runs_module.DIRECT_BYTES = saved
        assert bytes(got) == bytes(want)
