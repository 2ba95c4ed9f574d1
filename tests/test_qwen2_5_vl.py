"""Qwen2.5-VL (``qwen2_5_vl``, shardctl/archs/qwen2_5_vl.py) at its published sizes: the
inventory of Qwen/Qwen2.5-VL-7B-Instruct's config (manifests/qwen2.5-vl-7b-vllm-tp2.yaml, its
transformers-4.49 layout with the text keys at the top), the ViT placed as vLLM's, the largest
image vLLM profiles, and the same inventory from transformers 5's nested ``text_config``. The
end-to-end flow (save_pretrained checkpoint, reshard, verify's three levels against
Qwen2_5_VLForConditionalGeneration's logits, merge) is tests/test_families.py's.

Figures: the Hub page of Qwen/Qwen2.5-VL-7B-Instruct shows 8.29B parameters; the closed form
below gives 8,292,166,656, of which the tower and merger 676,550,144.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shardctl.archs import family_for
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from tests._cli import ROOT
from tests._multimodal import plan_json, refused_in_one_line

MANIFEST = ROOT / "manifests/qwen2.5-vl-7b-vllm-tp2.yaml"


def _published() -> dict[str, Any]:
    model: dict[str, Any] = yaml.safe_load(MANIFEST.read_text())["model"]
    return model


def test_inventory_counts_the_published_shapes() -> None:
    h, i, layers, v, q, kv = 3584, 18944, 28, 152064, 3584, 512
    text = 2 * v * h + h + layers * (2 * q * h + 2 * kv * h + q + 2 * kv + 3 * h * i + 2 * h)
    hv, iv, depth, merged = 1280, 3420, 32, 1280 * 4
    block = 2 * hv + 3 * hv * hv + 3 * hv + hv * hv + hv + 2 * (iv * hv + iv) + hv * iv + hv
    tower = hv * 3 * 2 * 14 * 14 + depth * block + hv + merged * merged + merged
    tower += h * merged + h
    model = from_config(_published())
    assert tower == 676_550_144
    assert model.parameters == text + tower == 8_292_166_656
    assert {t.dtype for t in model.tensors} == {"BF16"}


def test_nested_text_config_reads_the_same() -> None:
    """transformers 5 writes the text keys under ``text_config``: the same tensors."""
    flat = _published()
    vision = flat.pop("vision_config")
    text = {k: flat.pop(k) for k in list(flat) if k not in ("model_type", "architectures")}
    tie = text.pop("tie_word_embeddings")
    nested = {**flat, "tie_word_embeddings": tie, "text_config": text, "vision_config": vision}
    assert from_config(nested).tensors == from_config(_published()).tensors


def test_tower_placed_as_vllm_at_tp4_pp2() -> None:
    """The fused qkv splits as three equal parts by heads (4 of 16 per rank), proj and down
    row-parallel with whole biases, gate/up and the merger's first linear column-parallel, its
    second row-parallel; norms and the patch convolution whole; all on the first stage."""
    layout = build_layout(from_config(_published()), Mesh(tp=4, pp=2))
    rank = 1  # stage 0, tp rank 1
    shards = {s.fqn: s for s in layout.ranks[rank].shards}
    b = "visual.blocks.31"
    qkv = shards[f"{b}.attn.qkv.weight"]
    assert qkv.local_shape == (3 * 320, 1280)
    assert [p.offsets[0] for p in qkv.pieces] == [320, 1280 + 320, 2560 + 320]
    assert shards[f"{b}.attn.qkv.bias"].local_shape == (960,)
    assert shards[f"{b}.attn.proj.weight"].local_shape == (1280, 320)
    assert shards[f"{b}.attn.proj.bias"].local_shape == (1280,)
    assert shards[f"{b}.mlp.gate_proj.weight"].local_shape == (855, 1280)
    assert shards[f"{b}.mlp.up_proj.bias"].local_shape == (855,)
    assert shards[f"{b}.mlp.down_proj.weight"].local_shape == (1280, 855)
    assert shards[f"{b}.mlp.down_proj.bias"].local_shape == (1280,)
    assert shards[f"{b}.norm1.weight"].local_shape == (1280,)
    assert shards["visual.merger.mlp.0.weight"].local_shape == (1280, 5120)
    assert shards["visual.merger.mlp.2.weight"].local_shape == (3584, 1280)
    assert shards["visual.merger.mlp.2.bias"].local_shape == (3584,)
    assert shards["visual.patch_embed.proj.weight"].local_shape == (1280, 3, 2, 14, 14)
    assert shards["model.layers.0.self_attn.q_proj.weight"].local_shape == (896, 3584)
    last = {s.fqn for s in layout.ranks[4 + rank].shards}  # stage 1: no tower
    assert not any(n.startswith("visual.") for n in last)


def test_largest_image_as_vllm_profiles_it(tmp_path: Path) -> None:
    """smart_resize under max_pixels 12,845,056 at a multiple of 28: 3,584 x 3,584 pixels,
    128 x 128 merged embeddings; one such item fills the encoder budget (max of 8,192 batched
    tokens and one item), held through the profile at the text width in BF16."""
    family = family_for("qwen2_5_vl")
    assert family.image_tokens is not None
    assert family.image_tokens(_published()) == 128 * 128 == 16384
    doc = plan_json(tmp_path, MANIFEST.read_text())
    stage = doc["memory_model"]["detail_per_stage"][0]
    assert stage["activations.encoder_cache"] == 16384 * 3584 * 2
    # 28 layers x K and V x 2 KV heads per rank x 128 x BF16
    assert doc["kv_cache"]["bytes_per_token_per_rank"] == [28 * 2 * 2 * 128 * 2]


def test_merger_width_must_be_the_text_width(tmp_path: Path) -> None:
    cfg = _published()
    cfg["vision_config"] = {**cfg["vision_config"], "out_hidden_size": 4096}
    refused_in_one_line(tmp_path, cfg, "vision out_hidden_size 4096 is not the text hidden_size")
