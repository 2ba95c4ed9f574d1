"""Qwen2-VL (``qwen2_vl``) and Qwen3-VL (``qwen3_vl``) at their published sizes: inventories
against the published parameter counts, the towers placed as vLLM places them, the largest
image vLLM profiles, and the refusals of configs the tower cannot take. The end-to-end flow
(save_pretrained checkpoint, reshard, verify's three levels against the
``*ForConditionalGeneration`` logits, merge) is tests/test_families.py's.

Published figures (exact parameter counts, not rounded):

- Qwen2-VL-2B / 7B / 72B-Instruct: 2,208,985,600 / 8,291,375,616 / 73,405,560,320 — the size
  table of a public VLM benchmark harness (per-model ``"qwen/qwen2-vl-7b-instruct":
  8291375616``), found through the search tool;
- Qwen3-VL-2B / 4B / 8B / 32B-Instruct: 2,127,532,032 / 4,437,815,808 / 8,767,123,696 /
  33,357,390,064 — each quoted in several public projects as the loaded model's
  ``sum(p.numel())`` or the Hub API's ``safetensors.total``; the 8B's 750 tensors and
  17,534,247,392 bytes and the 32B's 1,058 tensors too.

The configs are the published config.json's shape keys; those figures hold them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shardctl.archs import family_for
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from tests._cli import ROOT
from tests._multimodal import plan_json, qwen3_vl_config, refused_in_one_line

QWEN3_VL_8B = ROOT / "manifests/qwen3-vl-8b-vllm-tp2.yaml"


def _qwen2_vl(h: int, i: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> dict:
    """A published Qwen2-VL config.json (transformers 4.45 layout: text keys at the top)."""
    return {
        "model_type": "qwen2_vl",
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": tied,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": h,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
    }


def _qwen3_vl(
    h: int, i: int, layers: int, heads: int, tied: bool, vision: tuple[int, int, int, list[int]]
) -> dict:
    """A published Qwen3-VL config.json (transformers 4.57 layout: nested sections)."""
    return qwen3_vl_config("qwen3_vl", h, i, layers, heads, 8, tied, vision, h)


SMALL_TOWER = (24, 1024, 4096, [5, 11, 17])  # Qwen3-VL-2B / 4B
LARGE_TOWER = (27, 1152, 4304, [8, 16, 24])  # Qwen3-VL-8B / 32B


@pytest.mark.parametrize(
    ("config", "published"),
    [
        (_qwen2_vl(1536, 8960, 28, 12, 2, 151936, True), 2_208_985_600),
        (_qwen2_vl(3584, 18944, 28, 28, 4, 152064, False), 8_291_375_616),
        (_qwen2_vl(8192, 29568, 80, 64, 8, 152064, False), 73_405_560_320),
        (_qwen3_vl(2048, 6144, 28, 16, True, SMALL_TOWER), 2_127_532_032),
        (_qwen3_vl(2560, 9728, 36, 32, True, SMALL_TOWER), 4_437_815_808),
        (_qwen3_vl(4096, 12288, 36, 32, False, LARGE_TOWER), 8_767_123_696),
        (_qwen3_vl(5120, 25600, 64, 64, False, LARGE_TOWER), 33_357_390_064),
    ],
    ids=[
        *(f"qwen2-vl-{s}" for s in ("2b", "7b", "72b")),
        *(f"qwen3-vl-{s}" for s in ("2b", "4b", "8b", "32b")),
    ],
)
def test_inventory_is_the_published_count(config: dict, published: int) -> None:
    model = from_config(config)
    assert model.parameters == published
    assert {t.dtype for t in model.tensors} == {"BF16"}


def test_qwen3_vl_8b_closed_form_and_tensor_count() -> None:
    """The 8B by hand: Qwen3-8B's text model (its own 8,190,735,360) plus the tower, in 750
    tensors, 17,534,247,392 bytes: the Hub's figures."""
    h, i, layers, v, q, kv, hd = 4096, 12288, 36, 151936, 4096, 1024, 128
    text = 2 * v * h + h + layers * (2 * q * h + 2 * kv * h + 3 * h * i + 2 * h + 2 * hd)
    hv, iv, depth, merged = 1152, 4304, 27, 1152 * 4
    block = 4 * hv + 3 * hv * hv + 3 * hv + hv * hv + hv + 2 * iv * hv + iv + hv
    merger = merged * merged + merged + h * merged + h
    tower = hv * 3 * 2 * 16 * 16 + hv + 2304 * hv + depth * block
    tower += (2 * hv + merger) + 3 * (2 * merged + merger)
    model = from_config(yaml.safe_load(QWEN3_VL_8B.read_text())["model"])
    assert text == 8_190_735_360 and tower == 576_388_336
    assert model.parameters == text + tower == 8_767_123_696
    assert len(model.tensors) == 750
    assert sum(t.nbytes for t in model.tensors) == 17_534_247_392


def test_qwen2_vl_qkv_is_one_contiguous_slice_as_vllm_loads_it() -> None:
    """vLLM's Qwen2VisionAttention.qkv is a ColumnParallelLinear over the fused 3·1280 rows:
    tp rank 1 of 4 holds rows 960..1920 (the last of q and the first of k), not a quarter of
    each of q, k and v as Qwen2.5-VL's QKVParallelLinear; fc1 / mlp.0 colwise, proj / fc2 /
    mlp.2 rowwise with whole biases, LayerNorms whole, the tower on the first stage."""
    layout = build_layout(from_config(_qwen2_vl(3584, 18944, 28, 28, 4, 152064, False)),
                          Mesh(tp=4, pp=2))  # fmt: skip
    shards = {s.fqn: s for s in layout.ranks[1].shards}
    b = "visual.blocks.31"
    qkv = shards[f"{b}.attn.qkv.weight"]
    assert qkv.local_shape == (960, 1280)
    assert [(p.offsets, p.sizes) for p in qkv.pieces] == [((960, 0), (960, 1280))]
    assert [p.offsets for p in shards[f"{b}.attn.qkv.bias"].pieces] == [(960,)]
    assert shards[f"{b}.attn.proj.weight"].local_shape == (1280, 320)
    assert shards[f"{b}.attn.proj.bias"].local_shape == (1280,)
    assert shards[f"{b}.mlp.fc1.weight"].local_shape == (1280, 1280)
    assert shards[f"{b}.mlp.fc1.bias"].local_shape == (1280,)
    assert shards[f"{b}.mlp.fc2.weight"].local_shape == (1280, 1280)
    assert shards[f"{b}.mlp.fc2.bias"].local_shape == (1280,)
    assert shards[f"{b}.norm1.bias"].local_shape == (1280,)
    assert shards["visual.merger.ln_q.bias"].local_shape == (1280,)
    assert shards["visual.merger.mlp.0.weight"].local_shape == (1280, 5120)
    assert shards["visual.merger.mlp.2.weight"].local_shape == (3584, 1280)
    assert shards["visual.merger.mlp.2.bias"].local_shape == (3584,)
    assert shards["visual.patch_embed.proj.weight"].local_shape == (1280, 3, 2, 14, 14)
    assert shards["model.layers.0.self_attn.q_proj.weight"].local_shape == (896, 3584)
    last = {s.fqn for s in layout.ranks[4 + 1].shards}  # stage 1: no tower
    assert not any(n.startswith("visual.") for n in last)


def test_qwen3_vl_tower_and_deepstack_placed_as_vllm() -> None:
    """QKVParallelLinear qkv (a quarter of each of q, k, v at tp 4), linear_fc1 colwise,
    linear_fc2 rowwise with whole biases; the merger and each DeepStack merger column then row
    parallel, their norms whole (the merger's over 1,152, the DeepStack ones' over the merged
    4,608); patch convolution and position table whole; the tower on the first stage only,
    the text under model.language_model.* with qwen3's placement."""
    model = from_config(yaml.safe_load(QWEN3_VL_8B.read_text())["model"])
    layout = build_layout(model, Mesh(tp=4, pp=2))
    shards = {s.fqn: s for s in layout.ranks[1].shards}
    v = "model.visual"
    qkv = shards[f"{v}.blocks.26.attn.qkv.weight"]
    assert qkv.local_shape == (3 * 288, 1152)
    assert [p.offsets[0] for p in qkv.pieces] == [288, 1152 + 288, 2304 + 288]
    assert shards[f"{v}.blocks.26.attn.proj.weight"].local_shape == (1152, 288)
    assert shards[f"{v}.blocks.26.mlp.linear_fc1.weight"].local_shape == (1076, 1152)
    assert shards[f"{v}.blocks.26.mlp.linear_fc2.weight"].local_shape == (1152, 1076)
    assert shards[f"{v}.blocks.26.mlp.linear_fc2.bias"].local_shape == (1152,)
    for m, norm in (("merger", 1152), *((f"deepstack_merger_list.{k}", 4608) for k in range(3))):
        assert shards[f"{v}.{m}.norm.weight"].local_shape == (norm,), m
        assert shards[f"{v}.{m}.linear_fc1.weight"].local_shape == (1152, 4608), m
        assert shards[f"{v}.{m}.linear_fc1.bias"].local_shape == (1152,), m
        assert shards[f"{v}.{m}.linear_fc2.weight"].local_shape == (4096, 1152), m
        assert shards[f"{v}.{m}.linear_fc2.bias"].local_shape == (4096,), m
    assert shards[f"{v}.pos_embed.weight"].local_shape == (2304, 1152)
    assert shards[f"{v}.patch_embed.proj.bias"].local_shape == (1152,)
    lm = "model.language_model"
    assert shards[f"{lm}.layers.0.self_attn.q_proj.weight"].local_shape == (1024, 4096)
    assert shards[f"{lm}.layers.0.self_attn.k_proj.weight"].local_shape == (256, 4096)
    assert shards[f"{lm}.layers.0.self_attn.q_norm.weight"].local_shape == (128,)
    assert shards[f"{lm}.embed_tokens.weight"].local_shape == (151936 // 4, 4096)
    last = {s.fqn: s for s in layout.ranks[4 + 1].shards}  # stage 1: the head, no tower
    assert not any(n.startswith(f"{v}.") for n in last)
    assert last["lm_head.weight"].local_shape == (151936 // 4, 4096)
    assert f"{lm}.layers.35.mlp.down_proj.weight" in last


def test_largest_image_as_vllm_profiles_it(tmp_path: Path) -> None:
    """Qwen3-VL: smart_resize under size.longest_edge 16,777,216 at a multiple of 32: 4,096²
    pixels, 128 × 128 merged embeddings, held through the profile in BF16 at the width vLLM's
    encoder returns them, the merger's and three DeepStack mergers' outputs side by side
    (4 × 4,096); and vLLM's three DeepStack input buffers of max_num_batched_tokens (8,192)
    × 4,096, made with the model on every rank. Qwen2-VL: max_pixels 12,845,056 at a multiple
    of 28, the same 16,384 at the text width."""
    family = family_for("qwen3_vl")
    assert family.image_tokens is not None
    config: dict[str, Any] = yaml.safe_load(QWEN3_VL_8B.read_text())["model"]
    assert family.image_tokens(config) == 128 * 128 == 16384
    qwen2 = family_for("qwen2_vl")
    assert qwen2.image_tokens is not None
    assert qwen2.image_tokens(_qwen2_vl(3584, 18944, 28, 28, 4, 152064, False)) == 16384
    doc = plan_json(tmp_path, QWEN3_VL_8B.read_text())
    assert doc["model"]["parameters"] == 8_767_123_696
    stage = doc["memory_model"]["detail_per_stage"][0]
    assert stage["activations.profile_tokens"] == 8192
    assert stage["activations.encoder_cache"] == 16384 * (1 + 3) * 4096 * 2
    assert stage["overhead.model_buffers"] == 3 * 8192 * 4096 * 2
    # 36 layers x K and V x 4 KV heads per rank x 128 x BF16
    assert doc["kv_cache"]["bytes_per_token_per_rank"] == [36 * 2 * 4 * 128 * 2]


def test_qwen2_vl_refuses_a_merger_wider_than_the_text(tmp_path: Path) -> None:
    cfg = _qwen2_vl(3584, 18944, 28, 28, 4, 152064, False)
    cfg["vision_config"] = {**cfg["vision_config"], "hidden_size": 4096}
    refused_in_one_line(tmp_path, cfg, "vision hidden_size 4096 is not the text hidden_size")


def test_qwen3_vl_refuses_bad_tower_configs(tmp_path: Path) -> None:
    cfg = _qwen3_vl(4096, 12288, 36, 32, False, LARGE_TOWER)
    cfg["vision_config"] = {**cfg["vision_config"], "out_hidden_size": 3584}
    refused_in_one_line(
        tmp_path, cfg, "vision out_hidden_size 3584 is not the text hidden_size 4096"
    )
    cfg["vision_config"] = {**cfg["vision_config"], "out_hidden_size": 4096,
                            "deepstack_visual_indexes": [8, 16, 27]}  # fmt: skip
    refused_in_one_line(tmp_path, cfg, "'deepstack_visual_indexes': expected a list of block")
