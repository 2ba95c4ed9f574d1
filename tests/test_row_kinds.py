"""``io.mapped.row_kinds``: equal rows get equal kinds, distinct rows distinct ones, one row
kept per kind, kinds numbered in the rows' lexicographic order — whether the columns' ranges
combine into one integer directly (shapes, dims, dtype codes) or need the rank of each value
(wide ranges), or overflow even that (the whole-row fallback)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shardctl.io.mapped import row_kinds

_VALUES = st.one_of(
    st.integers(0, 3),  # a few kinds: the direct path
    st.integers(-(2**40), 2**40),  # wide ranges: ranks per column
    st.integers(-(2**63), 2**63 - 1),  # the whole-row fallback
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_row_kinds_is_the_rows_equality(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 60))
    width = data.draw(st.integers(1, 4))
    values = data.draw(st.sampled_from([st.integers(0, 3), st.integers(-(2**40), 2**40), _VALUES]))
    rows = data.draw(arrays(np.int64, (n, width), elements=values))
    kind, kept = row_kinds(rows)
    assert kind.shape == (n,) and kind.dtype == np.int64
    distinct = sorted({tuple(r) for r in rows.tolist()})
    assert kept.shape == (len(distinct), width)
    assert np.array_equal(kept[kind], rows)  # each row's kind keeps that very row
    assert len({tuple(r) for r in kept.tolist()}) == len(distinct)  # one row per kind
    spans = rows.max(axis=0).astype(object) - rows.min(axis=0).astype(object) + 1
    if spans.prod() < 2**62:  # one integer per row (or ranks per column): lexicographic
        assert [tuple(r) for r in kept.tolist()] == distinct  # numbered in row order


def test_a_tp8_split_of_shapes_is_a_handful_of_kinds() -> None:
    rng = np.random.default_rng(0)
    shapes = np.array([[64, 16, 2], [16, 64, 2], [64, 0, 1], [8, 1, 1]])
    rows = shapes[rng.integers(0, 4, 100_000)]
    kind, kept = row_kinds(rows)
    assert kept.shape[0] == 4
    assert np.array_equal(kept[kind], rows)
