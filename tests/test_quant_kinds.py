"""Quantized groups by stem kind (``quant.groups.group_kinds``): what ``plan`` and ``inspect``
read of 45,000 FP8 experts' groups without building one group object per weight.

Held to the walk that builds every group (``group_tensors``) and to ``inspect``'s description
as that walk gives it (``_describe_by_walk`` below, the algorithm it replaced): on a
Qwen3-MoE of 10,000+ tensors written by ``save_pretrained`` and quantized FP8-block / GPTQ,
with one expert's scale re-shaped (a stem of its own kind), and on generated inventories that
mix every scheme, stems without a dot, whole-number leaves and two anchors in one stem.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import InvalidInputError
from shardctl.layout.classes import classes_of
from shardctl.layout.resolve import _shape_key as shape_key
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_checkpoint
from shardctl.model.types import TensorInfo
from shardctl.quant.groups import describe_model, group_kinds, group_tensors
from tests.test_layout_name_patterns import _both
from tests.test_quant_many import bf16, fp8, gptq  # noqa: F401 (fixtures)

_INDEX = re.compile(r"\.\d+\.")


def _describe_by_walk(tensors: Sequence[TensorInfo], config: dict[str, Any]) -> Any:
    """``describe_model`` as it was: one row per group the full walk builds."""
    from shardctl.quant.config import read_quant

    groups = group_tensors(tensors, config)
    qc = read_quant(config, where="checkpoint/config.json")
    if not groups and qc is None:
        return None
    rows: dict[Any, list[int]] = {}
    seen: set[str] = set()
    for g in groups.values():
        if g.logical.fqn in seen:
            continue
        seen.add(g.logical.fqn)
        members = tuple((m.role, f"{m.info.dtype} {list(m.info.shape)}") for m in g.members)
        key = (_INDEX.sub(".*.", g.logical.fqn), g.scheme, members)
        row = rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += sum(m.info.nbytes for m in g.members)
    total = sum(t.nbytes for t in tensors)
    quantized = sum(t.nbytes for t in tensors if t.fqn in groups)
    return {
        "method": qc.describe() if qc else "from tensor names",
        "quantized_weights": len(seen),
        "quantized_bytes": quantized,
        "unquantized_bytes": total - quantized,
        "groups": [
            {"pattern": p, "scheme": s, "count": n, "members": dict(m), "bytes": b}
            for (p, s, m), (n, b) in sorted(rows.items())
        ],
    }


def _same_as_walk(tensors: Sequence[TensorInfo], config: dict[str, Any]) -> int:
    """Every tensor's group by kind is the walk's, up to the stem's name; the kind count."""
    walk = group_tensors(tensors, config)
    kinds = group_kinds(tensors, config)
    placed: set[str] = set()
    for stem, kind, at in kinds.stems:
        first_stem = kinds.stems[kinds.first[kind]][0]
        for i, g in zip(at, kinds.groups[kind], strict=True):
            fqn = tensors[i].fqn
            placed.add(fqn)
            mine = walk.get(fqn)
            if g is None:
                assert mine is None, fqn
                continue
            assert mine is not None, fqn
            assert shape_key(mine) == shape_key(g), fqn
            # the same members, renamed from the kind's first stem to this one
            renamed = [stem + m.info.fqn[len(first_stem) :] for m in g.members]
            assert [m.info.fqn for m in mine.members] == renamed, fqn
            assert mine.logical.fqn == stem + g.logical.fqn[len(first_stem) :], fqn
    assert set(walk) <= placed  # no grouped tensor outside an anchored stem
    return len(kinds.groups)


@pytest.mark.parametrize("scheme", ["fp8", "gptq"])
def test_kinds_are_the_walks_groups_at_ten_thousand_tensors(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    model = from_checkpoint(request.getfixturevalue(scheme))
    assert len(model.tensors) > 10_000
    kinds = _same_as_walk(model.tensors, dict(model.config))
    assert kinds < 20  # 5,000 groups, a handful of kinds
    assert describe_model(model.tensors, model.config) == _describe_by_walk(
        model.tensors, dict(model.config)
    )


@pytest.mark.parametrize("scheme", ["fp8", "gptq"])
def test_layout_by_kind_equals_every_tensor_placed_with_its_own_group(
    scheme: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resolve_rules`` keys a member's class by its stem kind's group and builds real groups
    only for the tensors it places: the layout (and plan's bytes) equal those of placing every
    tensor through the rules with the group its own stem's walk gives it."""
    model = from_checkpoint(request.getfixturevalue(scheme))
    for mesh in (Mesh(ep=2, tp=2), Mesh(pp=7, tp=2)):
        fast, slow = _both(monkeypatch, model, mesh)
        assert fast == slow, (scheme, mesh)


def test_a_reshaped_scale_is_a_kind_of_its_own_and_still_refused(fp8: Path) -> None:  # noqa: F811
    model = from_checkpoint(fp8)
    victim = "model.layers.4.mlp.experts.77.down_proj.weight_scale_inv"
    tensors = [
        TensorInfo(t.fqn, (t.shape[0], t.shape[1] + 1), t.dtype) if t.fqn == victim else t
        for t in model.tensors
    ]
    with pytest.raises(InvalidInputError) as by_kind:
        group_kinds(tensors, model.config)
    with pytest.raises(InvalidInputError) as by_walk:
        group_tensors(tensors, model.config)
    assert str(by_kind.value) == str(by_walk.value) and victim in str(by_kind.value)
    with pytest.raises(InvalidInputError) as described:
        describe_model(tensors, model.config)
    assert str(described.value) == str(by_walk.value)
    assert classes_of(replace(model, tensors=tuple(tensors)), ()) is None  # the per-tensor path


def test_a_stem_that_differs_in_an_unquantized_tensor_is_its_own_kind(fp8: Path) -> None:  # noqa: F811
    model = from_checkpoint(fp8)
    # an input_scale (a replicated member) on one expert only: that stem's group has three
    # members, every other expert's two
    extra = TensorInfo("model.layers.2.mlp.experts.5.up_proj.input_scale", (), "F32")
    tensors = [*model.tensors, extra]
    before = len(group_kinds(model.tensors, model.config).groups)
    assert _same_as_walk(tensors, dict(model.config)) == before + 1
    assert describe_model(tensors, model.config) == _describe_by_walk(tensors, dict(model.config))


# -- generated inventories ------------------------------------------------------------------

_STEMS = ["", "a", "m.layers.0.mlp", "m.layers.1.mlp", "m.layers.10.x", "m.3", "e.0.w", "e.1.w"]


@st.composite
def _inventory(draw: st.DrawFn) -> list[TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for stem in draw(st.lists(st.sampled_from(_STEMS), min_size=1, max_size=8, unique=True)):
        p = f"{stem}." if stem else ""
        out_f, in_f = draw(st.sampled_from([(256, 256), (128, 384), (64, 64)]))
        kind = draw(st.sampled_from(["fp8-block", "fp8", "mxfp4", "plain", "both", "number"]))
        if kind in ("fp8-block", "both"):
            out[f"{p}weight"] = TensorInfo(f"{p}weight", (out_f, in_f), "F8_E4M3")
            rows = -(-out_f // 128) + draw(st.sampled_from([0, 0, 0, 1]))  # sometimes wrong
            out[f"{p}weight_scale_inv"] = TensorInfo(
                f"{p}weight_scale_inv", (rows, -(-in_f // 128)), "F32"
            )
        if kind in ("fp8", "both"):
            out[f"{p}weight"] = TensorInfo(f"{p}weight", (out_f, in_f), "F8_E4M3")
            out[f"{p}weight_scale"] = TensorInfo(f"{p}weight_scale", (out_f, 1), "F32")
        if kind == "mxfp4":
            out[f"{p}gate_blocks"] = TensorInfo(f"{p}gate_blocks", (4, out_f, in_f // 32, 16), "U8")
            out[f"{p}gate_scales"] = TensorInfo(f"{p}gate_scales", (4, out_f, in_f // 32), "U8")
        if kind == "plain":
            out[f"{p}weight"] = TensorInfo(f"{p}weight", (out_f, in_f), "BF16")
        if kind == "number":  # a whole-number leaf beside a group
            out[f"{p}7"] = TensorInfo(f"{p}7", (out_f,), "BF16")
            out[f"{p}weight"] = TensorInfo(f"{p}weight", (out_f, in_f), "F8_E4M3")
            out[f"{p}weight_scale"] = TensorInfo(f"{p}weight_scale", (1,), "F32")
    names = list(out)
    order = draw(st.permutations(names))
    return [out[n] for n in order]


@given(tensors=_inventory())
@settings(max_examples=150, deadline=None)
def test_kinds_and_description_equal_the_walk_on_any_mix(tensors: list[TensorInfo]) -> None:
    try:
        walk = group_tensors(tensors, {})
    except InvalidInputError as err:
        with pytest.raises(InvalidInputError) as by_kind:
            group_kinds(tensors, {})
        assert str(by_kind.value) == str(err)
        return
    assert walk is not None
    _same_as_walk(tensors, {})
    assert describe_model(tensors, {}) == _describe_by_walk(tensors, {})


def test_a_name_with_a_newline_is_described_as_by_the_walk() -> None:
    # JSON allows "\n" in a tensor name; the stems' patterns are then worked out one by one
    tensors = []
    for stem in ("m.layers.0.a\nb", "m.layers.1.a\nb", "m.layers.2.c"):
        tensors.append(TensorInfo(f"{stem}.weight", (256, 256), "F8_E4M3"))
        tensors.append(TensorInfo(f"{stem}.weight_scale_inv", (2, 2), "F32"))
    _same_as_walk(tensors, {})
    described = describe_model(tensors, {})
    assert described == _describe_by_walk(tensors, {})
    assert [g["pattern"] for g in described["groups"]] == [
        "m.layers.*.a\nb.weight",
        "m.layers.*.c.weight",
    ]
