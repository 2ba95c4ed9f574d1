"""LLaVA-1.5 (``llava``) and LLaVA-NeXT (``llava_next``) (shardctl/archs/llava_next.py): the text
model a config names, the CLIP / SigLIP tower placed as vLLM's, the anyres image size, and
``plan`` against vLLM 0.19's start-up log of IBM's granite-vision-3.3-2b.

Source of the row: llm-d-incubation/llm-d-planner, ``accuracy/results/v0.19.0/logs/
ibm-granite-granite-visi--h100-80gb--tp1pp1dp1--8192.log`` (commit
d3121e059da88662db39a926a3ead964be97359b), ``vllm serve ibm-granite/granite-vision-3.3-2b`` on
H100 at ``--gpu-memory-utilization 0.95 --max-model-len 8192``: "Model loading took 5.54 GiB",
"torch peak memory increase: 0.79GiB", "Encoder cache will be initialized with a budget of 8289
tokens, and profiled with 1 image items", "GPU KV cache size: 899,792 tokens". Held out: nothing
was fitted to it. Before the family the config was refused (exit 3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardctl.archs import family_for, language_model
from shardctl.archs._multimodal import TEXT_DEFAULTS
from shardctl.archs.llava_next import VISION_ABSENT, VISION_DEFAULTS
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._cli import ROOT
from tests._models import CONFIGS, make_checkpoint
from tests._multimodal import plan_json, rank_shapes, refused_in_one_line

GIB = 2**30
MANIFEST = (ROOT / "manifests/granite-vision-3.3-2b-vllm-tp1.yaml").read_text()


def _model(text: str) -> dict[str, Any]:
    import yaml

    model: dict[str, Any] = yaml.safe_load(text)["model"]
    return model


def test_granite_vision_row(tmp_path: Path) -> None:
    doc = plan_json(tmp_path, MANIFEST)
    rank = doc["ranks"][0]["memory"]
    stage = doc["memory_model"]["detail_per_stage"][0]
    # vLLM's "Model loading took" counts the weights and the rotary table (a buffer)
    assert abs((rank["weights"] + stage["overhead.rotary_cache"]) / GIB - 5.54) <= 0.01 * 5.54
    assert abs(rank["activations"] / GIB - 0.79) <= 0.1
    # one image of 8,289 embeddings (the budget the log reports), 2,048 wide, bf16
    assert stage["activations.encoder_cache"] == 8289 * 2048 * 2
    tokens = doc["kv_cache"]["capacity_tokens_per_rank"]
    assert abs(tokens - 899_792) <= 0.01 * 899_792, tokens


def test_largest_image_as_vllm_counts_it() -> None:
    family = family_for("llava_next")
    assert family.image_tokens is not None
    # granite-vision: the 10-tile column (3,840 x 384): 270 x 27 + 270 newlines + 729 base
    assert family.image_tokens(_model(MANIFEST)) == 270 * 27 + 270 + 729 == 8289
    # LLaVA-NeXT's defaults (CLIP-L/336, five pinpoints, "default" drops the class token):
    # 672 x 672 is 48 x 48 + 48 newlines + 576
    assert family.image_tokens({"model_type": "llava_next"}) == 48 * 48 + 48 + 576 == 2928
    # LLaVA-1.5: the one 336-pixel tile
    assert family_for("llava").image_tokens is not None
    assert family.image_tokens({"model_type": "llava"}) == 576
    # a wide image whose best pinpoint pads rows: 2 x 1 tiles of 24 patches for 1008 x 336
    # holds a 1008-wide, 336-high image in 72 x 24 after unpadding, + 72 newlines + 576
    cfg = {"model_type": "llava_next", "image_grid_pinpoints": [[336, 1008]]}
    assert family.image_tokens(cfg) == 24 * 72 + 24 + 576


def test_defaults_are_transformers(tmp_path: Path) -> None:
    """The default tables equal transformers 5.24's config classes, and a diff-only section
    (as transformers 4 saved llava-v1.6-mistral-7b-hf's) gets them."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "granite": transformers.GraniteConfig,
        "qwen2": transformers.Qwen2Config,
    }
    for kind, table in TEXT_DEFAULTS.items():
        default = classes[kind]()
        assert {k: getattr(default, k) for k in table} == table, kind
    for kind, cls in (
        ("clip_vision_model", transformers.CLIPVisionConfig),
        ("siglip_vision_model", transformers.SiglipVisionConfig),
    ):
        default = cls()
        assert {k: getattr(default, k) for k in VISION_DEFAULTS[kind]} == VISION_DEFAULTS[kind]
    built = transformers.LlavaNextConfig().vision_config
    assert {k: getattr(built, k) for k in VISION_ABSENT} == VISION_ABSENT
    kind, text = language_model(
        "llava_next", {"text_config": {"model_type": "mistral", "vocab_size": 32064}}
    )
    assert kind == "mistral" and text["hidden_size"] == 4096 and text["sliding_window"] == 4096
    assert text["num_key_value_heads"] == 8 and text["vocab_size"] == 32064


@pytest.mark.parametrize("hub_names", [False, True], ids=["save_pretrained", "hub"])
def test_siglip_tower_is_split_like_vllms(tmp_path: Path, hub_names: bool) -> None:
    src = make_checkpoint("llava_next", tmp_path / "src")
    if hub_names:  # the published files' ``vision_tower.vision_model.*``
        from safetensors.torch import load_file, save_file

        tensors = load_file(src / "model.safetensors")
        renamed = {
            k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
            for k, v in tensors.items()
        }
        save_file(renamed, src / "model.safetensors", metadata={"format": "pt"})
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    v, t = CONFIGS["llava_next"]["vision_config"], CONFIGS["llava_next"]["text_config"]
    hv, iv, h = v["hidden_size"], v["intermediate_size"], t["hidden_size"]
    tower = "vision_tower.vision_model" if hub_names else "vision_tower"
    layer = f"{tower}.encoder.layers.0"
    want = {
        f"{layer}.self_attn.q_proj.weight": (hv // 2, hv),  # QKVParallelLinear
        f"{layer}.self_attn.q_proj.bias": (hv // 2,),
        f"{layer}.self_attn.out_proj.weight": (hv, hv // 2),  # RowParallelLinear
        f"{layer}.self_attn.out_proj.bias": (hv,),  # added once: whole
        f"{layer}.mlp.fc1.weight": (iv // 2, hv),  # ColumnParallelLinear
        f"{layer}.mlp.fc2.weight": (hv, iv // 2),  # RowParallelLinear
        f"{layer}.layer_norm1.weight": (hv,),
        f"{tower}.embeddings.position_embedding.weight": (4, hv),  # (28 / 14)², whole
        f"{tower}.head.attention.in_proj_weight": (3 * hv, hv),  # the unused pooling head
        "multi_modal_projector.linear_1.weight": (h // 2, 2 * hv),  # two feature layers
        "multi_modal_projector.linear_1.bias": (h // 2,),
        "multi_modal_projector.linear_2.weight": (h, h // 2),
        "multi_modal_projector.linear_2.bias": (h,),
        "image_newline": (h,),
        # tied at the top level: no lm_head, the embedding vocab-split
        "language_model.model.embed_tokens.weight": (t["vocab_size"] // 2, h),
    }
    for rank in (0, 1):
        shapes = rank_shapes(split, rank)
        assert {k: shapes[k] for k in want} == want
        assert "language_model.lm_head.weight" not in shapes
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"]


def test_clip_tower_and_first_stage(tmp_path: Path) -> None:
    src = make_checkpoint("llava", tmp_path / "src")
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(pp=2))
    first, last = rank_shapes(split, 0), rank_shapes(split, 1)
    tower = {k for k in first | last if not k.startswith("language_model.")}
    assert "vision_tower.embeddings.class_embedding" in tower
    assert "vision_tower.pre_layrnorm.weight" in tower and "image_newline" not in tower
    assert tower <= set(first) and not tower & set(last)
    assert "language_model.lm_head.weight" in last


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            {"model_type": "llava_next", "text_config": {"model_type": "phi3"}},
            "text_config model_type 'phi3'",
        ),
        (
            {"model_type": "llava", "vision_config": {"model_type": "pixtral"}},
            "vision_config model_type 'pixtral'",
        ),
        ({"model_type": "llava", "vision_feature_layer": "last"}, "'vision_feature_layer'"),
        (
            {"model_type": "llava_next", "image_grid_pinpoints": [[336]]},
            "'image_grid_pinpoints'",
        ),
        ({"model_type": "llava", "vision_config": {"patch_size": 0}}, "'patch_size'"),
        (
            {"model_type": "llava_next", "image_grid_pinpoints": [[100, 100]]},
            "smaller than one 336-pixel tile",
        ),
        (
            {"model_type": "llava_next", "vision_feature_select_strategy": "cls"},
            "'vision_feature_select_strategy'",
        ),
    ],
)
def test_bad_llava_config_is_one_line(tmp_path: Path, config: dict[str, Any], says: str) -> None:
    refused_in_one_line(tmp_path, config, says)


def test_a_mistral_text_model_keeps_its_window(tmp_path: Path) -> None:
    """LLaVA-1.6-Mistral with ``sliding_window`` set: the KV cache of a sequence past the window
    is the window's (the text family's rule, through ``language_model``)."""
    base = {
        "model_type": "llava_next",
        "text_config": {"model_type": "mistral", "sliding_window": 4096},
    }
    tail = (
        "mesh: {tp: 1}\nhardware: {gpu: h100-sxm}\n"
        "workload: {engine: hf, batch_size: 1, sequence_length: 16384}\n"
    )
    window = plan_json(tmp_path, f"model: {json.dumps(base)}\n{tail}")
    full = {**base, "text_config": {"model_type": "mistral", "sliding_window": None}}
    whole = plan_json(tmp_path, f"model: {json.dumps(full)}\n{tail}")
    kv = [d["ranks"][0]["memory"]["kv_cache"] for d in (window, whole)]
    assert kv[1] == 4 * kv[0]  # 16,384 tokens against a 4,096-token window
