"""Weight bytes by tensor class (``shardctl/layout/classes.py``, issue #14): ``plan``'s bytes per
rank without one object per tensor, equal to the per-tensor resolution's and to the bytes of
``build_layout``'s shards, for every family where the numbers matter (stages, MTP layers,
first-k dense layers, experts over ep, packed experts, per-head norms), at 10,000+ tensors,
and with the same errors; models the per-tensor path must decide are handed over.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import ShardctlError
from shardctl.layout import classes as classes_mod
from shardctl.layout import engine as engine_mod
from shardctl.layout import resolve as resolve_mod
from shardctl.layout.engine import build_layout, staged_weight_bytes
from shardctl.layout.pipeline import layer_index
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.model.inventory import from_config
from shardctl.model.types import ModelInfo, TensorInfo
from tests._models import CONFIGS
from tests.test_layout_name_patterns import CASES as PATTERN_CASES


def _model(name: str, **overrides: Any) -> ModelInfo:
    return from_config({**CONFIGS[name], **overrides})


@contextmanager
def _fresh() -> Iterator[None]:
    classes_mod._CACHE.clear()
    resolve_mod._CACHE.clear()
    try:
        yield
    finally:
        classes_mod._CACHE.clear()
        resolve_mod._CACHE.clear()


@contextmanager
def _per_tensor(on: bool = True) -> Iterator[None]:
    """Fresh caches; with ``on``, both class paths (weight bytes and resolution) hand over, so
    the engine decides tensor by tensor."""
    real = engine_mod._staged_by_class, engine_mod._resolve_by_class
    with _fresh():
        if on:
            engine_mod._staged_by_class = lambda *a: None  # type: ignore[assignment]
            engine_mod._resolve_by_class = lambda *a: None  # type: ignore[assignment]
        try:
            yield
        finally:
            engine_mod._staged_by_class, engine_mod._resolve_by_class = real


def _refused(err: ShardctlError) -> tuple[str, ...]:
    return ("refused", type(err).__name__, str(err), err.where, err.hint)


def _outcome(
    model: ModelInfo,
    mesh: Mesh,
    *,
    by_class: bool,
    rules: tuple[RuleSpec, ...] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008
) -> Any:
    """``staged_weight_bytes`` by class or by tensor, or the error it raises."""
    with _per_tensor(not by_class):
        try:
            return staged_weight_bytes(model, mesh, rules=rules, options=options)
        except ShardctlError as err:
            return _refused(err)


def _resolution(
    model: ModelInfo,
    mesh: Mesh,
    *,
    by_class: bool,
    rules: tuple[RuleSpec, ...] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008
) -> Any:
    """``engine.resolve`` by class or by tensor (``None``: the class path handed over), or
    the error it raises."""
    with _per_tensor(not by_class):
        try:
            if by_class:
                engine_mod._check_options(mesh, options)
                return engine_mod._resolve_by_class(model, mesh, rules, options)
            return engine_mod.resolve(model, mesh, rules=rules, options=options)
        except ShardctlError as err:
            return _refused(err)


def _shard_bytes(
    model: ModelInfo, mesh: Mesh, options: LayoutOptions
) -> dict[tuple[int, int, int], int]:
    with _fresh():
        layout = build_layout(model, mesh, options=options)
    return {(r.pp, r.ep, r.tp): r.nbytes for r in layout.ranks}


CASES = [
    *PATTERN_CASES,  # test_layout_name_patterns' families and meshes, and a tied embedding
    ("llama", dict(num_hidden_layers=6, tie_word_embeddings=True), [Mesh(pp=2, tp=2)]),
]


@pytest.mark.parametrize(("name", "overrides", "meshes"), CASES, ids=[c[0] for c in CASES])
def test_bytes_by_class_equal_per_tensor_and_the_shards(
    name: str, overrides: dict[str, Any], meshes: list[Mesh]
) -> None:
    model = _model(name, **overrides)
    with _fresh():
        assert classes_mod.classes_of(model, ()) is not None  # the class path is taken
    for mesh in meshes:
        for options in (
            LayoutOptions(pipeline="vllm"),
            LayoutOptions(pipeline="tensorrt-llm", vocab_padding="megatron"),
        ):
            fast = _outcome(model, mesh, by_class=True, options=options)
            slow = _outcome(model, mesh, by_class=False, options=options)
            assert fast == slow, (name, mesh, options)
            assert fast[1] == _shard_bytes(model, mesh, options)


_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic"}  # fmt: skip
RESOLVE_CASES = [
    *CASES,
    ("deepseek_v3", dict(num_nextn_predict_layers=1, include_mtp_layers=True),
     [Mesh(pp=2, ep=2, tp=2), Mesh(ep=4)]),
    ("deepseek_v3", dict(quantization_config=_FP8, hidden_size=256, moe_intermediate_size=128,
                         intermediate_size=256), [Mesh(ep=2), Mesh(pp=2, ep=4), Mesh(tp=2)]),
    ("mixtral-quant", dict(quantization_config=_FP8), [Mesh(tp=2, ep=2), Mesh(pp=2)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "overrides", "meshes"), RESOLVE_CASES, ids=[c[0] for c in RESOLVE_CASES]
)
def test_resolution_by_class_equals_per_tensor(
    name: str, overrides: dict[str, Any], meshes: list[Mesh]
) -> None:
    # build_layout's resolution (every tensor's split, placement, stages and ep rank, and the
    # padded shapes) from the classes, equal to the one from a rule per tensor
    model = _model(name, **overrides)
    compared = 0
    for mesh in meshes:
        for options in (
            LayoutOptions(pipeline="vllm"),
            LayoutOptions(pipeline="tensorrt-llm", vocab_padding="megatron", uneven="chunk"),
        ):
            fast = _resolution(model, mesh, by_class=True, options=options)
            slow = _resolution(model, mesh, by_class=False, options=options)
            if isinstance(slow, tuple):  # refused: the same error, or the class path hands over
                assert fast is None or fast == slow, (name, mesh, options)
                continue
            assert fast is not None, (name, mesh)  # the class path is taken
            compared += 1
            assert fast.tensors == slow.tensors, (name, mesh, options)
            assert (fast.stages, fast.padded_shapes) == (slow.stages, slow.padded_shapes)
            assert list(fast.padded_shapes) == list(slow.padded_shapes)
            # the shards: byte for byte the per-tensor layout's
            with _per_tensor(False):
                layout = build_layout(model, mesh, options=options)
            with _per_tensor():
                per_tensor = build_layout(model, mesh, options=options)
            assert layout == per_tensor
    assert compared > 0, name


_DSV3_FP8_12K = _model("deepseek_v3", quantization_config=_FP8, hidden_size=256,
                      moe_intermediate_size=128, intermediate_size=256, n_routed_experts=64,
                      num_hidden_layers=32)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh", "fragment"),
    [
        # the 128-wide blocks of kv_b_proj do not split over 2: the hint's degrees are {1}
        (Mesh(tp=2, ep=2), "kv_b_proj"),
        (Mesh(ep=3), "ep=3 does not divide num_experts=64"),
        (Mesh(pp=33), "pp=33"),  # more stages than layers
    ],
)
def test_a_refused_mesh_is_the_per_tensor_error_without_the_per_tensor_path(
    monkeypatch: pytest.MonkeyPatch, mesh: Mesh, fragment: str
) -> None:
    # DeepSeek-V3 FP8 at 64 routed experts (~12,000 tensors). The classes raise the error the
    # per-tensor path raises (the same tensor, message and hint) without resolving tensor
    # by tensor.
    model = _DSV3_FP8_12K
    assert len(model.tensors) > 10_000
    slow = _outcome(model, mesh, by_class=False)
    assert slow[0] == "refused" and fragment in slow[2], slow
    assert _resolution(model, mesh, by_class=False) == slow

    def per_tensor(*a: Any, **k: Any) -> Any:
        raise AssertionError("the per-tensor path was taken")

    monkeypatch.setattr(engine_mod, "model_rules", per_tensor)
    assert _outcome(model, mesh, by_class=True) == slow
    assert _resolution(model, mesh, by_class=True) == slow


@given(
    pp=st.integers(1, 4),
    ep=st.sampled_from([1, 2, 3, 4, 8]),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    pipeline=st.sampled_from(["even", "vllm", "tensorrt-llm"]),
    padding=st.sampled_from(["none", "tp", "megatron"]),
)
@settings(max_examples=40, deadline=None)
def test_any_mesh_resolves_alike(pp: int, ep: int, tp: int, pipeline: str, padding: str) -> None:
    """Every mesh, valid or not: the same resolution, or the class path hands over and the
    per-tensor path decides (with its own error)."""
    mesh = Mesh(pp=pp, ep=ep, tp=tp)
    options = LayoutOptions(pipeline=pipeline, vocab_padding=padding)
    fast = _resolution(_MIXTRAL, mesh, by_class=True, options=options)
    slow = _resolution(_MIXTRAL, mesh, by_class=False, options=options)
    if fast is None or isinstance(fast, tuple):
        assert isinstance(slow, tuple), (mesh, options)  # handed over only where it refuses
        if isinstance(fast, tuple):
            assert fast == slow  # an option error: raised before either path
    else:
        assert (fast.tensors, fast.stages, fast.padded_shapes) == (
            slow.tensors, slow.stages, slow.padded_shapes
        )  # fmt: skip


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral", "gpt2", "stablelm", "gpt_oss"])
def test_layer_and_expert_numbers_are_each_tensors_own(name: str) -> None:
    overrides = (
        dict(num_nextn_predict_layers=1, include_mtp_layers=True) if name == "deepseek_v3" else {}
    )
    model = _model(name, **overrides)
    with _fresh():
        rc = classes_mod.classes_of(model, ())
    assert rc is not None
    assert rc.layers == [layer_index(t.fqn) for t in model.tensors]
    assert rc.experts == [resolve_mod._expert_index(t.fqn) for t in model.tensors]
    per_tensor = resolve_mod.resolve_rules(model, ()).tensors
    for i, t in enumerate(per_tensor):  # class c's rule with this tensor's own numbers
        c = rc.rules[rc.of[i]]
        assert (t.dim, t.parts, t.groups, t.vocab, t.packed, t.stage) == (
            c.dim, c.parts, c.groups, c.vocab, c.packed, c.stage
        )  # fmt: skip
        assert t.layer == (rc.layers[i] if c.layer is not None else None)
        assert t.expert == (rc.experts[i] if c.expert is not None else None)


def test_twelve_thousand_expert_tensors_are_a_dozen_classes() -> None:
    model = _model("mixtral", num_hidden_layers=16, num_local_experts=256)
    assert len(model.tensors) > 12_000
    with _fresh():
        rc = classes_mod.classes_of(model, ())
    assert rc is not None and len(rc.rules) < 20
    for mesh in (Mesh(pp=2, ep=4, tp=2), Mesh(pp=3, ep=8), Mesh(ep=256)):
        fast = _outcome(model, mesh, by_class=True)
        assert fast == _outcome(model, mesh, by_class=False)
    assert fast[1] == _shard_bytes(model, Mesh(ep=256), LayoutOptions())


def _with(model: ModelInfo, *extra: TensorInfo) -> ModelInfo:
    return replace(model, tensors=model.tensors + extra)


@pytest.mark.parametrize(
    ("edit", "rules"),
    [
        # a quantized member (placed with its group, one by one)
        (
            lambda m: _with(m, TensorInfo("model.layers.0.mlp.gate.weight_scale_inv", (1,), "F32")),
            (),
        ),
        # a rule that reads a layer number
        (lambda m: m, (RuleSpec(match="model.layers.1.self_attn.q_proj.weight", tp="R"),)),
        # "#" and a newline in a name
        (lambda m: _with(m, TensorInfo("model.layers.0.x#.weight", (4,), "BF16")), ()),
        (lambda m: _with(m, TensorInfo("model.layers.0.x\n.weight", (4,), "BF16")), ()),
    ],
)
def test_what_the_per_tensor_path_decides_is_handed_over(
    edit: Any, rules: tuple[RuleSpec, ...]
) -> None:
    model = edit(_model("mixtral", num_hidden_layers=4))
    with _fresh():
        assert classes_mod.classes_of(model, rules) is None
    mesh = Mesh(pp=2, tp=2)
    assert _outcome(model, mesh, by_class=True, rules=rules) == _outcome(
        model, mesh, by_class=False, rules=rules
    )


@pytest.mark.parametrize(
    "extra",
    [
        TensorInfo("model.layers.7.input_layernorm.weight", (64,), "BF16"),  # past num_layers
        TensorInfo("model.layers.1.block_sparse_moe.experts.9.w1.weight", (32, 64), "BF16"),
        TensorInfo("model.something.weight", (4,), "BF16"),  # no rule places it
    ],
)
def test_errors_are_the_per_tensor_paths(extra: TensorInfo) -> None:
    cfg = dict(num_hidden_layers=4, num_local_experts=8, hidden_size=64, intermediate_size=32)
    model = _with(_model("mixtral", **cfg), extra)
    for mesh in (Mesh(pp=2, tp=2, ep=2), Mesh(tp=2)):
        fast = _outcome(model, mesh, by_class=True)
        assert fast[0] == "refused"
        assert fast == _outcome(model, mesh, by_class=False)


@settings(max_examples=40, deadline=None)
@given(
    pp=st.integers(1, 5),
    ep=st.sampled_from([1, 2, 3, 4, 8]),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    pipeline=st.sampled_from(["even", "vllm", "tensorrt-llm"]),
    padding=st.sampled_from(["none", "tp", "megatron"]),
    uneven=st.sampled_from(["error", "chunk"]),
)
def test_any_mesh_decides_alike(
    pp: int, ep: int, tp: int, pipeline: str, padding: str, uneven: str
) -> None:
    """Every mesh, valid or not: the same bytes or the same error both ways."""
    model = _MIXTRAL
    mesh = Mesh(pp=pp, ep=ep, tp=tp)
    options = LayoutOptions(pipeline=pipeline, vocab_padding=padding, uneven=uneven)
    fast = _outcome(model, mesh, by_class=True, options=options)
    assert fast == _outcome(model, mesh, by_class=False, options=options)


_MIXTRAL = _model("mixtral", num_hidden_layers=5, num_local_experts=8)


# ---- plan's per-stage parameter counts (DeepSeek-style families) by class ------------------


def _counts(model: ModelInfo, mesh: Mesh, padding: str, *, by_class: bool) -> Any:
    """``layout_counts`` by class or by tensor, on the stages plan would use."""
    from shardctl.layout.pipeline import assign_layers
    from shardctl.plan.memory import layout_counts as lc

    real = lc._by_class
    with _fresh():
        if not by_class:
            lc._by_class = lambda *a: None  # type: ignore[assignment]
        try:
            num_layers = resolve_mod.model_rules(model, ()).num_layers
            stages = tuple(assign_layers(num_layers, mesh.pp, "vllm", None))
            return lc.layout_counts(model, mesh, stages, padding)
        finally:
            lc._by_class = real


COUNT_CASES = [
    ("deepseek_v3", dict(num_nextn_predict_layers=1, include_mtp_layers=True)),
    ("deepseek_v3", {}),
    ("mixtral", dict(num_hidden_layers=5)),
    ("qwen3_moe", {}),
    ("gpt_oss", {}),
    ("llama", dict(num_hidden_layers=6, tie_word_embeddings=True)),
]


@pytest.mark.parametrize(("name", "overrides"), COUNT_CASES, ids=[c[0] for c in COUNT_CASES])
def test_layout_counts_by_class_equal_per_tensor(name: str, overrides: dict[str, Any]) -> None:
    model = _model(name, **overrides)
    for mesh in (Mesh(), Mesh(pp=2, tp=2), Mesh(pp=3, ep=2), Mesh(ep=2, tp=2)):
        for padding in ("none", "megatron"):
            try:
                slow = _counts(model, mesh, padding, by_class=False)
            except ShardctlError:
                continue  # a mesh this family refuses: nothing to compare
            assert _counts(model, mesh, padding, by_class=True) == slow, (name, mesh, padding)
