"""The multimodal Gemma-3 (``gemma3``, shardctl/archs/gemma3_mm.py): placement of its SigLIP
tower under both namings, and ``plan`` against vLLM 0.19's start-up logs of the published
``-it`` checkpoints.

Source of the rows: llm-d-incubation/llm-d-planner, ``accuracy/results/v0.19.0/logs/``
(commit d3121e059da88662db39a926a3ead964be97359b), ``google-gemma-3-{4b,12b,27b}-it--h100-80gb--
tp1pp1dp1--8192.log``: ``vllm serve`` on one H100 (79.19 GiB) at ``--gpu-memory-utilization 0.95
--max-model-len 8192``. Held out: nothing was fitted to them. Before the multimodal family these
configs were refused; with the text config alone the 27B row was +18.5 % (every layer in one KV
group: the published text_config leaves ``sliding_window_pattern`` to Gemma3TextConfig's
default 6), then +4.9 % without the tower's weights and the encoder's profile outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from shardctl.archs import language_model
from shardctl.layout.types import Mesh
from shardctl.plan.memory.kv_layers import layer_windows
from shardctl.plan.memory.vllm import encoder_cache_bytes
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._cli import ROOT
from tests._models import CONFIGS, make_checkpoint
from tests._multimodal import plan_json, rank_shapes, refused_in_one_line

GIB = 2**30
# google/gemma-3-*-it config.json: the text_config as published (the rest are defaults)
TEXT_4B = "{hidden_size: 2560, intermediate_size: 10240, num_hidden_layers: 34}"
TEXT_12B = (
    "{hidden_size: 3840, intermediate_size: 15360, num_attention_heads: 16, "
    "num_hidden_layers: 48, num_key_value_heads: 8}"
)
MANIFEST = (ROOT / "manifests/gemma-3-27b-it-vllm-tp1.yaml").read_text()


def _manifest(text_config: str | None) -> str:
    """The bundled 27B-it manifest, its text_config swapped for a smaller model's."""
    if text_config is None:
        return MANIFEST
    start = MANIFEST.index("  text_config:\n")
    end = MANIFEST.index("  vision_config:\n")
    rope = "rope_scaling: {factor: 8.0, rope_type: linear}, sliding_window: 1024, "
    return MANIFEST[:start] + f"  text_config: {{{rope}{text_config[1:]}\n" + MANIFEST[end:]


@pytest.mark.parametrize(
    ("text_config", "loaded", "peak", "groups", "logged"),
    [
        # gemma-3-4b-it: "Model loading took 8.58 GiB", "torch peak memory increase: 3.89GiB",
        # "Add 1 padding layers", "GPU KV cache size: 468,144 tokens"
        (TEXT_4B, 8.58, 3.89, 7, 468_144),
        # gemma-3-12b-it: 23.31 GiB, 3.94GiB, no padding, 130,304 tokens
        (TEXT_12B, 23.31, 3.94, 6, 130_304),
        # gemma-3-27b-it: 51.45 GiB, 3.99GiB, "Add 8 padding layers", 36,560 tokens
        (None, 51.45, 3.99, 7, 36_560),
    ],
)
def test_published_gemma3_it_rows(
    tmp_path: Path, text_config: str | None, loaded: float, peak: float, groups: int, logged: int
) -> None:
    doc = plan_json(tmp_path, _manifest(text_config))
    rank = doc["ranks"][0]["memory"]
    # vLLM's "Model loading took" counts the weights and the rotary tables (buffers)
    table = doc["memory_model"]["detail_per_stage"][0]["overhead.rotary_cache"]
    assert abs((rank["weights"] + table) / GIB - loaded) <= 0.1
    assert abs(rank["activations"] / GIB - peak) <= 0.05
    units = doc["kv_cache"]["engine_units"]
    assert units["kv_cache_groups"] == groups
    tokens = doc["kv_cache"]["capacity_tokens_per_rank"]
    assert abs(tokens - logged) <= 0.01 * logged, f"{tokens} vs {logged}"


def test_encoder_outputs_are_held_through_the_profile(tmp_path: Path) -> None:
    # 32 images of 256 tokens (the 8,192-token budget), 5,376 wide, bf16: 84 MiB on every
    # stage (vLLM builds the tower on every pipeline rank and V1's profile_run profiles the
    # encoder there: tests/test_vllm_towers_pp.py), none for the text-only config
    doc = plan_json(tmp_path, MANIFEST.replace("mesh: {tp: 1}", "mesh: {pp: 2}"))
    first, last = doc["memory_model"]["detail_per_stage"]
    assert first["activations.encoder_cache"] == 32 * 256 * 5376 * 2 == 84 * 2**20
    assert last["activations.encoder_cache"] == first["activations.encoder_cache"]
    assert encoder_cache_bytes(budget_tokens=2048, item_tokens=4096, hidden=8, act_bytes=2) == (
        4096 * 8 * 2
    )  # one item larger than the budget: the budget grows to it (compute_encoder_budget)
    text = (ROOT / "manifests/gemma-3-27b-text-tp4.yaml").read_text()
    doc = plan_json(tmp_path, text + "  engine: vllm\n  vllm_version: '0.19'\n")
    assert all(
        "activations.encoder_cache" not in d for d in doc["memory_model"]["detail_per_stage"]
    )


def test_text_config_defaults_are_gemma3s() -> None:
    arch, text = language_model("gemma3", {"text_config": {"num_hidden_layers": 12}})
    assert arch == "gemma3_text"
    assert (text["vocab_size"], text["head_dim"], text["max_position_embeddings"]) == (
        262_208,
        256,
        131_072,
    )
    # no sliding_window_pattern in the config: Gemma3TextConfig's 6 (layers 5 and 11 global)
    windows = layer_windows(arch, {**text, "sliding_window": 1024}, 12)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11]


@pytest.mark.parametrize("hub_names", [False, True], ids=["save_pretrained", "hub"])
def test_tower_is_split_like_vllms_siglip(tmp_path: Path, hub_names: bool) -> None:
    """transformers 5 writes ``vision_tower.*``; the published files ``vision_tower.
    vision_model.*``. Both place as vLLM's siglip.py does at tp 2, and verify passes."""
    src = make_checkpoint("gemma3", tmp_path / "src")
    p = "vision_tower."
    if hub_names:
        state = load_file(str(src / "model.safetensors"))
        renamed = {
            (p + "vision_model." + k[len(p) :] if k.startswith(p) else k): v
            for k, v in state.items()
        }
        save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
        p = "vision_tower.vision_model."
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    hv = CONFIGS["gemma3"]["vision_config"]["hidden_size"]
    iv = CONFIGS["gemma3"]["vision_config"]["intermediate_size"]
    h = CONFIGS["gemma3"]["text_config"]["hidden_size"]
    layer = f"{p}encoder.layers.0"
    want = {
        f"{layer}.self_attn.q_proj.weight": (hv // 2, hv),  # QKVParallelLinear
        f"{layer}.self_attn.v_proj.bias": (hv // 2,),
        f"{layer}.self_attn.out_proj.weight": (hv, hv // 2),  # RowParallelLinear
        f"{layer}.self_attn.out_proj.bias": (hv,),
        f"{layer}.mlp.fc1.weight": (iv // 2, hv),  # ColumnParallelLinear
        f"{layer}.mlp.fc2.weight": (hv, iv // 2),
        f"{layer}.layer_norm1.weight": (hv,),
        f"{p}embeddings.position_embedding.weight": (16 // 2, hv),  # VocabParallelEmbedding
        f"{p}embeddings.patch_embedding.weight": (hv, 3, 14, 14),  # nn.Conv2d, whole
        "multi_modal_projector.mm_input_projection_weight": (hv, h),  # nn.Parameter, whole
        "language_model.model.layers.0.self_attn.q_proj.weight": (4 * 16 // 2, h),
    }
    for rank in (0, 1):
        shapes = rank_shapes(split, rank)
        assert {k: shapes[k] for k in want} == want
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"]


def test_tower_sits_on_the_first_stage(tmp_path: Path) -> None:
    src = make_checkpoint("gemma3", tmp_path / "src")
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(pp=2))
    first, last = rank_shapes(split, 0), rank_shapes(split, 1)
    tower = {k for k in first | last if k.startswith(("vision_tower.", "multi_modal_projector."))}
    assert tower and tower <= set(first) and not tower & set(last)
    # the decoder's layers 0-1 and 2-3 on their stages, the tied embedding on both
    assert "language_model.model.layers.1.mlp.up_proj.weight" in first
    assert "language_model.model.layers.2.mlp.up_proj.weight" in last
    assert "language_model.model.embed_tokens.weight" in first


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"model_type": "gemma3", "text_config": [1, 2]}, "'text_config': expected an object"),
        ({"model_type": "gemma3", "vision_config": {"patch_size": 0}}, "'patch_size'"),
        ({"model_type": "gemma3", "mm_tokens_per_image": "many"}, "'mm_tokens_per_image'"),
    ],
)
def test_bad_multimodal_config_is_one_line(
    tmp_path: Path, config: dict[str, Any], says: str
) -> None:
    refused_in_one_line(tmp_path, config, says)


def test_real_size_tower_per_rank_at_tp4(tmp_path: Path) -> None:
    """The published 27B at tp 4 (no engine: weights alone): each rank holds the text model's
    share (the text-only manifest's ranks) plus the SigLIP tower split as vLLM splits it,
    summed by hand from the published vision_config (1,152 wide, 4,304 MLP, 27 layers,
    896-pixel images of 14-pixel patches)."""
    hv, iv, n, tp = 1152, 4304, 27, 4
    layer = (
        3 * (hv * hv + hv) // tp  # q/k/v weights and biases, column-parallel
        + hv * hv // tp
        + hv  # out_proj: rows split, bias whole
        + (iv * hv + iv) // tp  # fc1, column-parallel
        + hv * iv // tp
        + hv  # fc2: split along its input, bias whole
        + 4 * hv  # layer_norm1 / 2
    )
    tower = (
        n * layer
        + hv * 3 * 14 * 14 + hv  # patch convolution, whole
        + (896 // 14) ** 2 * hv // tp  # position table, rows split
        + 2 * hv  # post_layernorm
        + hv * 5376 + hv  # projector weight and its norm, whole
    )  # fmt: skip
    mm = MANIFEST[: MANIFEST.index("mesh:")] + "mesh: {tp: 4}\nhardware: {gpu: h100-sxm}\n"
    text = (ROOT / "manifests/gemma-3-27b-text-tp4.yaml").read_text()
    text = text[: text.index("workload:")]
    multimodal, text_only = plan_json(tmp_path, mm), plan_json(tmp_path, text)
    assert len(multimodal["ranks"]) == len(text_only["ranks"]) == tp
    for a, b in zip(multimodal["ranks"], text_only["ranks"], strict=True):
        assert a["memory"]["weights"] - b["memory"]["weights"] == 2 * tower
