"""The layout engine on real model shapes: bytes, stages, ep, KV replication, padding, errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import LayoutError
from shardctl.layout.engine import build_layout, rank_weight_bytes
from shardctl.layout.placement import parse_placement, resolve_placement
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RuleSpec
from shardctl.model.types import ModelInfo
from tests._layout_models import inventory, llama3_8b, llama31_405b, mixtral_8x7b
from tests.test_layout_properties import check_tensor

TINY = {
    "llama": dict(hidden=16, layers=4, heads=4, kv_heads=2, inter=24, vocab=50),
    "qwen2-tied": dict(hidden=16, layers=3, heads=4, kv_heads=1, inter=20, vocab=30, tied=True,
                       qkv_bias=True),
    "mixtral": dict(hidden=8, layers=2, heads=4, kv_heads=2, inter=12, vocab=20, experts=4),
    "phi3": dict(hidden=16, layers=2, heads=4, kv_heads=2, inter=12, vocab=22),
    "gpt2": dict(hidden=16, layers=3, heads=4, kv_heads=4, inter=64, vocab=25, positions=8),
    "gemma": dict(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=8, inter=12, vocab=18,
                  tied=True),
}  # fmt: skip


def tiny(name: str) -> ModelInfo:
    return inventory(name.split("-")[0], **TINY[name])  # type: ignore[arg-type]


def shard_of(layout: Layout, fqn: str, *, pp: int = 0, ep: int = 0, tp: int = 0):  # type: ignore[no-untyped-def]
    return next(s for s in layout.rank_layout(pp=pp, ep=ep, tp=tp).shards if s.fqn == fqn)


# -- bytes -------------------------------------------------------------------------------------


def test_llama3_8b_bytes_exact() -> None:
    model = llama3_8b()
    assert model.parameters == 8_030_261_248
    assert sum(r.nbytes for r in build_layout(model, Mesh()).ranks) == 16_060_522_496
    # TP8: everything split except the 65 norms [4096], which every tp rank holds.
    norms = (2 * 32 + 1) * 4096 * 2
    layout = build_layout(model, Mesh(tp=8))
    assert sum(r.nbytes for r in layout.ranks) == 16_060_522_496 + 7 * norms
    assert len({r.nbytes for r in layout.ranks}) == 1


def test_405b_fast_path_equals_full_layout() -> None:
    """The per-coordinate fast path (used by search) equals summing the full layout.
    Speed is measured in bench/plan_speed.py, not here."""
    model = llama31_405b()
    for pp, tp in [(1, 8), (2, 8), (4, 8), (8, 4), (2, 16)]:
        mesh = Mesh(pp=pp, tp=tp)
        opts = LayoutOptions(pipeline="vllm")
        fast = rank_weight_bytes(model, mesh, options=opts)
        full = build_layout(model, mesh, options=opts)
        assert fast == {(r.pp, r.ep, r.tp): r.nbytes for r in full.ranks}


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(TINY)),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from(["tp", "megatron", "none"]),
    st.sampled_from(["vllm", "tensorrt-llm"]),
)
def test_every_tensor_tiles_and_fast_path_agrees(
    name: str, tp: int, pp: int, ep: int, padding: str, conv: str
) -> None:
    model = tiny(name)
    mesh = Mesh(pp=pp, tp=tp, ep=ep)
    options = LayoutOptions(vocab_padding=padding, pipeline=conv, uneven="chunk")
    try:
        layout = build_layout(model, mesh, options=options)
    except LayoutError as err:
        assert str(err).split(":")[0], err  # names a tensor or a key
        return
    assert rank_weight_bytes(model, mesh, options=options) == {
        (r.pp, r.ep, r.tp): r.nbytes for r in layout.ranks
    }
    assert [(r.pp, r.ep, r.tp) for r in layout.ranks] == [
        (p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)
    ]
    dims = model.dims
    assert dims is not None
    tied_last = dims.tie_word_embeddings and pp > 1
    replicated = padding = 0
    for info in model.tensors:
        stages = 2 if tied_last and info.fqn.endswith(("embed_tokens.weight", "wte.weight")) else 1
        groups = stages * (1 if ".experts." in info.fqn else ep)  # experts: on one ep rank
        one = build_layout(model, Mesh(tp=tp), options=options)  # tp only: per-tp coverage
        per_tp = np.zeros(info.shape, dtype=np.int64)
        for r in one.ranks:
            for s in r.shards:
                if s.fqn == info.fqn:
                    for p in s.pieces:
                        idx = zip(p.offsets, p.sizes, strict=True)
                        per_tp[tuple(slice(o, o + n) for o, n in idx)] += 1
        check_tensor(layout, info, per_tp * groups)
        replicated += (int((per_tp * groups).sum()) - info.numel) * 2
        if info.fqn in layout.padded_shapes:
            padding += (int(np.prod(layout.padded_shapes[info.fqn])) - info.numel) * 2 * groups
    # All ranks together: the model, plus exactly the replicated bytes, plus zero padding.
    assert sum(r.nbytes for r in layout.ranks) == model.weight_bytes + replicated + padding


# -- stages --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2-tied", "gemma", "gpt2"])
def test_tied_embedding_on_first_and_last_stage(name: str) -> None:
    model = tiny(name)
    layout = build_layout(model, Mesh(pp=2), options=LayoutOptions(pipeline="vllm"))
    emb = "transformer.wte.weight" if name == "gpt2" else "model.embed_tokens.weight"
    holders = [r.pp for r in layout.ranks if any(s.fqn == emb for s in r.shards)]
    assert holders == [0, 1]
    final = "transformer.ln_f.weight" if name == "gpt2" else "model.norm.weight"
    assert [r.pp for r in layout.ranks if any(s.fqn == final for s in r.shards)] == [1]
    if name == "gpt2":
        wpe = [r.pp for r in layout.ranks if any(s.fqn.endswith("wpe.weight") for s in r.shards)]
        assert wpe == [0]


def test_untied_head_only_on_last_stage() -> None:
    layout = build_layout(tiny("llama"), Mesh(pp=2, tp=2))
    for fqn, want in [("model.embed_tokens.weight", [0]), ("lm_head.weight", [1])]:
        assert sorted({r.pp for r in layout.ranks for s in r.shards if s.fqn == fqn}) == want
    assert layout.stages[1].layers == (2, 3)
    assert all(
        s.fqn.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head"))
        for r in layout.ranks
        if r.pp == 1
        for s in r.shards
    )


# -- tp styles, fused parts, KV replication --------------------------------------------------------


def test_llama_placements_resolved() -> None:
    layout = build_layout(tiny("qwen2-tied"), Mesh(tp=2))
    got = {s.fqn.replace("model.layers.0.", ""): s.placement for s in layout.ranks[0].shards}
    assert got["model.embed_tokens.weight"] == "S(0)"
    assert got["self_attn.q_proj.weight"] == "S(0)" and got["self_attn.q_proj.bias"] == "S(0)"
    assert got["self_attn.k_proj.weight"] == "S(0)·rep[2]"  # 1 kv head, tp 2
    assert got["self_attn.o_proj.weight"] == "S(1)" and got["mlp.down_proj.weight"] == "S(1)"
    assert got["input_layernorm.weight"] == "R"


def test_gpt2_conv1d_storage_swaps_dims() -> None:
    layout = build_layout(tiny("gpt2"), Mesh(tp=2))
    got = {s.fqn.replace("transformer.h.0.", ""): s for s in layout.ranks[1].shards}
    assert got["attn.c_attn.weight"].placement == "S(1)·parts[16,16,16]"
    assert got["attn.c_attn.bias"].placement == "S(0)·parts[16,16,16]"
    assert [p.offsets for p in got["attn.c_attn.weight"].pieces] == [(0, 8), (0, 24), (0, 40)]
    assert (
        got["attn.c_proj.weight"].placement == "S(0)" and got["attn.c_proj.bias"].placement == "R"
    )
    assert got["mlp.c_fc.weight"].placement == "S(1)" and got["mlp.c_fc.bias"].placement == "S(0)"
    assert got["mlp.c_proj.weight"].placement == "S(0)" and got["mlp.c_proj.bias"].placement == "R"
    assert got["transformer.wpe.weight"].placement == "R"


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    layout = build_layout(llama3_8b(), Mesh(tp=16))  # 8 kv heads of 128
    k = "model.layers.0.self_attn.k_proj.weight"
    for r in range(16):
        s = shard_of(layout, k, tp=r)
        assert s.local_shape == (128, 4096)
        assert s.offsets == ((r // 2) * 128, 0)  # rank r holds kv head r // (tp / n_kv)
    q = shard_of(layout, "model.layers.0.self_attn.q_proj.weight", tp=5)
    assert q.offsets == (5 * 256, 0) and q.local_shape == (256, 4096)


def test_phi3_fused_parts_with_kv_replication() -> None:
    model = tiny("phi3")  # 4 heads, 2 kv heads, head_dim 4: qkv_proj [32, 16]
    layout = build_layout(model, Mesh(tp=4))
    s = shard_of(layout, "model.layers.0.self_attn.qkv_proj.weight", tp=3)
    assert s.placement == "S(0)·parts[16,8,8]·rep[2]"
    assert [(p.offsets[0], p.sizes[0], p.local_offsets[0]) for p in s.pieces] == [
        (12, 4, 0), (16 + 4, 4, 4), (24 + 4, 4, 8)  # q head 3; kv head 1 of K and of V
    ]  # fmt: skip
    gu = shard_of(layout, "model.layers.0.mlp.gate_up_proj.weight", tp=1)
    assert [(p.offsets[0], p.sizes[0]) for p in gu.pieces] == [(3, 3), (15, 3)]


def test_equal_parts_share_what_the_sized_parts_leave() -> None:
    """``parts: [equal, equal, equal]`` splits a fused [3·H, H] qkv as three H-row parts
    whatever H is (a ViT's, which the text dims do not give); beside a sized part, the rest."""
    model = tiny("phi3")  # qkv_proj [32, 16]: 16 q rows, 8 + 8 kv rows
    thirds = RuleSpec(
        "model.layers.*.self_attn.qkv_proj.*", tp="S(0)", parts=("q", "equal", "equal")
    )
    layout = build_layout(model, Mesh(tp=2), rules=[thirds])
    s = shard_of(layout, "model.layers.0.self_attn.qkv_proj.weight", tp=1)
    assert [(p.offsets[0], p.sizes[0]) for p in s.pieces] == [(8, 8), (20, 4), (28, 4)]
    odd = RuleSpec("model.layers.*.self_attn.qkv_proj.*", tp="S(0)", parts=(9, "equal", "equal"))
    with pytest.raises(LayoutError, match=r"less the sized parts \(9\) does not split into 2"):
        build_layout(model, Mesh(tp=2), rules=[odd])


# -- ep --------------------------------------------------------------------------------------------


def test_experts_contiguous_per_ep_rank() -> None:
    layout = build_layout(mixtral_8x7b(), Mesh(ep=4, tp=2))
    for rank in layout.ranks:
        experts = {
            int(s.fqn.split(".experts.")[1].split(".")[0])
            for s in rank.shards
            if ".experts." in s.fqn
        }
        assert experts == {2 * rank.ep, 2 * rank.ep + 1}
    s = shard_of(layout, "model.layers.0.block_sparse_moe.experts.5.w2.weight", ep=2, tp=1)
    assert s.placement == "E2/4·S(1)" and s.offsets == (0, 7168)
    gate = shard_of(layout, "model.layers.0.block_sparse_moe.gate.weight", ep=3, tp=1)
    assert gate.placement == "R"


def test_ep_errors() -> None:
    with pytest.raises(
        LayoutError, match=r"mesh.ep: ep=3 does not divide num_experts=8.*\{1, 2, 4, 8\}"
    ):
        build_layout(mixtral_8x7b(), Mesh(ep=3))
    with pytest.raises(LayoutError, match=r"ep=2 but the model has no experts.*use ep=1"):
        build_layout(llama3_8b(), Mesh(ep=2))


# -- vocab padding -------------------------------------------------------------------------------


def test_vocab_padding_megatron_on_embedding_and_head() -> None:
    layout = build_layout(llama3_8b(), Mesh(tp=8), options=LayoutOptions(vocab_padding="megatron"))
    assert layout.padded_shapes == {
        "model.embed_tokens.weight": (129024, 4096),  # next multiple of 128·8 = 1024
        "lm_head.weight": (129024, 4096),
    }
    last = shard_of(layout, "lm_head.weight", tp=7)
    assert last.local_shape == (16128, 4096)
    assert last.pieces[0].offsets == (7 * 16128, 0) and last.pieces[0].sizes == (
        128256 - 7 * 16128,
        4096,
    )
    assert last.placement == "S(0)·pad[129024]"
    assert build_layout(llama3_8b(), Mesh(tp=8)).padded_shapes == {}  # tp policy: divisible


def test_vocab_padding_none_is_an_error_when_uneven() -> None:
    model = inventory("llama", hidden=16, layers=2, heads=4, kv_heads=2, inter=24, vocab=51)
    with pytest.raises(LayoutError) as err:
        build_layout(model, Mesh(tp=2), options=LayoutOptions(vocab_padding="none"))
    assert str(err.value).startswith("model.embed_tokens.weight: size 51 is not divisible by tp=2")
    assert "uneven: chunk" in str(err.value)
    layout = build_layout(model, Mesh(tp=2))  # default "tp" policy pads to 52
    assert layout.padded_shapes["lm_head.weight"] == (52, 16)


# -- errors and rules ----------------------------------------------------------------------------


def test_heads_error_prints_numbers_and_remedy() -> None:
    with pytest.raises(LayoutError) as err:
        build_layout(llama3_8b(), Mesh(tp=3))
    msg = str(err.value)
    assert msg.startswith("model.layers.0.self_attn.q_proj.weight: tp=3 does not divide")
    assert "num_attention_heads=32" in msg
    assert "tp degrees that split every tensor (heads, K/V heads, intermediate, vocab, " in msg
    assert msg.endswith("experts): {1, 2, 4, 8, 16, 32}")
    model = inventory("llama", hidden=48, layers=1, heads=12, kv_heads=4, inter=24, vocab=48)
    with pytest.raises(LayoutError) as err:
        build_layout(model, Mesh(tp=6))
    msg = str(err.value)
    assert "k_proj.weight: tp=6 is above num_key_value_heads=4 but not a multiple" in msg
    assert msg.endswith("experts): {1, 2, 4, 12}")  # every constraint, not only K/V's


def test_unknown_architecture_names_closest_family_by_tensor_names() -> None:
    # GPT-2's tensor names under a model_type that spells like none of the families
    gpt2 = tiny("gpt2")
    model = ModelInfo("newarch", gpt2.dims, gpt2.tensors, gpt2.dtype, "checkpoint")
    with pytest.raises(LayoutError) as err:
        build_layout(model, Mesh(tp=2))
    msg = str(err.value)
    assert "architecture 'newarch' has no preset (closest known family: 'gpt2'" in msg
    assert "add a manifest rule" in msg


def test_uneven_dim_error_default() -> None:
    model = inventory("llama", hidden=16, layers=1, heads=4, kv_heads=2, inter=21, vocab=48)
    with pytest.raises(LayoutError, match=r"gate_proj.weight: size 21 is not divisible by tp=2"):
        build_layout(model, Mesh(tp=2))
    layout = build_layout(model, Mesh(tp=2), options=LayoutOptions(uneven="chunk"))
    assert shard_of(layout, "model.layers.0.mlp.down_proj.weight", tp=1).local_shape == (16, 10)


def test_unmatched_tensor_names_it_and_the_closest_pattern() -> None:
    base = tiny("llama")
    extra = base.tensors[1].__class__("model.layers.0.self_attn.rotary.inv_freq", (4,), "F32")
    model = ModelInfo("llama", base.dims, (*base.tensors, extra), "BF16", "inline")
    with pytest.raises(LayoutError) as err:
        build_layout(model, Mesh())
    msg = str(err.value)
    assert msg.startswith("rules: 1 tensor placed by no rule (1 pattern): ")
    assert "model.layers.*.self_attn.rotary.inv_freq;" in msg
    assert 'closest rule pattern to the first is "model.layers.*.self_attn.' in msg
    assert '{match: "model.layers.*.self_attn.rotary.inv_freq", tp: R}' in msg
    ok = build_layout(model, Mesh(tp=2), rules=(RuleSpec("*.inv_freq", tp="R"),))
    assert shard_of(ok, extra.fqn).placement == "R"


def test_manifest_rules_override_preset_first_match_wins() -> None:
    rules = (
        RuleSpec("model.embed_tokens.weight", tp="R"),  # stage still "embedding" from the preset
        RuleSpec("model.layers.*.mlp.*", tp="R"),
        RuleSpec("model.layers.*.mlp.down_proj.weight", tp="S(0)"),  # shadowed: harmless
    )
    layout = build_layout(tiny("llama"), Mesh(tp=2, pp=2), rules=rules)
    assert shard_of(layout, "model.embed_tokens.weight").placement == "R"
    assert shard_of(layout, "model.layers.0.mlp.down_proj.weight").placement == "R"
    assert [r.pp for r in layout.ranks if any(s.fqn == "lm_head.weight" for s in r.shards)] == [
        1,
        1,
    ]


def test_manifest_rule_matching_nothing_is_an_error() -> None:
    rules = (RuleSpec("model.layers.*.attn.q.weight", tp="S(0)"),)
    with pytest.raises(LayoutError) as err:
        build_layout(tiny("llama"), Mesh(), rules=rules)
    msg = str(err.value)
    assert msg.startswith('rules[0].match: no tensor matches "model.layers.*.attn.q.weight"')
    assert 'did you mean "model.layers.*.self_attn.q_proj.weight"' in msg


def test_bad_rule_values() -> None:
    for rule, text in [
        (RuleSpec("x", tp="S(two)"), "rules[0].tp: unknown placement 'S(two)'"),
        (RuleSpec("x", tp="R", stage="middle"), "rules[0].stage: unknown stage 'middle'"),
        (RuleSpec("x", tp="R", heads="v"), "rules[0].heads: unknown heads 'v'"),
        (RuleSpec("lm_head.weight", tp="S(2)"), "lm_head.weight: S(2) is out of range"),
    ]:
        with pytest.raises(LayoutError, match=re.escape(text)):
            build_layout(tiny("llama"), Mesh(), rules=(rule,))


def test_placement_parse_and_resolve() -> None:
    assert str(parse_placement(" S( -1 ) ")) == "S(-1)"
    assert resolve_placement(parse_placement("S(-1)"), (4, 6)).placement.dim == 1
    linear = {
        k: resolve_placement(parse_placement(k), (8, 4)).placement for k in ("colwise", "rowwise")
    }
    conv1d = {
        k: resolve_placement(parse_placement(k), (4, 8), conv1d=True).placement
        for k in ("colwise", "rowwise")
    }
    assert (str(linear["colwise"]), str(linear["rowwise"])) == ("S(0)", "S(1)")
    assert (str(conv1d["colwise"]), str(conv1d["rowwise"])) == ("S(1)", "S(0)")
    for conv in (False, True):
        assert (
            str(resolve_placement(parse_placement("colwise"), (8,), conv1d=conv).placement)
            == "S(0)"
        )
        assert (
            str(resolve_placement(parse_placement("rowwise"), (8,), conv1d=conv).placement) == "R"
        )
    v = resolve_placement(parse_placement("vocab"), (50, 8))
    assert v.vocab and v.placement.dim == 0
    with pytest.raises(LayoutError, match="unknown placement 'columnwise'"):
        parse_placement("columnwise")


def test_non_layer_tensor_without_stage_needs_one_only_with_pp() -> None:
    base = tiny("llama")
    extra = base.tensors[0].__class__("model.rope_scale", (4,), "F32")
    model = ModelInfo("llama", base.dims, (*base.tensors, extra), "BF16", "inline")
    rules = (RuleSpec("model.rope_scale", tp="R"),)
    build_layout(model, Mesh(), rules=rules)
    with pytest.raises(
        LayoutError, match=r"model.rope_scale: not in a decoder layer.*stage: first"
    ):
        build_layout(model, Mesh(pp=2), rules=rules)
    layout = build_layout(
        model, Mesh(pp=2), rules=(RuleSpec("model.rope_scale", tp="R", stage="all"),)
    )
    assert [r.pp for r in layout.ranks if any(s.fqn == "model.rope_scale" for s in r.shards)] == [
        0,
        1,
    ]
