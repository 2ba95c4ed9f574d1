"""MiniMax-M2 (``minimax_m2``, shardctl/archs/minimax_m2.py) at its published sizes, its router
rule, and the configs it refuses. The end-to-end flow (save_pretrained checkpoint, reshard,
verify's three levels, merge) is tests/test_families.py's; the FP8 round trip is
tests/test_quant_families.py's.

The published shapes are those of MiniMaxAI/MiniMax-M2's config.json, copied into
manifests/minimax-m2-fp8-vllm-tp4.yaml with its ``quantization_config`` (FP8, 128 x 128 block
scales; the router, its correction bias and the head not converted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from tests._cli import ROOT
from tests._multimodal import plan_json, refused_in_one_line

MANIFEST = ROOT / "manifests/minimax-m2-fp8-vllm-tp4.yaml"


def _published() -> dict[str, Any]:
    model: dict[str, Any] = yaml.safe_load(MANIFEST.read_text())["model"]
    return model


def test_inventory_counts_the_published_shapes() -> None:
    """The inventory from the config equals the closed form of the shapes: per layer q/k/v/o,
    the whole-projection q/k norms, two layer norms, the router and its bias, 256 experts of
    three matrices; plus embeddings, head and final norm, and one F32 scale per 128 x 128 block
    of every FP8 projection."""
    cfg = _published()
    h, layers, e, i, v = 3072, 62, 256, 1536, 200064
    q, kv = 48 * 128, 8 * 128
    attention = 2 * q * h + 2 * kv * h
    per_layer = attention + q + kv + 2 * h + e * h + e + e * 3 * i * h
    weights = layers * per_layer + 2 * v * h + h
    blocks = 2 * (math.ceil(q / 128) * math.ceil(h / 128)) + 2 * (
        math.ceil(kv / 128) * math.ceil(h / 128)
    )
    blocks += e * 3 * math.ceil(i / 128) * math.ceil(h / 128)
    model = from_config(cfg)
    assert weights == 228_689_764_864
    assert model.parameters == weights + layers * blocks
    dtypes = {t.fqn: t.dtype for t in model.tensors}
    p = "model.layers.7"
    assert dtypes[f"{p}.block_sparse_moe.experts.9.w2.weight"] == "F8_E4M3"
    assert dtypes[f"{p}.block_sparse_moe.experts.9.w2.weight_scale_inv"] == "F32"
    assert dtypes[f"{p}.self_attn.q_proj.weight"] == "F8_E4M3"
    for kept in ("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight"):  # fmt: skip
        assert dtypes[f"{p}.{kept}"] == "BF16", kept
    assert dtypes["lm_head.weight"] == "BF16"


def test_real_size_rank_at_tp4_ep2() -> None:
    """A tp 4 x ep 2 rank holds 12 query and 2 KV heads of 128 with the same heads' slices of
    the q/k norms (vLLM's MiniMaxText01RMSNormTP loads them split), 128 experts at a quarter
    of their width, and the whole router and bias."""
    model = from_config({k: v for k, v in _published().items() if k != "quantization_config"})
    layout = build_layout(model, Mesh(tp=4, ep=2))
    shards = {s.fqn: s for s in layout.ranks[5].shards}  # ep rank 1, tp rank 1
    p = "model.layers.3"
    assert shards[f"{p}.self_attn.q_proj.weight"].local_shape == (12 * 128, 3072)
    assert shards[f"{p}.self_attn.k_proj.weight"].local_shape == (2 * 128, 3072)
    q_norm = shards[f"{p}.self_attn.q_norm.weight"]
    assert q_norm.local_shape == (12 * 128,) and q_norm.pieces[0].offsets == (12 * 128,)
    k_norm = shards[f"{p}.self_attn.k_norm.weight"]
    assert k_norm.local_shape == (2 * 128,) and k_norm.pieces[0].offsets == (2 * 128,)
    experts = sorted({int(n.split(".")[5]) for n in shards if ".experts." in n and p in n})
    assert experts == list(range(128, 256))
    assert shards[f"{p}.block_sparse_moe.experts.200.w1.weight"].local_shape == (384, 3072)
    assert shards[f"{p}.block_sparse_moe.experts.200.w2.weight"].local_shape == (3072, 384)
    assert shards[f"{p}.block_sparse_moe.gate.weight"].local_shape == (256, 3072)
    assert shards[f"{p}.block_sparse_moe.e_score_correction_bias"].local_shape == (256,)


def test_k_norm_follows_replicated_kv_heads_at_tp16() -> None:
    """Past 8 KV heads each KV head sits on two ranks; the k norm's slice goes with it."""
    model = from_config({k: v for k, v in _published().items() if k != "quantization_config"})
    layout = build_layout(model, Mesh(tp=16))
    for rank in (4, 5):  # both hold KV head 2
        shards = {s.fqn: s for s in layout.ranks[rank].shards}
        k_norm = shards["model.layers.0.self_attn.k_norm.weight"]
        assert k_norm.local_shape == (128,) and k_norm.pieces[0].offsets == (256,)
        assert shards["model.layers.0.self_attn.q_norm.weight"].local_shape == (3 * 128,)


def test_route_weights_reproduce_transformers_router() -> None:
    """verify recomputes the weights of pinned experts with the family's rule: at the router's
    own choices it must give exactly MiniMaxM2TopKRouter's (sigmoid at the experts the biased
    scores chose, renormalized), not the softmax default."""
    from transformers import AutoModelForCausalLM

    from shardctl.archs import family_for
    from tests._models import make_config

    cfg = make_config("minimax_m2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.gate.weight.normal_()
        block.e_score_correction_bias.normal_(std=0.5)
        logits, weights, chosen = block.gate(
            torch.randn(64, cfg.hidden_size), block.e_score_correction_bias
        )
    rule = family_for("minimax_m2").forward.route_weights  # type: ignore[union-attr]
    assert rule is not None
    got = rule(logits, chosen, cfg.to_dict())
    torch.testing.assert_close(got, weights.float(), rtol=1e-6, atol=1e-6)
    unbiased = torch.topk(torch.sigmoid(logits), cfg.num_experts_per_tok, dim=-1).indices
    assert not torch.equal(unbiased.sort(-1).values, chosen.sort(-1).values)  # the bias chose


def test_manifest_plans_on_four_h200(tmp_path: Path) -> None:
    """The published FP8 checkpoint at tp 4: 57.6 GB of weights per rank (a quarter of the
    230 GB of tensors and the whole router), 2 KV heads x 62 layers of cache per token per
    rank, and a rotary table of ``rotary_dim`` columns."""
    doc = plan_json(tmp_path, MANIFEST.read_text())
    assert doc["fits"] is True
    ranks = doc["ranks"]
    assert len(ranks) == 4
    weights = {r["memory"]["weights"] for r in ranks}
    assert len(weights) == 1
    (w,) = weights
    assert 57.0e9 < w < 58.0e9, w
    kv = doc["kv_cache"]
    assert kv["bytes_per_token"] == 62 * 2 * 8 * 128 * 2  # K and V, 8 heads of 128, BF16
    assert kv["bytes_per_token_per_rank"] == [62 * 2 * 2 * 128 * 2]
    # vLLM's cos/sin table: 196,608 positions x rotary_dim 64 (not head_dim 128), BF16
    detail = doc["memory_model"]["detail_per_stage"][0]
    assert detail["overhead.rotary_cache"] == 196_608 * 64 * 2


def test_vllm_holds_the_router_in_float32(tmp_path: Path) -> None:
    """vLLM's MiniMaxM2MoE builds the router as ``ReplicatedLinear(params_dtype=torch.float32)``
    and the correction bias as a float32 parameter, whatever the checkpoint stores (BF16): each
    rank of the published model at tp 4 holds 62 x (256 x 3,072 + 256) x 2 bytes more under
    vLLM than the files hold (97.5 MB, every rank: the router is replicated). SGLang's plan is
    the files' bytes."""
    text = MANIFEST.read_text()
    vllm = plan_json(tmp_path, text)
    files = plan_json(tmp_path, text.replace("engine: vllm", "engine: sglang"))
    extra = 62 * (256 * 3072 + 256) * (4 - 2)
    for a, b in zip(vllm["ranks"], files["ranks"], strict=True):
        assert a["memory"]["weights"] - b["memory"]["weights"] == extra == 97_549_312
    assert vllm["model"] == files["model"]  # the checkpoint described as it is, both ways


def test_vllm_float32_reads_a_checkpoint(tmp_path: Path) -> None:
    """The same from a save_pretrained checkpoint: its BF16 router and bias are priced F32
    under vLLM only; every other tensor keeps the dtype its header gives."""
    from shardctl.model.inventory import from_checkpoint
    from shardctl.plan.memory.spec import Workload
    from shardctl.plan.weights import served_model
    from tests._models import make_checkpoint

    model = from_checkpoint(make_checkpoint("minimax_m2", tmp_path / "src"))
    assert served_model(model, Workload(engine="sglang")) is model
    served = served_model(model, Workload(engine="vllm"))
    before = {t.fqn: t.dtype for t in model.tensors}
    after = {t.fqn: t.dtype for t in served.tensors}
    wide = {f for f in after if f.endswith(("block_sparse_moe.gate.weight", "correction_bias"))}
    assert len(wide) == 2 * model.dims.num_layers
    assert {before[f] for f in wide} == {"BF16"} and {after[f] for f in wide} == {"F32"}
    assert {f: d for f, d in after.items() if f not in wide} == {
        f: d for f, d in before.items() if f not in wide
    }
    grown = sum(t.numel for t in model.tensors if t.fqn in wide) * 2
    assert served.weight_bytes == model.weight_bytes + grown


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"attn_type_list": [0, 1, 1, 1]}, "attn_type_list has linear-attention layers"),
        ({"shared_intermediate_size": 1536}, "shared_intermediate_size 1536"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"use_routing_bias": False}, "use_routing_bias false"),
        ({"qk_norm_type": "per_head"}, "normalizes the whole q and k projections"),
    ],
)
def test_what_minimax_m2_does_not_build_is_refused(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    cfg = {k: v for k, v in _published().items() if k != "quantization_config"}
    refused_in_one_line(tmp_path, {**cfg, "num_hidden_layers": 4, **change}, says)
