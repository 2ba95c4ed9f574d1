"""Interleaved (grouped) fused parts: GPT-NeoX / Falcon ``query_key_value``.

The dim is ``G`` groups of ``[q heads of the group; k head; v head]`` rows. Each rank's local
tensor must again be groups of ``[q; k; v]`` at its local head counts: whole groups when
``tp <= G``, else its share of the group's q heads plus the group's (replicated) k and v. The
expected local tensor is built here independently, by reshaping the global tensor per head.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import LayoutError
from shardctl.layout.engine import build_layout
from shardctl.layout.split import Part, SplitError, SplitSpec, split
from shardctl.layout.types import Mesh, RuleSpec
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo


def _spec(groups: int, q_per_group: int, head: int, hidden: int) -> SplitSpec:
    q = Part(q_per_group * head, q_per_group, "num_attention_heads per group")
    kv = Part(head, 1, "num_key_value_heads per group", replicable=True, q_heads=q_per_group)
    rows = groups * (q_per_group + 2) * head
    return SplitSpec((rows, hidden), 0, (q, kv, kv), None, False, groups)


def _assemble(spec: SplitSpec, glob: np.ndarray, tp: int) -> list[np.ndarray]:
    out = []
    for pieces, local_shape in split(spec, tp):
        local = np.full(local_shape, -1, dtype=glob.dtype)
        for p in pieces:
            src = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))
            dst = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
            local[dst] = glob[src]
        out.append(local)
    return out


def _expected(glob: np.ndarray, groups: int, qpg: int, head: int, tp: int) -> list[np.ndarray]:
    """Per rank, the rows a model with local heads reads as its groups of [q; k; v]."""
    per_group = glob.reshape(groups, qpg + 2, head, -1)  # [G, q heads + k + v, head, H]
    out = []
    for r in range(tp):
        if tp <= groups:
            n = groups // tp
            block = per_group[r * n : (r + 1) * n]
        else:
            share = tp // groups
            g, s = divmod(r, share)
            q = per_group[g, s * (qpg // share) : (s + 1) * (qpg // share)]
            block = np.concatenate([q, per_group[g, qpg:]])[None]
        out.append(block.reshape(-1, glob.shape[1]))
    return out


@settings(max_examples=60, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4, 8]),
    qpg=st.sampled_from([1, 2, 4, 8]),
    head=st.sampled_from([1, 2, 3]),
    tp_log=st.integers(0, 5),
)
def test_each_rank_holds_its_groups_of_qkv(groups: int, qpg: int, head: int, tp_log: int) -> None:
    tp = 2**tp_log
    if tp > groups * qpg:
        tp = groups * qpg  # tp must divide the q heads
    spec = _spec(groups, qpg, head, 3)
    glob = np.arange(spec.shape[0] * 3).reshape(spec.shape)
    got = _assemble(spec, glob, tp)
    want = _expected(glob, groups, qpg, head, tp)
    for r in range(tp):
        np.testing.assert_array_equal(got[r], want[r], err_msg=f"rank {r} of tp={tp}")
    # every row of the source is held by some rank; q rows by exactly one
    held = np.zeros(spec.shape[0], dtype=int)
    for pieces, _ in split(spec, tp):
        for p in pieces:
            held[p.offsets[0] : p.offsets[0] + p.sizes[0]] += 1
    assert held.min() >= 1
    q_rows = glob.reshape(groups, qpg + 2, head, 3)[:, :qpg, :, 0].reshape(-1) // 3
    assert (held[q_rows] == 1).all()


def test_tp_below_groups_is_one_contiguous_piece_per_rank() -> None:
    spec = _spec(groups=4, q_per_group=1, head=2, hidden=5)  # GPT-NeoX: 4 heads
    ranks = split(spec, 2)
    assert [len(p) for p, _ in ranks] == [1, 1]
    assert ranks[1][0][0].offsets == (12, 0) and ranks[1][1] == (12, 5)


def test_uneven_groups_refused_with_valid_degrees() -> None:
    spec = _spec(groups=2, q_per_group=3, head=1, hidden=4)  # Falcon-like: 6 q heads, 2 kv
    with pytest.raises(SplitError) as err:
        split(spec, 4)  # tp above the groups, but 4/2 = 2 does not divide 3 q heads per group
    assert "{1, 2, 6}" in err.value.hint
    with pytest.raises(SplitError):
        split(_spec(groups=4, q_per_group=1, head=1, hidden=4), 3)


def _neox_like(heads: int, head: int) -> ModelInfo:
    h = heads * head
    dims = ModelDims(
        hidden_size=h, num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=head,
        intermediate_size=4 * h, vocab_size=32, tie_word_embeddings=True, gated_mlp=False,
    )  # fmt: skip
    t = TensorInfo("layers.0.attention.query_key_value.weight", (3 * h, h), "F32")
    return ModelInfo("custom", dims, (t,), "F32", "inline")


def test_rule_with_groups_through_the_engine() -> None:
    model = _neox_like(heads=4, head=2)
    rule = RuleSpec("*query_key_value.weight", tp="colwise", parts=("q", "kv", "kv"), groups="q")
    layout = build_layout(model, Mesh(tp=2), rules=[rule])
    shard = layout.rank_layout(pp=0, ep=0, tp=1).shards[0]
    assert shard.placement == "S(0)·parts[2,2,2]·groups[4]"
    assert shard.pieces[0].offsets == (12, 0) and shard.local_shape == (12, 8)


def test_groups_need_parts_and_a_known_kind() -> None:
    model = _neox_like(heads=4, head=2)
    with pytest.raises(LayoutError, match="groups without parts"):
        build_layout(model, Mesh(tp=2), rules=[RuleSpec("*", tp="colwise", groups="q")])
    with pytest.raises(LayoutError, match="unknown groups"):
        build_layout(
            model, Mesh(tp=2), rules=[RuleSpec("*", tp="colwise", parts=("q",), groups="x")]
        )
    with pytest.raises(LayoutError, match="4 groups of parts"):
        build_layout(
            model, Mesh(tp=2), rules=[RuleSpec("*", tp="colwise", parts=("q", "kv"), groups="q")]
        )
