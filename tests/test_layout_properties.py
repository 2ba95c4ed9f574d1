"""Property tests: for random shapes, placements, fused parts, head counts and degrees, the shards
of a tensor tile it exactly (every element once per replica group), local tensors are their
pieces plus padding, and the bytes a rank holds are what torch computes on a real tensor with
"split parts → chunk each → concat", independently of the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardctl.dtypes import nbytes
from shardctl.errors import LayoutError
from shardctl.layout.engine import build_layout, rank_weight_bytes
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RuleSpec, Shard
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo

torch = pytest.importorskip("torch")

FQN = "w"


@dataclass(frozen=True)
class Case:
    """One tensor, one rule, one tp degree — and what the test expects, computed by itself."""

    shape: tuple[int, ...]
    rule: RuleSpec
    dims: ModelDims | None
    tp: int
    options: LayoutOptions
    dim: int | None  # the split dim (None: replicated)
    parts: tuple[tuple[int, int, bool], ...]  # (size, heads, replicable) along dim
    padded: int | None  # vocab padding target along dim


def model_of(case: Case) -> ModelInfo:
    return ModelInfo("unknown", case.dims, (TensorInfo(FQN, case.shape, "F32"),), "F32", "inline")


def _dims(nh: int, nkv: int, hd: int) -> ModelDims:
    return ModelDims(
        hidden_size=nh * hd, num_layers=1, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        intermediate_size=1, vocab_size=1, tie_word_embeddings=False,
    )  # fmt: skip


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


@st.composite
def plain_cases(draw: st.DrawFn) -> Case:
    shape = draw(shapes)
    tp = draw(st.integers(1, 8))
    chunk = draw(st.booleans())
    options = LayoutOptions(uneven="chunk" if chunk else "error")
    if draw(st.booleans()):
        return Case(shape, RuleSpec(FQN, tp="R"), None, tp, options, None, (), None)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    d = dim % len(shape)
    sizes: tuple[int, ...] = (shape[d],)
    if draw(st.booleans()):  # fused parts of arbitrary sizes, written as element counts
        cuts = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=1, max_size=3)))
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, shape[d]], strict=True))
    rule = RuleSpec(FQN, tp=f"S({dim})", parts=sizes if len(sizes) > 1 else None)
    parts = tuple((s, 0, False) for s in sizes)
    return Case(shape, rule, None, tp, options, d, parts, None)


@st.composite
def qkv_cases(draw: st.DrawFn) -> Case:
    """A fused [Q; K; V] (or plain q/k heads) with random GQA, dim 0 or 1, random tp."""
    nkv = draw(st.integers(1, 4))
    nh = nkv * draw(st.integers(1, 4))
    hd = draw(st.integers(1, 3))
    other = draw(st.integers(1, 4))
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    d = draw(st.integers(0, 1))
    kind = draw(st.sampled_from(["qkv", "q", "kv"]))
    names: tuple[str, ...] = {"qkv": ("q", "kv", "kv"), "q": ("q",), "kv": ("kv",)}[kind]
    table = {"q": (nh * hd, nh, False), "kv": (nkv * hd, nkv, True)}
    parts = tuple(table[n] for n in names)
    length = sum(p[0] for p in parts)
    shape = (length, other) if d == 0 else (other, length)
    rule = (
        RuleSpec(FQN, tp=f"S({d})", parts=names)
        if kind == "qkv"
        else RuleSpec(FQN, tp=f"S({d})", heads=kind)
    )
    return Case(shape, rule, _dims(nh, nkv, hd), tp, LayoutOptions(), d, parts, None)


@st.composite
def vocab_cases(draw: st.DrawFn) -> Case:
    vocab, hidden, tp = draw(st.integers(1, 40)), draw(st.integers(1, 3)), draw(st.integers(1, 8))
    policy = draw(st.sampled_from(["none", "tp", "megatron"]))
    options = LayoutOptions(vocab_padding=policy, uneven=draw(st.sampled_from(["error", "chunk"])))
    multiple = {"none": 1, "tp": tp, "megatron": 128 * tp}[policy]
    padded = None if policy == "none" else -(-vocab // multiple) * multiple
    rule = RuleSpec(FQN, tp="vocab")
    return Case((vocab, hidden), rule, None, tp, options, 0, ((vocab, 0, False),), padded)


def expected_ok(case: Case) -> bool:
    """Whether the engine must accept the case (else it must raise LayoutError)."""
    for size, heads, replicable in case.parts:
        if case.padded is not None:
            continue
        if heads:
            if case.tp > heads and replicable:
                if case.tp % heads:
                    return False
            elif heads % case.tp:
                return False
        elif size % case.tp and case.options.uneven != "chunk":
            return False
    return True


def expected_local(x: torch.Tensor, case: Case, r: int) -> torch.Tensor:
    """Rank r's local tensor, by torch alone: split parts → chunk each → concat (gpt-fast)."""
    if case.dim is None:
        return x
    d, tp = case.dim, case.tp
    if case.padded is not None:
        pad = list(x.shape)
        pad[d] = case.padded - x.shape[d]
        return torch.cat([x, torch.zeros(pad, dtype=x.dtype)], d).chunk(tp, d)[r]
    out = []
    for part, (size, heads, replicable) in zip(
        x.split([p[0] for p in case.parts], d), case.parts, strict=True
    ):
        if heads and tp > heads and replicable:  # vLLM num_kv_head_replicas
            out.append(part.split(size // heads, d)[r // (tp // heads)])
        else:
            chunks = torch.chunk(part, tp, d)
            out.append(chunks[r] if r < len(chunks) else part.narrow(d, 0, 0))
    return torch.cat(out, d)


def expected_counts(case: Case) -> np.ndarray:
    """How many tp ranks hold each element: tp if replicated, tp/n_kv in replicated K/V."""
    counts = np.ones(case.shape, dtype=np.int64)
    if case.dim is None:
        return counts * case.tp
    start = 0
    for size, heads, replicable in case.parts:
        if heads and case.tp > heads and replicable:
            idx = [slice(None)] * len(case.shape)
            idx[case.dim] = slice(start, start + size)
            counts[tuple(idx)] = case.tp // heads
        start += size
    return counts


def materialize(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    local = torch.zeros(shard.local_shape, dtype=x.dtype)
    for p in shard.pieces:
        g = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))
        loc = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
        local[loc] = x[g]
    return local


def check_tensor(layout: Layout, info: TensorInfo, expected: np.ndarray) -> None:
    """Coverage equals ``expected`` per element; pieces tile their local tensor (+ padding)."""
    counts = np.zeros(info.shape, dtype=np.int64)
    padded = layout.padded_shapes.get(info.fqn)
    for rank in layout.ranks:
        for shard in rank.shards:
            if shard.fqn != info.fqn:
                continue
            assert shard.global_shape == info.shape and shard.dtype == info.dtype
            local = np.zeros(shard.local_shape, dtype=np.int64)
            for p in shard.pieces:
                counts[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))] += 1
                local[
                    tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
                ] += 1
                assert all(
                    o + s <= n for o, s, n in zip(p.offsets, p.sizes, info.shape, strict=True)
                )
            assert local.max(initial=0) <= 1, f"{shard}: pieces overlap in the local tensor"
            if padded is None:
                assert local.min(initial=1) == 1, f"{shard}: local tensor has a hole"
    np.testing.assert_array_equal(counts, expected)


def run_case(case: Case) -> None:
    model = model_of(case)
    mesh = Mesh(tp=case.tp)
    rules = (case.rule,)
    if not expected_ok(case):
        with pytest.raises(LayoutError) as err:
            build_layout(model, mesh, rules=rules, options=case.options)
        assert str(err.value).startswith(f"{FQN}: ") and f"tp={case.tp}" in str(err.value)
        return
    layout = build_layout(model, mesh, rules=rules, options=case.options)
    info = model.tensors[0]
    check_tensor(layout, info, expected_counts(case))
    # The bytes: the model's, plus exactly the replicated elements, plus the zero padding.
    numel = int(expected_counts(case).sum())
    pad = 0 if case.padded is None else (case.padded - case.shape[0]) * math.prod(case.shape[1:])
    assert sum(r.nbytes for r in layout.ranks) == nbytes("F32", numel + pad)
    assert rank_weight_bytes(model, mesh, rules=rules, options=case.options) == {
        (r.pp, r.ep, r.tp): r.nbytes for r in layout.ranks
    }
    # The real bytes, on a real tensor, against torch's own split/chunk/cat.
    x = torch.arange(1, math.prod(case.shape) + 1, dtype=torch.float32).reshape(case.shape)
    for r, rank in enumerate(layout.ranks):
        (shard,) = rank.shards
        assert torch.equal(materialize(x, shard), expected_local(x, case, r)), (shard, r)
        assert "colwise" not in shard.placement and "vocab" not in shard.placement


settings.register_profile("layout", deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=300, deadline=None)
@given(plain_cases())
def test_plain_and_fused_parts_tile_exactly(case: Case) -> None:
    run_case(case)


@settings(max_examples=300, deadline=None)
@given(qkv_cases())
def test_heads_and_kv_replication(case: Case) -> None:
    run_case(case)


@settings(max_examples=200, deadline=None)
@given(vocab_cases())
def test_vocab_padding_policies(case: Case) -> None:
    run_case(case)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.integers(0, 2), st.integers(1, 3))
def test_uneven_chunk_equals_torch_chunk(length: int, tp: int, d: int, other: int) -> None:
    shape = [other, other, other]
    shape[d] = length
    model = ModelInfo("unknown", None, (TensorInfo(FQN, tuple(shape), "F32"),), "F32", "inline")
    layout = build_layout(
        model,
        Mesh(tp=tp),
        rules=(RuleSpec(FQN, tp=f"S({d})"),),
        options=LayoutOptions(uneven="chunk"),
    )
    x = torch.randn(shape)
    chunks = torch.chunk(x, tp, d)
    for r, rank in enumerate(layout.ranks):
        (shard,) = rank.shards
        want = chunks[r] if r < len(chunks) else x.narrow(d, 0, 0)
        assert shard.local_shape == tuple(want.shape)
        assert torch.equal(materialize(x, shard), want)


def test_naive_chunk_of_fused_qkv_is_not_what_we_do() -> None:
    """The DESIGN.md trap: chunking [Q; K; V] as one tensor gives rank 0 only Q rows."""
    dims = _dims(nh=4, nkv=2, hd=2)  # Q 8 rows, K 4, V 4
    case = Case((16, 3), RuleSpec(FQN, tp="S(0)", parts=("q", "kv", "kv")), dims, 2,
                LayoutOptions(), 0, ((8, 4, False), (4, 2, True), (4, 2, True)), None)  # fmt: skip
    layout = build_layout(model_of(case), Mesh(tp=2), rules=(case.rule,))
    x = torch.arange(48, dtype=torch.float32).reshape(16, 3)
    rank0 = layout.ranks[0].shards[0]
    assert [p.offsets[0] for p in rank0.pieces] == [0, 8, 12]  # its half of Q, of K, of V
    assert [p.local_offsets[0] for p in rank0.pieces] == [0, 4, 6]
    naive = x.chunk(2, 0)[0]
    assert not torch.equal(materialize(x, rank0), naive)
    assert torch.equal(materialize(x, rank0), expected_local(x, case, 0))
    assert rank0.placement == "S(0)·parts[8,4,4]"
