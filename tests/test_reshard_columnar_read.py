"""The columnar chunk read (``columnar.Chunks.read``) against real files: a contiguous piece that
shares no SRC byte with another is read straight into its place in the chunk buffer, the rest
into the scratch at the offsets it returns, all in SRC order through ``Gather._readv``; the
input check sees every byte of every stretch once, in file order; a file cut under the read
is the engine's "input changed" error."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import EnvironmentFailure
from shardctl.reshard import columnar, gather

SIZES = (9_000, 70_000, 300_000)  # three SRC files: holes under and over GAP fit in them


class _Ex(gather.Gather):
    """The reading half of the copy engine over real files (what ``Chunks.read`` calls)."""

    def __init__(self, paths: list[Path], fed: list[tuple[int, int, bytes]] | None) -> None:
        self.input_paths = paths
        self.fds = OrderedDict()
        self.on_read = None if fed is None else (lambda f, o, mv: fed.append((f, o, bytes(mv))))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[bytes]]:
    root = tmp_path_factory.mktemp("columnar-read")
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES]
    paths = []
    for i, d in enumerate(data):
        p = root / f"src-{i}.bin"
        p.write_bytes(d)
        paths.append(p)
    return paths, data


@st.composite
def pieces(draw: st.DrawFn) -> list[tuple[int, int, int, bool]]:
    """(file, start, length, flat): adjacent, overlapping, repeated and far-apart pieces."""
    out: list[tuple[int, int, int, bool]] = []
    for _ in range(draw(st.integers(1, 60))):
        f = draw(st.integers(0, len(SIZES) - 1))
        n = draw(st.integers(1, 4_000))
        start = draw(st.integers(0, SIZES[f] - n))
        follow = draw(st.booleans())
        if out and follow:  # right after, or on top of, the previous piece
            pf, ps, pn, _ = out[-1]
            f, start = pf, min(ps + draw(st.sampled_from([pn, pn // 2, 0])), SIZES[pf] - n)
        out.append((f, start, n, draw(st.booleans())))
    return out


@settings(max_examples=150, deadline=None)
@given(ps=pieces(), fed=st.booleans(), order=st.randoms(use_true_random=False))
def test_every_piece_lands_where_it_is_said_to(
    files: tuple[list[Path], list[bytes]],
    ps: list[tuple[int, int, int, bool]],
    fed: bool,
    order: random.Random,
) -> None:
    paths, data = files
    log: list[tuple[int, int, bytes]] | None = [] if fed else None
    ex = _Ex(paths, log)
    ch = columnar.Chunks(ex, columnar.Kinds())  # type: ignore[arg-type]
    n = np.array([p[2] for p in ps], dtype=np.int64)
    # each piece's place in the chunk buffer: back to back in a shuffled order
    perm = list(range(len(ps)))
    order.shuffle(perm)
    dst = np.empty(len(ps), dtype=np.int64)
    dst[perm] = np.concatenate([[0], np.cumsum(n[perm])[:-1]])
    into = np.full(int(n.sum()), 0xEE, dtype=np.uint8)
    sf = np.array([p[0] for p in ps], dtype=np.int32)
    ss = np.array([p[1] for p in ps], dtype=np.int64)
    flat = np.array([p[3] for p in ps], dtype=bool)
    try:
        scratch, at, placed = ch.read(sf, ss, n, 1 << 20, into, dst, flat)
    finally:
        ex.close()
    assert not (placed & ~flat).any()
    for i, (f, s, k, _) in enumerate(ps):
        want = data[f][s : s + k]
        if placed[i]:
            assert into[dst[i] : dst[i] + k].tobytes() == want
            # alone: no other piece shares a byte of it
            for j, (g, t, m, _) in enumerate(ps):
                assert j == i or g != f or t + m <= s or s + k <= t
        else:
            assert scratch[at[i] : at[i] + k].tobytes() == want
    # a flat piece overlapping nothing is never left to the scratch
    for i, (f, s, k, fl) in enumerate(ps):
        others = [(g, t, m) for j, (g, t, m, _) in enumerate(ps) if j != i]
        alone = all(g != f or t + m <= s or s + k <= t for g, t, m in others)
        assert placed[i] == (fl and alone)
    if log is not None:
        # every byte read reached the check, in file order, each stretch once and whole
        for f in range(len(SIZES)):
            mine = [(o, b) for g, o, b in log if g == f]
            for (o1, b1), (o2, _) in pairwise(mine):
                assert o1 + len(b1) <= o2
            for o, b in mine:
                assert b == data[f][o : o + len(b)]
            covered = {x for o, b in mine for x in range(o, o + len(b))}
            need = {x for g, s, k, _ in ps if g == f for x in range(s, s + k)}
            assert need <= covered


def test_many_views_past_iov_max_and_a_file_cut_under_the_read(
    files: tuple[list[Path], list[bytes]], tmp_path: Path
) -> None:
    paths, data = files
    # 3,000 one-run pieces of 64 B, every other one: 6,000 views, several preadv calls
    k = 3_000
    ss = np.arange(k, dtype=np.int64) * 96
    n = np.full(k, 64, dtype=np.int64)
    dst = np.arange(k, dtype=np.int64)[::-1] * 64
    into = np.zeros(k * 64, dtype=np.uint8)
    ex = _Ex(paths, None)
    ch = columnar.Chunks(ex, columnar.Kinds())  # type: ignore[arg-type]
    sf = np.full(k, 2, dtype=np.int32)
    _, _, placed = ch.read(sf, ss, n, 1 << 20, into, dst, np.ones(k, dtype=bool))
    ex.close()
    assert placed.all() and 2 * k > gather.IOV_MAX
    for i in range(k):
        s = int(ss[i])
        assert into[dst[i] : dst[i] + 64].tobytes() == data[2][s : s + 64]
    # the same read of a file cut short: the engine's error, not a partial buffer
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[2][: 96 * 1_500])
    ex = _Ex([cut, cut, cut], None)
    ch = columnar.Chunks(ex, columnar.Kinds())  # type: ignore[arg-type]
    with pytest.raises(EnvironmentFailure, match="input changed during run"):
        ch.read(sf, ss, n, 1 << 20, into, dst, np.ones(k, dtype=bool))
    ex.close()
