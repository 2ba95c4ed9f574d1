"""The flagship manifests as published: ``plan``'s weight bytes against the published checkpoints.

Figures and where they come from (all from the repositories' own metadata, quoted in public code
and documents found with the code search; none is derived here):

gpt-oss-120b (``manifests/gpt-oss-120b-mxfp4-h100.yaml``)
    ``model.safetensors.index.json`` ``metadata.total_size`` = **65,248,815,744** bytes,
    https://huggingface.co/openai/gpt-oss-120b/blob/b5c939de8f754692c1647ca79fbf85e8c1e70f8a/model.safetensors.index.json
    (quoted as the index's total_size, "65,248,815,744-byte transformed tensor map across 15
    shards", by several independent projects; one asserts ``tensor_bytes == 65248815744`` beside
    the 15 shard files' 65,248,893,184 bytes). The Hub's safetensors parameter count gives BF16
    2,167,371,072 elements (attention, router, embeddings, head, biases, sinks).

DeepSeek-V3 (``manifests/deepseek-v3-fp8-tp8-pp2.yaml``)
    The index's ``metadata.total_size`` is **1,369,062,772,000**, which is not a byte count of
    these FP8 files: it is 2 bytes × the checkpoint's 684,531,386,000 elements (the Hub's
    safetensors total for deepseek-ai/DeepSeek-V3: BF16 3,918,786,560 + F8_E4M3 680,571,043,840
    + F32 41,555,600). The files' real tensor data, summed from all 163 shard headers (91,991
    tensors, 11,888,393 bytes of header metadata) by a public header audit of
    https://huggingface.co/deepseek-ai/DeepSeek-V3 : **688,574,839,360** bytes (also quoted as
    "641.29 GiB estimated tensor payload (688,574,839,360 bytes; from safetensors dtype
    counts)"). plan equals the real bytes, and its element count reproduces total_size.

Llama-4-Scout-17B-16E-Instruct (``manifests/llama-4-scout-mm-tp8.yaml``)
    No published ``total_size`` figure was found (searched: the number itself, "total_size" near
    Scout's name, copies of its index). Published and checked instead: the Hub's safetensors
    parameter count, **108,641,793,536**, all BF16 (quoted for
    meta-llama/Llama-4-Scout-17B-16E-Instruct by several projects), and the 50 shard files'
    sizes at revision 14d516bdff6ac06cec40678529222f193386189c, **217,283,738,720** bytes
    (tensor data plus each file's 8-byte length and JSON header).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from shardctl.layout.engine import resolve
from shardctl.layout.types import LayoutOptions, Mesh
from shardctl.manifest import load_manifest
from shardctl.model.inventory import from_config
from shardctl.model.types import ModelInfo
from tests._cli import run_cli

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
GPT_OSS_TOTAL_SIZE = 65_248_815_744
DEEPSEEK_V3_TENSOR_BYTES = 688_574_839_360
DEEPSEEK_V3_INDEX_TOTAL_SIZE = 1_369_062_772_000
DEEPSEEK_V3_ELEMENTS = {"BF16": 3_918_786_560, "F8_E4M3": 680_571_043_840, "F32": 41_555_600}
SCOUT_PARAMETERS = 108_641_793_536
SCOUT_SHARD_FILE_BYTES = 217_283_738_720  # 50 files: data + 8-byte length + JSON header each


def _plan(manifest: str) -> dict:  # type: ignore[type-arg]
    done = run_cli("plan", str(MANIFESTS / manifest), "--json")
    assert done.returncode in (0, 1), done.stderr  # 1: does not fit, still a full plan
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _inventory(manifest: str) -> ModelInfo:
    return from_config(load_manifest(MANIFESTS / manifest).model.config_dict(), source="inline")


def _elements(model: ModelInfo) -> Counter[str]:
    out: Counter[str] = Counter()
    for t in model.tensors:
        n = 1
        for s in t.shape:
            n *= s
        out[t.dtype] += n
    return out


def test_gpt_oss_120b_plan_weights_equal_published_total_size() -> None:
    doc = _plan("gpt-oss-120b-mxfp4-h100.yaml")
    assert doc["model"]["weight_bytes"] == GPT_OSS_TOTAL_SIZE
    assert [r["memory"]["weights"] for r in doc["ranks"]] == [GPT_OSS_TOTAL_SIZE]  # tp 1
    model = _inventory("gpt-oss-120b-mxfp4-h100.yaml")
    assert _elements(model)["BF16"] == 2_167_371_072
    names = {t.fqn: t for t in model.tensors}
    blocks = names["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert (blocks.shape, blocks.dtype) == ((128, 5760, 90, 16), "U8")
    assert names["model.layers.35.mlp.experts.down_proj_scales"].shape == (128, 2880, 90)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names  # stored as blocks + scales


def test_deepseek_v3_plan_weights_equal_the_published_tensor_bytes() -> None:
    doc = _plan("deepseek-v3-fp8-tp8-pp2.yaml")
    assert doc["model"]["weight_bytes"] == DEEPSEEK_V3_TENSOR_BYTES
    # the index's total_size is 2 bytes per element, as if every tensor were BF16
    assert 2 * doc["model"]["parameters"] == DEEPSEEK_V3_INDEX_TOTAL_SIZE
    # 16 ranks (tp 8 × pp 2): every stage's 8 ranks together hold the model once
    assert len(doc["ranks"]) == 16
    model = _inventory("deepseek-v3-fp8-tp8-pp2.yaml")
    assert len(model.tensors) == 91_991
    assert dict(_elements(model)) == DEEPSEEK_V3_ELEMENTS
    names = {t.fqn: t for t in model.tensors}
    # the MTP layer's eh_proj stays BF16 (no scale); the router's correction bias is F32
    assert names["model.layers.61.eh_proj.weight"].dtype == "BF16"
    assert "model.layers.61.eh_proj.weight_scale_inv" not in names
    assert names["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    scale = names["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert (scale.shape, scale.dtype) == ((5, 56), "F32")  # ceil(576/128) × 7168/128


def test_llama4_scout_multimodal_plan_matches_published_counts() -> None:
    doc = _plan("llama-4-scout-mm-tp8.yaml")
    assert doc["model"]["architecture"] == "llama4"
    assert doc["model"]["parameters"] == SCOUT_PARAMETERS
    assert doc["model"]["weight_bytes"] == 2 * SCOUT_PARAMETERS  # every tensor BF16
    model = _inventory("llama-4-scout-mm-tp8.yaml")
    assert {t.dtype for t in model.tensors} == {"BF16"}
    # What the 50 files add to the tensor data: per file an 8-byte length and a JSON header of
    # one entry per tensor (name, dtype, shape, offsets: 60 to 200 bytes each).
    headers = SCOUT_SHARD_FILE_BYTES - doc["model"]["weight_bytes"]
    n = len(model.tensors)
    assert 50 * 8 + 60 * n < headers < 50 * 8 + 200 * n, (headers, n)
    # the text model alone is the llama4_text manifest's
    text = _plan("llama-4-scout-tp8.yaml")["model"]["weight_bytes"]
    vision = sum(t.nbytes for t in model.tensors if not t.fqn.startswith("language_model."))
    assert text + vision == doc["model"]["weight_bytes"]
    assert vision == 2 * (850_960_896 + 5120 * 4096)  # tower + adapter, projector


def test_llama4_vision_tower_sits_on_the_first_stage_only() -> None:
    """PP2 × TP2: vision tower and projector on stage 0 (vLLM merges image embeddings into the
    first stage's inputs); their ``layers.{i}`` are not decoder layers 0..33."""
    model = _inventory("llama-4-scout-mm-tp8.yaml")
    res = resolve(model, Mesh(pp=2, tp=2), options=LayoutOptions(pipeline="vllm"))
    on = {t.info.fqn: t.stages for t in res.tensors}
    vision = [f for f in on if not f.startswith("language_model.")]
    assert len(vision) == 553 + 1
    assert all(on[f] == (0,) for f in vision)
    assert on["language_model.model.layers.30.self_attn.q_proj.weight"] == (1,)
    assert on["language_model.model.layers.3.self_attn.q_proj.weight"] == (0,)
    assert on["language_model.lm_head.weight"] == (1,)
    placement = {t.info.fqn: t.placement for t in res.tensors}
    layer = "vision_model.model.layers.20"
    expect = {  # vLLM mllama4.py: QKV / fc1 column-parallel, o_proj / fc2 row-parallel
        f"{layer}.self_attn.q_proj.weight": "S(0)",
        f"{layer}.self_attn.v_proj.bias": "S(0)",
        f"{layer}.self_attn.o_proj.weight": "S(1)",
        f"{layer}.self_attn.o_proj.bias": "R",
        f"{layer}.mlp.fc1.weight": "S(0)",
        f"{layer}.mlp.fc2.weight": "S(1)",
        f"{layer}.mlp.fc2.bias": "R",
        f"{layer}.input_layernorm.bias": "R",
        "vision_model.patch_embedding.linear.weight": "S(0)",
        "vision_model.positional_embedding_vlm": "R",
        "vision_model.vision_adapter.mlp.fc1.weight": "S(0)",
        "vision_model.vision_adapter.mlp.fc2.weight": "S(1)",
        "multi_modal_projector.linear_1.weight": "S(0)",
    }
    assert {f: placement[f] for f in expect} == expect


def test_closed_form_labels_itself_approximate_for_non_uniform_families() -> None:
    """A family whose file opts out of the closed form (Family.closed_form = False) is counted
    from its tensors, exactly; given by its dims only (no tensors), the closed form is all there
    is and the plan says it is approximate."""
    from shardctl.archs import family_for
    from shardctl.layout.pipeline import assign_layers
    from shardctl.plan.memory.estimate import estimate
    from tests._models import CONFIGS

    for name in ("gpt_oss", "llama4_text", "qwen2_moe", "deepseek_v3", "llama4"):
        assert not family_for(name).closed_form, name
        model = from_config(dict(CONFIGS[name]))
        assert model.dims is not None
        bare = type(model)(model.architecture, model.dims, (), model.dtype, "inline", model.config)
        stages = assign_layers(model.dims.num_layers, 1)
        caveat = estimate(bare, Mesh(tp=2), stages).warnings()
        assert any("closed form's uniform-layer counts, approximate" in w for w in caveat), name
        exact = estimate(model, Mesh(tp=2), stages).warnings()
        assert not any("approximate" in w for w in exact), name
    dense = from_config(dict(CONFIGS["llama"]))
    assert dense.dims is not None and family_for("llama").closed_form
    bare = type(dense)(dense.architecture, dense.dims, (), dense.dtype, "inline", dense.config)
    stages = assign_layers(dense.dims.num_layers, 1)
    assert not any("approximate" in w for w in estimate(bare, Mesh(tp=2), stages).warnings())


def test_inline_quantized_config_is_not_quantized_twice(tmp_path: Path) -> None:
    """The published gpt-oss config is already MXFP4: a manifest quantization: on top would
    price its experts twice; refused with one line, exit 3, like a quantized checkpoint."""
    text = (MANIFESTS / "gpt-oss-120b-mxfp4-h100.yaml").read_text()
    manifest = tmp_path / "twice.yaml"
    manifest.write_text(text + "quantization: {method: fp8}\n")
    done = run_cli("plan", str(manifest))
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "already quantized (mxfp4" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("  vision_config: {hidden_size: 32}\n", "'text_config': expected an object"),
        (
            "  text_config: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,\n"
            "    intermediate_size: 32, intermediate_size_mlp: 64, vocab_size: 128,\n"
            "    num_local_experts: 2, num_experts_per_tok: 1}\n  vision_config: 7\n",
            "'vision_config': expected an object (the multimodal Llama-4 config nests it); got int",
        ),
    ],
)
def test_llama4_config_without_its_sections_exits_3(
    tmp_path: Path, model: str, message: str
) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(f"model:\n  model_type: llama4\n{model}hardware: {{gpu: h100-sxm}}\n")
    done = run_cli("plan", str(manifest))
    assert done.returncode == 3, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_zero3_gathers_a_decoder_layer_not_a_vision_layer() -> None:
    """What ZeRO-3 gathers at once is the largest decoder layer: the multimodal Scout's equals its
    text model's (the vision tower's layers.{i} are not added into decoder layer i)."""
    from shardctl.plan.memory.layout_counts import largest_layer

    mm, text = _inventory("llama-4-scout-mm-tp8.yaml"), _inventory("llama-4-scout-tp8.yaml")
    assert largest_layer(mm, Mesh(tp=8), "tp") == largest_layer(text, Mesh(tp=8), "tp") > 0
