"""Rules resolved once per name pattern (issue #14): the same layouts as one tensor at a time.

``resolve_rules`` places the first tensor of each class (its name with whole numbers replaced,
its shape, dtype, and whether it is an MTP layer) through the rules and copies the result to
the others with their own layer and expert numbers. These tests compare every layout with the
per-tensor resolution (``_number_blind`` forced False: each name its own class) on families
where the numbers matter (pipeline stages, MTP layers, first-k dense layers, experts over ep,
packed experts), prove rules that *do* read the numbers still place each layer on its own, and
pin the planned headers' bytes to ``header_bytes``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.checkpoint.plan_header import header_text, saved_offsets_json
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.layout import classes as classes_mod
from shardctl.layout import resolve as resolve_mod
from shardctl.layout.engine import build_layout, staged_weight_bytes
from shardctl.layout.rules import Matcher, compile_rules
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RuleSpec
from shardctl.model.inventory import from_config
from shardctl.model.types import ModelInfo, TensorInfo, numel_by_dtype
from tests._models import CONFIGS


def _model(name: str, **overrides: Any) -> ModelInfo:
    return from_config({**CONFIGS[name], **overrides})


def _snapshot(layout: Layout) -> tuple[object, ...]:
    return (layout.stages, layout.ranks, sorted(layout.padded_shapes.items()))


def _both(
    monkeypatch: pytest.MonkeyPatch,
    model: ModelInfo,
    mesh: Mesh,
    rules: tuple[RuleSpec, ...] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008
) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """The layout by name pattern, and by tensor (a fresh resolution each: no cache hit)."""
    classes_mod._CACHE.clear()
    resolve_mod._CACHE.clear()
    fast = build_layout(model, mesh, rules=rules, options=options)
    fast_bytes = staged_weight_bytes(model, mesh, rules=rules, options=options)
    resolve_mod._CACHE.clear()
    with monkeypatch.context() as m:
        m.setattr(resolve_mod, "_number_blind", lambda rules: False)
        slow = build_layout(model, mesh, rules=rules, options=options)
        slow_bytes = staged_weight_bytes(model, mesh, rules=rules, options=options)
    resolve_mod._CACHE.clear()
    classes_mod._CACHE.clear()
    return (*_snapshot(fast), fast_bytes), (*_snapshot(slow), slow_bytes)


CASES = [
    # MTP layer (trailing: last stage, not a decoder layer), first-k dense layer, experts
    ("deepseek_v3", dict(num_nextn_predict_layers=1, include_mtp_layers=True),
     [Mesh(pp=2, tp=2, ep=2), Mesh(pp=3, ep=4), Mesh(pp=4, tp=4)]),
    ("mixtral", dict(num_hidden_layers=12, num_local_experts=16),
     [Mesh(pp=3, ep=4, tp=2), Mesh(pp=2, ep=16), Mesh(tp=2)]),
    ("qwen3_moe", {}, [Mesh(pp=2, ep=2, tp=2)]),
    ("gpt_oss", {}, [Mesh(pp=2, ep=2, tp=2)]),  # packed experts: dim 0 over ep
    ("llama4_text", {}, [Mesh(pp=2, ep=2, tp=2)]),
    ("gpt2", dict(n_layer=11), [Mesh(pp=3, tp=2)]),  # h.{i}, preset globs ln_[12]
    ("stablelm", {}, [Mesh(pp=2, tp=2)]),  # per-head norms.{h}: a number that is no layer
]  # fmt: skip


@pytest.mark.parametrize(("name", "overrides", "meshes"), CASES, ids=[c[0] for c in CASES])
def test_pattern_classes_equal_per_tensor_resolution(
    monkeypatch: pytest.MonkeyPatch, name: str, overrides: dict[str, Any], meshes: list[Mesh]
) -> None:
    model = _model(name, **overrides)
    for mesh in meshes:
        for options in (  # uneven stages (pp=3 of 4 layers) both ways
            LayoutOptions(pipeline="vllm"),
            LayoutOptions(pipeline="tensorrt-llm", vocab_padding="megatron"),
        ):
            fast, slow = _both(monkeypatch, model, mesh, options=options)
            assert fast == slow, (name, mesh, options)


def test_rules_are_matched_once_per_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,536 expert tensors, a handful of name patterns: the matcher runs per pattern."""
    model = _model("mixtral", num_hidden_layers=4, num_local_experts=128)
    experts = sum(".experts." in t.fqn for t in model.tensors)
    assert experts == 4 * 128 * 3
    calls: list[str] = []
    real = Matcher.find

    def counting(self: Matcher, fqn: str, *, need_stage: bool) -> Any:
        calls.append(fqn)
        return real(self, fqn, need_stage=need_stage)

    monkeypatch.setattr(Matcher, "find", counting)
    resolve_mod._CACHE.clear()
    static = resolve_mod.model_rules(model, ())
    resolve_mod._CACHE.clear()
    assert len(static.tensors) == len(model.tensors)
    assert len(calls) < 20, calls  # a dozen name patterns, not 1,557 tensors
    experts_seen = sorted({t.expert for t in static.tensors if t.expert is not None})
    assert experts_seen == list(range(128))
    assert sorted({t.layer for t in static.tensors if t.layer is not None}) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("rule", "replicated_layers"),
    [
        ("model.layers.1.self_attn.q_proj.weight", [1]),  # a literal layer number
        ("model.layers.?.self_attn.q_proj.weight", list(range(10))),  # one character: 0–9
        ("model.layers.[2-3].self_attn.q_proj.weight", [2, 3]),  # a class of digits
        ("model.layers.1*.self_attn.q_proj.weight", [1, 10, 11]),  # a digit after a dot
    ],
)
def test_rules_that_read_layer_numbers_still_place_each_layer(
    monkeypatch: pytest.MonkeyPatch, rule: str, replicated_layers: list[int]
) -> None:
    model = _model("llama", num_hidden_layers=12)
    rules = (RuleSpec(match=rule, tp="R"),)
    fast, slow = _both(monkeypatch, model, Mesh(pp=2, tp=2), rules)
    assert fast == slow
    layout = build_layout(model, Mesh(tp=2), rules=rules)
    got = sorted(
        int(s.fqn.split(".")[2])
        for s in layout.ranks[0].shards
        if s.fqn.endswith("q_proj.weight") and s.placement == "R"
    )
    assert got == replicated_layers


@pytest.mark.parametrize(
    ("globs", "blind"),
    [
        (["model.layers.*.mlp.experts.*.w1.weight", "*h.*.ln_[12].*", "*.[qk]_norm.*"], True),
        (["model.layers.0.*"], False),
        (["model.layers.*1.w2.weight"], False),
        (["model.layers.?.x"], False),
        (["model.layers.[0-3].x"], False),
        (["model.layers.[!a].x"], False),
        (["model.layers.[12].x"], False),
        (["a.#.b"], False),
        (["model.fc12.*"], True),
    ],
)
def test_number_blind(globs: list[str], blind: bool) -> None:
    rules = compile_rules(tuple(RuleSpec(match=g, tp="R") for g in globs), (), "llama")
    assert resolve_mod._number_blind(rules) is blind


# -- planned headers: the same bytes as header_bytes --------------------------------------------

_NAMES = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda n: n != "__metadata__")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            _NAMES,
            st.sampled_from(["BF16", "F32", "I8", "F8_E4M3", "I64"]),
            st.lists(st.integers(0, 9), max_size=3).map(tuple),
        ),
        max_size=12,
        unique_by=lambda r: r[0],
    ),
    metadata=st.none() | st.dictionaries(_NAMES, st.text(max_size=8), max_size=3),
)
def test_header_text_is_header_bytes(
    rows: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> None:
    from shardctl.dtypes import nbytes

    entries, cursor, ends = [], 0, []
    for name, dtype, shape in rows:
        n = nbytes(dtype, _prod(shape))
        entries.append(HeaderEntry(name, dtype, shape, cursor, cursor + n))
        cursor += n
        ends.append(cursor)
    want = header_bytes(entries, metadata)
    names, dtypes, shapes = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    got = header_text(names, dtypes, shapes, ends, metadata)
    assert got == want


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(_NAMES, st.lists(st.integers(0, 10**6), max_size=3).map(tuple)),
        max_size=10,
        unique_by=lambda r: r[0],
    )
)
def test_saved_offsets_json_is_json_dumps(rows: list[tuple[str, tuple[int, ...]]]) -> None:
    want = json.dumps({n: {"saved_offsets": list(o)} for n, o in rows}, separators=(",", ":"))
    assert saved_offsets_json([n for n, _ in rows], [o for _, o in rows]) == want


def test_numel_by_dtype_counts_in_first_appearance_order() -> None:
    tensors = (
        TensorInfo("a", (2, 3), "F32"),
        TensorInfo("b", (4,), "BF16"),
        TensorInfo("c", (2, 3), "F32"),
        TensorInfo("d", (), "BF16"),
        TensorInfo("e", (0, 5), "I8"),
    )
    got = numel_by_dtype(tensors)
    assert got == {"F32": 12, "BF16": 5, "I8": 0}
    assert list(got) == ["F32", "BF16", "I8"]


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_reshard_drops_its_cached_rules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rule per tensor (~20 MB at 90k tensors) is cached per model; reshard forgets its
    source's once the layout is built, and ``forget`` also clears entries of dead models."""
    from shardctl.api import reshard
    from tests._models import make_checkpoint

    model = _model("llama")
    resolve_mod.model_rules(model, ())
    assert any(ref() is model for ref, _ in resolve_mod._CACHE.entries.values())
    resolve_mod.forget(model)
    assert not any(ref() is model for ref, _ in resolve_mod._CACHE.entries.values())
    src = make_checkpoint("mixtral", tmp_path / "hf")
    resolve_mod._CACHE.clear()
    reshard(src, tmp_path / "tp2", mesh={"tp": 2, "ep": 2})
    assert resolve_mod._CACHE.entries == {}
