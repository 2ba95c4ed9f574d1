"""structure's shortcut for a split along one dim (``_slabs``) only accepts boxes that tile the
tensor exactly once (checked element by element), and the full check agrees with it."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.types import Piece
from shardctl.verify.structure import _boxes_tile, _slabs


@st.composite
def _case(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    boxes = []
    for _ in range(draw(st.integers(1, 4))):
        o = tuple(draw(st.integers(0, n - 1)) for n in shape)
        z = tuple(draw(st.integers(1, n - a)) for n, a in zip(shape, o, strict=True))
        if draw(st.booleans()):  # most layouts: a slab along one dim
            d = draw(st.integers(0, len(shape) - 1))
            o = tuple(a if i == d else 0 for i, a in enumerate(o))
            z = tuple(b if i == d else shape[i] for i, b in enumerate(z))
        boxes.append((o, z))
    return shape, list(set(boxes))


@settings(max_examples=400, deadline=None)
@given(_case())
def test_slabs_accepts_only_exact_tilings(case) -> None:  # type: ignore[no-untyped-def]
    shape, distinct = case
    counts: dict[tuple[int, ...], int] = {}
    for o, z in distinct:
        for idx in itertools.product(*(range(a, a + b) for a, b in zip(o, z, strict=True))):
            counts[idx] = counts.get(idx, 0) + 1
    exact = len(counts) == math.prod(shape) and set(counts.values()) == {1}
    if _slabs(shape, distinct):
        assert exact
    pieces = [Piece(o, z, o) for o, z in distinct]
    assert (_boxes_tile(shape, pieces) is None) == exact
