"""KV cache per layer: sliding windows, MLA's latent cache, fp8; the vllm profile via manifests."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

from shardctl.layout.types import Mesh
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, Workload, estimate
from shardctl.plan.memory.kv_layers import layer_windows, mla_latent_width
from shardctl.plan.memory.shapes import split_layers

GIB = 2**30
# mistralai/Mistral-7B-v0.1 config.json: sliding_window 4096 on every layer.
MISTRAL = ModelDims(4096, 32, 32, 8, 128, 14336, 32000, False)
# google/gemma-2-9b config.json: 42 layers, 8 KV heads × 256, sliding_window 4096 on even layers.
GEMMA2 = ModelDims(3584, 42, 16, 8, 256, 14336, 256000, True)
# deepseek-ai/DeepSeek-V3 config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64.
DSV3 = ModelDims(7168, 61, 128, 128, 128, 18432, 129280, False)


def _model(arch: str, dims: ModelDims, **config: Any) -> ModelInfo:
    return ModelInfo(arch, dims, (), "BF16", "inline", MappingProxyType(config))


def _kv(model: ModelInfo, seq: int, **kw: Any) -> int:
    plan = estimate(model, Mesh(**kw), split_layers(model.dims.num_layers if model.dims else 0, 1),
                    workload=Workload(sequence_length=seq))  # fmt: skip
    return plan.coords[(0, 0, 0)].kv_cache


def test_mistral_sliding_window_at_32k() -> None:
    # Issue 15: Mistral-7B-v0.1 at 32k charged 4.0 GiB for the full length, 0.5 GiB with the
    # 4096-token window (32 layers · 8 · 128 · 2 · 2 B = 128 KiB per token).
    full = _kv(_model("llama", MISTRAL), 32768)
    windowed = _kv(_model("mistral", MISTRAL, sliding_window=4096), 32768)
    assert full == 4 * GIB and windowed == GIB // 2
    # Shorter than the window: the same as full attention.
    assert _kv(_model("mistral", MISTRAL, sliding_window=4096), 2048) == 2048 * 131072


def test_gemma2_alternating_layers() -> None:
    # Issue 15: charging Gemma-2's sliding layers for the full length is 1.33× too much at 8k:
    # 42 layers × 8192 against 21 × 8192 + 21 × 4096 token-layers.
    assert layer_windows("gemma2", {"sliding_window": 4096}, 4) == (4096, None, 4096, None)
    full = _kv(_model("llama", GEMMA2), 8192)
    mixed = _kv(_model("gemma2", GEMMA2, sliding_window=4096), 8192)
    assert full / mixed == 42 * 8192 / (21 * 8192 + 21 * 4096)
    assert round(full / mixed, 2) == 1.33


def test_layer_types_win_and_qwen_style_switch_off() -> None:
    types = ["sliding_attention", "full_attention"]
    assert layer_windows("x", {"sliding_window": 8, "layer_types": types}, 2) == (8, None)
    assert layer_windows("mistral", {"sliding_window": 8, "use_sliding_window": False}, 2) == (
        None,
        None,
    )


def test_deepseek_v3_mla_latent_is_70272_bytes_per_token() -> None:
    # (kv_lora_rank 512 + qk_rope_head_dim 64) × 61 layers × 2 B (bf16) = 70,272 B per token,
    # the same on every tp rank (vLLM's MLA cache holds the latent, not per-head K/V).
    assert (512 + 64) * 61 * 2 == 70_272
    cfg = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert mla_latent_width(cfg) == 576
    model = _model("deepseek_v3", DSV3, **cfg)
    assert _kv(model, 1) == 70_272
    assert _kv(model, 1, tp=8) == 70_272
    plan = estimate(model, Mesh(), split_layers(61, 1), workload=Workload(sequence_length=1))
    assert plan.kv is not None and plan.kv.bytes_per_token == 70_272


def test_fp8_kv_halves_the_cache() -> None:
    model = _model("mistral", MISTRAL, sliding_window=4096)
    plan = estimate(model, Mesh(), split_layers(32, 1),
                    workload=Workload(sequence_length=32768, kv_cache_dtype="fp8"))  # fmt: skip
    assert plan.coords[(0, 0, 0)].kv_cache == GIB // 4


def test_vllm_max_concurrency_counts_windows() -> None:
    model = _model("mistral", MISTRAL, sliding_window=4096)
    # vLLM V1 (kv_cache_interface SlidingWindowSpec.max_memory_usage_bytes): a sliding layer
    # reserves cdiv(min(window − 1 + max_num_batched_tokens, max_model_len), 16) + 1 blocks:
    # with 2,048-token chunks, 385 blocks = 6,160 tokens of a 32k sequence per layer, 5.32× the
    # sequences a full-attention count says (the bare window, 4,096, would say 8×).
    w = Workload(sequence_length=32768, engine="vllm", profile_tokens=2048)
    plan = estimate(model, Mesh(), split_layers(32, 1), hardware=HardwareSpec.preset("h100-sxm"),
                    workload=w)  # fmt: skip
    assert plan.kv is not None and plan.kv.capacity is not None
    c = plan.kv.capacity
    assert round(c.max_concurrency / (c.tokens / 32768), 4) == round(32768 / 6160, 4)
    # without chunked prefill (V0's max_num_batched_tokens = max_model_len) a chunk is the
    # whole prompt: the window saves nothing at the peak
    plan = estimate(model, Mesh(), split_layers(32, 1), hardware=HardwareSpec.preset("h100-sxm"),
                    workload=Workload(sequence_length=32768, engine="vllm"))  # fmt: skip
    assert plan.kv is not None and plan.kv.capacity is not None
    c = plan.kv.capacity
    assert round(c.max_concurrency / (c.tokens / 32768), 4) == round(2048 / 2049, 4)


MANIFEST = """\
model:
  model_type: llama
  hidden_size: 4096
  intermediate_size: 14336
  num_hidden_layers: 32
  num_attention_heads: 32
  num_key_value_heads: 8
  vocab_size: 128256
  max_position_embeddings: 131072
  torch_dtype: bfloat16
mesh: {tp: 1}
hardware: {device_memory: 25318694584}  # 23.58 GiB: issue #10517's RTX 3090
workload:
  engine: vllm
  sequence_length: %d
"""


def test_manifest_engine_vllm_text_and_json(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from shardctl.cli import app

    runner = CliRunner()
    for length, code, word in ((20000, 0, "fits"), (29000, 1, "does not fit")):
        path = tmp_path / f"m{length}.yaml"
        path.write_text(MANIFEST % length)
        res = runner.invoke(app, ["plan", str(path), "--json"])
        assert res.exit_code == code, res.output
        doc = json.loads(res.stdout)
        kv, inputs = doc["kv_cache"], doc["memory_model"]["inputs"]
        assert inputs["engine"] == "vllm" and inputs["max_num_batched_tokens"] == length
        assert {"kv_cache_bytes_per_rank", "blocks_per_rank", "block_size", "max_concurrency"} <= (
            kv.keys()
        )
        text = runner.invoke(app, ["plan", str(path)])
        assert word in text.output and "blocks of 16 tokens" in text.output
