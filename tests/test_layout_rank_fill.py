"""``build_layout`` fills its ranks on columns (``shardctl.columns``, index lists per stage and
ep rank): held here to the plain per-tensor loop it replaced, on the families where the fill
depends on more than tp — experts on one ep rank, packed experts cut per ep rank (gpt-oss),
tied embeddings on the first and last stage, MTP layers — at every mesh each one takes; and
the 10,000-tensor Qwen3-MoE of the scale tests at a 4 × 2 × 2 mesh."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any

import pytest

from shardctl.columns import Numbering, from_columns
from shardctl.errors import LayoutError
from shardctl.layout import engine
from shardctl.layout.engine import build_layout, resolve
from shardctl.layout.split import split
from shardctl.layout.types import Layout, LayoutOptions, Mesh, Shard
from shardctl.model.inventory import from_config
from shardctl.model.types import ModelInfo
from tests._models import CONFIGS, MANY_QWEN3_MOE


def _reference(model: ModelInfo, mesh: Mesh, options: LayoutOptions) -> list[list[Shard]]:
    """Every rank's shards, one tensor at a time: its tp shards, then each stage and ep rank
    holding it, in model order (a packed expert tensor with its ep rank's rows)."""
    per_rank: list[list[Shard]] = [[] for _ in range(mesh.model_parallel)]
    for t in resolve(model, mesh, options=options).tensors:
        shards = [
            Shard(t.info.fqn, t.info.dtype, t.info.shape, local, pieces, t.placement)
            for pieces, local in split(t.split, mesh.tp)
        ]
        for p in t.stages:
            for e in range(mesh.ep) if t.ep_rank is None else (t.ep_rank,):
                for r in range(mesh.tp):
                    s = engine._expert_rows(shards[r], e, mesh.ep) if t.packed else shards[r]
                    per_rank[(p * mesh.ep + e) * mesh.tp + r].append(s)
    return per_rank


def _same(layout: Layout, mesh: Mesh, expected: list[list[Shard]]) -> int:
    coords = [(p, e, r) for p in range(mesh.pp) for e in range(mesh.ep) for r in range(mesh.tp)]
    assert [(rl.pp, rl.ep, rl.tp) for rl in layout.ranks] == coords
    for rl, want in zip(layout.ranks, expected, strict=True):
        assert list(rl.shards) == want, (mesh, rl.pp, rl.ep, rl.tp)
    return sum(map(len, expected))


MESHES = [
    Mesh(tp=2),
    Mesh(pp=2, tp=2),
    Mesh(pp=3),
    Mesh(ep=2),
    Mesh(pp=2, ep=2, tp=2),
    Mesh(ep=4),
    Mesh(pp=2, ep=4),
]
FAMILIES: list[tuple[str, dict[str, Any]]] = [
    ("mixtral", {}),
    ("gpt_oss", {}),  # packed experts: each ep rank holds its rows of one tensor
    ("llama-tied-mha", {}),  # the tied embedding on the first and the last stage
    ("deepseek_v3", {"num_nextn_predict_layers": 1}),  # an MTP layer trails the stack
    ("qwen3_moe", {}),
]


@pytest.mark.parametrize(("name", "overrides"), FAMILIES, ids=[n for n, _ in FAMILIES])
def test_rank_fill_equals_the_per_tensor_loop(name: str, overrides: dict[str, Any]) -> None:
    model = from_config({**CONFIGS[name], **overrides})
    compared = 0
    for mesh in MESHES:
        for options in (LayoutOptions(), LayoutOptions(pipeline="vllm")):
            try:
                expected = _reference(model, mesh, options)
            except LayoutError:
                with pytest.raises(LayoutError):
                    build_layout(model, mesh, options=options)
                continue
            compared += _same(build_layout(model, mesh, options=options), mesh, expected)
    assert compared > 0, name


def test_rank_fill_at_ten_thousand_tensors() -> None:
    shapes = {k: v for k, v in MANY_QWEN3_MOE.items() if k != "max_shard_size"}
    model = from_config({**CONFIGS["qwen3_moe"], **shapes})
    assert len(model.tensors) >= 10_000
    mesh = Mesh(pp=4, ep=2, tp=2)
    options = LayoutOptions(pipeline="vllm")  # 14 layers over 4 stages: [3, 4, 4, 3]
    n = _same(build_layout(model, mesh, options=options), mesh, _reference(model, mesh, options))
    assert n > 2 * len(model.tensors)  # tp 2: every tensor twice at least


@dataclass(frozen=True, slots=True)
class _Pair:
    a: int
    b: str


def test_from_columns_equals_the_constructor() -> None:
    made = from_columns(_Pair, 3, a=[1, 2, 3], b=repeat("x"))
    assert made == [_Pair(1, "x"), _Pair(2, "x"), _Pair(3, "x")]
    assert from_columns(_Pair, 0, a=[], b=[]) == []
    with pytest.raises(AssertionError):  # every field, or an unset slot far from here
        from_columns(_Pair, 1, a=[1])
    with pytest.raises(AssertionError):  # a column shorter than n
        from_columns(_Pair, 2, a=[1], b=["x", "y"])


def test_numbering_numbers_in_first_lookup_order() -> None:
    number: Numbering[str] = Numbering()
    assert list(map(number.__getitem__, ["b", "a", "b", "c", "a"])) == [0, 1, 0, 2, 1]
    assert tuple(number) == ("b", "a", "c")
