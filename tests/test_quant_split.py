"""Property: a quantized member's split is its logical weight's split divided by the member's
factor — same ranks, same order, every stored index covered once — and it is refused exactly
when a rank boundary falls inside an int32, a group or a block (hypothesis over lengths,
factors, fused parts, heads and tp)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.split import Part, SplitError, SplitSpec, split


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[Part, ...], int, int, int]:
    factor = draw(st.sampled_from([1, 2, 8, 16, 32, 128]))
    align = factor * draw(st.sampled_from([1, 1, 2, 16]))
    n_parts = draw(st.integers(1, 3))
    parts = []
    for _ in range(n_parts):
        heads = draw(st.sampled_from([0, 1, 2, 4, 8]))
        unit = draw(st.sampled_from([16, 32, 64, 128, 192]))
        parts.append(Part(unit * max(heads, 1), heads, "heads" if heads else ""))
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return tuple(parts), factor, align, tp


@settings(max_examples=300, deadline=None)
@given(cases())
def test_member_split_is_the_weight_split_divided(case: tuple) -> None:  # type: ignore[type-arg]
    parts, factor, align, tp = case
    length = sum(p.size for p in parts)
    try:
        logical = split(SplitSpec((length, 7), 0, parts), tp)
    except SplitError:
        return  # the weight itself cannot split: nothing for its members to follow
    stored_len = -(-length // factor)
    spec = SplitSpec(
        (stored_len, 7), 0, parts, factor=factor, align=align, logical=length, what="X on dim"
    )
    edges = {
        e
        for pieces, _ in logical
        for p in pieces
        for e in (p.offsets[0], p.offsets[0] + p.sizes[0])
    }
    cut = any(e % align and e != length for e in edges)
    try:
        stored = split(spec, tp)
    except SplitError as err:
        assert cut, err.message
        assert err.message.startswith(f"X on dim {length} with tp {tp}: ")
        return
    assert not cut
    covered = [0] * stored_len
    for (lp, _), (sp, local) in zip(logical, stored, strict=True):
        at = 0
        for a, b in zip(lp, sp, strict=True):
            assert b.offsets[0] == a.offsets[0] // factor
            end = a.offsets[0] + a.sizes[0]
            assert b.offsets[0] + b.sizes[0] == -(-end // factor)
            assert b.local_offsets[0] == at
            at += b.sizes[0]
            for i in range(b.offsets[0], b.offsets[0] + b.sizes[0]):
                covered[i] += 1
        assert local == (at, 7)
    assert covered == [1] * stored_len  # no replicable parts here: each index on one rank
