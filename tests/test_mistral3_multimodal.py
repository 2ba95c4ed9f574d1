"""The multimodal Mistral-3 (``mistral3``, shardctl/archs/mistral3.py): placement of its Pixtral
tower, its tie rule, and ``plan`` against vLLM 0.19's start-up logs of Mistral-Small-3.1-24B.

Source of the rows: llm-d-incubation/llm-d-planner, ``accuracy/results/v0.19.0/logs/`` (commit
d3121e059da88662db39a926a3ead964be97359b), ``vllm serve`` on H100 (79.19 GiB) at
``--gpu-memory-utilization 0.95 --max-model-len 8192``:

- ``mistralai-mistral-small---h100-80gb--tp1pp1dp1--8192.log`` (Mistral-Small-3.1-24B-Instruct-
  2503, bf16): "Model loading took 44.76 GiB", "torch peak memory increase: 2.03GiB",
  "GPU KV cache size: 184,752 tokens";
- ``w8a8-mistral-small-24b--h100-80gb--tp1pp1dp1--8192.log`` (RedHatAI's ``-quantized.w8a8``:
  int8 weights with a scale per output channel; tower, projector and head 16-bit): 24.07 GiB,
  2.18GiB, 319,344 tokens;
- ``...--tp2pp1dp1--8192.log``: 12.11 GiB per rank, 2.03GiB, 773,584 tokens.

Held out: nothing was fitted to them. Before the family these configs were refused (exit 3).
Each log says "Encoder cache will be initialized with a budget of 8192 tokens, and profiled
with 2 image items of the maximum feature size": ⌊8,192 / 3,025⌋ = 2 (``_image_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardctl.archs import family_for
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._cli import ROOT
from tests._models import CONFIGS, make_checkpoint
from tests._multimodal import plan_json, rank_shapes, refused_in_one_line

GIB = 2**30
MANIFEST = (ROOT / "manifests/mistral-small-3.1-24b-vllm-tp1.yaml").read_text()
W8A8 = MANIFEST.replace("mesh: {tp: 1}", "mesh: {tp: 1}\nquantization: {method: int8}")
# The release's own way to say it: its compressed-tensors quantization_config (llm-compressor's
# W8A8 scheme; the log: "Using scheme: CompressedTensorsW8A8Int8" for the 160 language-model
# linears only), so the stored tensors (I8, a bf16 scale per row) are what is priced.
STORED = """  quantization_config:
    quant_method: compressed-tensors
    format: int-quantized
    ignore: [language_model.lm_head, "re:vision_tower.*", "re:multi_modal_projector.*"]
    config_groups:
      group_0:
        targets: [Linear]
        weights: {num_bits: 8, type: int, strategy: channel, symmetric: true, dynamic: false}
        input_activations: {num_bits: 8, type: int, strategy: token, dynamic: true}
"""
W8A8_STORED = MANIFEST.replace("  text_config:\n", STORED + "  text_config:\n", 1)
# the published text model: hidden, q width, kv width, intermediate, layers
H, Q, KV, FF, L = 5120, 32 * 128, 8 * 128, 32768, 40


@pytest.mark.parametrize(
    ("manifest", "tp", "loaded", "peak", "logged"),
    [
        (MANIFEST, 1, 44.76, 2.03, 184_752),
        (W8A8, 1, 24.07, 2.18, 319_344),
        (W8A8, 2, 12.11, 2.03, 773_584),
        (W8A8_STORED, 1, 24.07, 2.18, 319_344),
        (W8A8_STORED, 2, 12.11, 2.03, 773_584),
    ],
    ids=["bf16-tp1", "w8a8-tp1", "w8a8-tp2", "stored-w8a8-tp1", "stored-w8a8-tp2"],
)
def test_published_mistral_small_rows(
    tmp_path: Path, manifest: str, tp: int, loaded: float, peak: float, logged: int
) -> None:
    doc = plan_json(tmp_path, manifest, "--tp", str(tp))
    rank = doc["ranks"][0]["memory"]
    # vLLM's "Model loading took" counts the weights and the rotary table (a buffer)
    table = doc["memory_model"]["detail_per_stage"][0]["overhead.rotary_cache"]
    assert abs((rank["weights"] + table) / GIB - loaded) <= 0.01 * loaded
    assert abs(rank["activations"] / GIB - peak) <= 0.2
    tokens = doc["kv_cache"]["capacity_tokens_per_rank"]
    assert abs(tokens - logged) <= 0.01 * logged, f"{tokens} vs {logged}"


def test_image_item_and_encoder_outputs(tmp_path: Path) -> None:
    family = family_for("mistral3")
    assert family.image_tokens is not None
    config = json.loads(json.dumps(_model(MANIFEST)))
    # 1,540-pixel images, 14-pixel patches merged 2 x 2: 55 x 55 embeddings
    assert family.image_tokens(config) == 55 * 55
    doc = plan_json(tmp_path, MANIFEST)
    stage = doc["memory_model"]["detail_per_stage"][0]
    # two items fit the 8,192-token budget, 5,120 wide, bf16
    assert stage["activations.encoder_cache"] == 2 * 3025 * H * 2


def test_int8_quantizes_the_text_linears_only(tmp_path: Path) -> None:
    """``quantization: {method: int8}`` stores the language model's projections in int8 with an
    fp32 scale per output row; the tower, the projector and ``language_model.lm_head`` stay
    bf16 (as the published w8a8 release keeps them), so the difference from the bf16 plan is
    exactly the text linears' saving."""
    bf16 = plan_json(tmp_path, MANIFEST)["ranks"][0]["memory"]["weights"]
    int8 = plan_json(tmp_path, W8A8)["ranks"][0]["memory"]["weights"]
    rows = L * (Q + 2 * KV + H + 2 * FF + H)  # q, k, v, o, gate, up, down out-features
    n = L * (H * (Q + 2 * KV) + Q * H + 3 * H * FF)
    assert bf16 - int8 == 2 * n - (n + 4 * rows)
    # the release's config: the same tensors, its scales bf16 (2 bytes per row, not 4)
    stored = plan_json(tmp_path, W8A8_STORED)["ranks"][0]["memory"]["weights"]
    assert bf16 - stored == 2 * n - (n + 2 * rows)


def _model(text: str) -> dict[str, Any]:
    import yaml

    model: dict[str, Any] = yaml.safe_load(text)["model"]
    return model


def test_tower_is_split_like_vllms_pixtral(tmp_path: Path) -> None:
    src = make_checkpoint("mistral3", tmp_path / "src")
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    v, t = CONFIGS["mistral3"]["vision_config"], CONFIGS["mistral3"]["text_config"]
    hv, iv, h = v["hidden_size"], v["intermediate_size"], t["hidden_size"]
    layer = "vision_tower.transformer.layers.0"
    want = {
        f"{layer}.attention.q_proj.weight": (hv // 2, hv),  # QKVParallelLinear
        f"{layer}.attention.o_proj.weight": (hv, hv // 2),  # RowParallelLinear
        f"{layer}.feed_forward.gate_proj.weight": (iv // 2, hv),  # MergedColumnParallelLinear
        f"{layer}.feed_forward.down_proj.weight": (hv, iv // 2),
        f"{layer}.attention_norm.weight": (hv,),
        "vision_tower.patch_conv.weight": (hv, 3, 14, 14),  # nn.Conv2d, whole
        "multi_modal_projector.patch_merger.merging_layer.weight": (hv, 4 * hv),  # nn.Linear
        "multi_modal_projector.linear_1.weight": (h // 2, hv),  # ColumnParallelLinear
        "multi_modal_projector.linear_2.weight": (h, h // 2),  # RowParallelLinear
        "language_model.lm_head.weight": (t["vocab_size"] // 2, h),  # its own, vocab split
    }
    for rank in (0, 1):
        shapes = rank_shapes(split, rank)
        assert {k: shapes[k] for k in want} == want
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"]


def test_tower_sits_on_the_first_stage(tmp_path: Path) -> None:
    src = make_checkpoint("mistral3", tmp_path / "src")
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(pp=2))
    first, last = rank_shapes(split, 0), rank_shapes(split, 1)
    tower = {k for k in first | last if k.startswith(("vision_tower.", "multi_modal_projector."))}
    assert tower and tower <= set(first) and not tower & set(last)
    assert "language_model.lm_head.weight" in last and "language_model.lm_head.weight" not in first


def test_a_new_transformers_config_ties_as_transformers_does(tmp_path: Path) -> None:
    """transformers 5.24 writes a new Mistral3Config with ``tie_word_embeddings: true`` at the
    top beside the text section's ``false``, and saves no head: shardctl reads the same tie
    (the inventory from config.json alone equals the file's), and the forward level passes."""
    from shardctl.model.inventory import from_checkpoint, from_config_file

    src = make_checkpoint("mistral3", tmp_path / "src", tie_word_embeddings=True)
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["text_config"]["tie_word_embeddings"] is False
    names = {t.fqn for t in from_checkpoint(src).tensors}
    assert "language_model.lm_head.weight" not in names
    assert {t.fqn for t in from_config_file(src / "config.json").tensors} == names
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"model_type": "mistral3", "text_config": [1, 2]}, "'text_config': expected an object"),
        ({"model_type": "mistral3", "vision_config": {"patch_size": 0}}, "'patch_size'"),
        ({"model_type": "mistral3", "vision_feature_layer": "last"}, "'vision_feature_layer'"),
        ({"model_type": "mistral3", "spatial_merge_size": -2}, "'spatial_merge_size'"),
    ],
)
def test_bad_mistral3_config_is_one_line(tmp_path: Path, config: dict[str, Any], says: str) -> None:
    refused_in_one_line(tmp_path, config, says)


@pytest.mark.parametrize("name", ["mistral3", "gemma3", "llama4", "llava_next", "llava"])
def test_towers_cover_every_tensor_beside_the_language_model(name: str) -> None:
    """``Family.towers`` (kept as stored under ``quantization.method``) names exactly the
    tensors outside ``language_model.``, in each multimodal family's inventory."""
    from fnmatch import fnmatchcase

    from shardctl.model.archs import tensors_from_config

    family = family_for(name)
    names = [t.fqn for t in tensors_from_config(CONFIGS[name], "BF16")]
    kept = {n for n in names if any(fnmatchcase(n, g) for g in family.towers)}
    assert kept == {n for n in names if not n.startswith("language_model.")}
    assert kept


def test_feature_layers_listed_inline(tmp_path: Path) -> None:
    """``vision_feature_layer`` as a YAML list in an inline manifest (read as a tuple): the
    projector's linear_1 takes both layers' outputs, one more [5,120 x 1,024] of bf16."""
    one = plan_json(tmp_path, MANIFEST)["ranks"][0]["memory"]["weights"]
    text = MANIFEST.replace("vision_feature_layer: -1", "vision_feature_layer: [-1, -2]")
    two = plan_json(tmp_path, text)["ranks"][0]["memory"]["weights"]
    assert two - one == H * 1024 * 2
