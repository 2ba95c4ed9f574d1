"""``engine: vllm`` with ``vllm_version: "0.19"`` against vLLM 0.19 (V1) start-up logs.

Source of every row: llm-d-incubation/llm-d-planner, ``accuracy/results/v0.19.0/logs/`` (commit
d3121e059da88662db39a926a3ead964be97359b), ``vllm serve`` on H100 80GB with
``--gpu-memory-utilization 0.95 --max-model-len 8192`` and vLLM's other defaults (the logs say
"Defaulting max_num_batched_tokens to 8192", "Defaulting max_num_seqs to 1024"; total_memory
79.19 GiB, "requested memory: 75.23GiB"). The assertion is issue 15's: within 3 % of the
logged "GPU KV cache size".

What was read from these logs, and so is not predicted by them (disclosed as the rule asks):

- ``SAMPLER_BYTES_PER_LOGIT_V019`` (15.45 B) was fitted to ONE row, Llama-3.1-8B TP1's "torch
  peak memory increase: 1.89GiB"; that row pins it (``test_llama31_8b_tp1_fit_row``);
- ``NON_TORCH_TP1_V019`` (0.25 GiB) and ``NON_TORCH_PP_V019`` (0.07) are the sweep's tp-1 and
  pp figures (the same in every tp-1 run), so the tp-1 and pp rows check the rest of the
  accounting (weights, forward, blocks), not the non-torch term.

Held out: the tensor-parallel term ``TP_GROUP_BYTES`` (1.79 GiB) comes from vLLM PR #10511
(v0.6.5, Dec 2024), not from these logs, so every tp > 1 row below is an out-of-sample check of
it — and of the sampler constant on other vocabularies (Qwen2.5, Qwen3, Phi-4, Llama-3.3-70B).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.types import Mesh
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, MemoryPlan, QuantSpec, Workload, estimate
from shardctl.plan.memory.kv import KvCapacity
from shardctl.plan.memory.shapes import split_layers
from shardctl.plan.memory.vllm import TP_GROUP_BYTES, non_torch_bytes
from tests._cli import ROOT, run_cli

GIB = 2**30
H100 = HardwareSpec.preset("h100-sxm")
# config.json shapes: hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied
LLAMA31_8B = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False)
QWEN25_7B = ModelDims(3584, 28, 28, 4, 128, 18944, 152064, False)
QWEN3_8B = ModelDims(4096, 36, 32, 8, 128, 12288, 151936, False)
PHI4 = ModelDims(5120, 40, 40, 10, 128, 17920, 100352, False)
QWEN25_72B = ModelDims(8192, 80, 64, 8, 128, 29568, 152064, False)  # also Kimi-Dev-72B
QWEN3_14B = ModelDims(5120, 40, 40, 8, 128, 17408, 151936, False)


def _plan(
    arch: str, dims: ModelDims, *, tp: int = 1, pp: int = 1, version: str = "0.19"
) -> MemoryPlan:
    model = ModelInfo(arch, dims, (), "BF16", "inline")
    w = Workload(sequence_length=8192, engine="vllm", vllm_version=version,
                 gpu_memory_utilization=0.95)  # fmt: skip
    return estimate(model, Mesh(tp=tp, pp=pp), split_layers(dims.num_layers, pp), hardware=H100,
                    workload=w)  # fmt: skip


def _tokens(plan: MemoryPlan) -> int:
    assert plan.kv is not None and plan.kv.capacity is not None
    cap: KvCapacity = plan.kv.capacity
    return cap.tokens


def _within(ours: float, logged: float, tol: float = 0.03) -> None:
    assert abs(ours - logged) <= tol * logged, f"{ours} vs {logged} ({ours / logged - 1:+.2%})"


def test_llama31_8b_tp1_fit_row() -> None:
    # meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192.log: "Model loading took 14.99 GiB",
    # "torch peak memory increase: 1.89GiB; non-torch forward increase memory: 0.25GiB",
    # "Available KV cache memory: 58.11 GiB", "GPU KV cache size: 476,016 tokens".
    # The sampler constant was fitted here (module docstring): this row pins it.
    plan = _plan("llama", LLAMA31_8B)
    r = plan.coords[(0, 0, 0)]
    assert round(r.activations / GIB, 2) == 1.89
    assert r.detail["overhead.non_torch"] == round(0.25 * GIB)
    assert plan.inputs["max_num_seqs"] == 1024 and plan.inputs["max_num_batched_tokens"] == 8192
    _within(_tokens(plan), 476_016)
    assert plan.fits is True


@pytest.mark.parametrize(
    ("arch", "dims", "tp", "logged"),
    [
        # ...llama-3-1-8b---h100-80gb--tp2pp1dp1--8192.log: non-torch 2.07GiB, 1,044,688 tokens
        ("llama", LLAMA31_8B, 2, 1_044_688),
        # ...llama-3-1-8b---h100-80gb--tp4pp1dp1--8192.log: non-torch 2.13GiB, 2,209,792 tokens
        ("llama", LLAMA31_8B, 4, 2_209_792),
        # qwen-qwen2-5-7b-instruct--h100-80gb--tp1pp1dp1--8192.log: peak 2.21GiB, 1,096,000
        ("qwen2", QWEN25_7B, 1, 1_096_000),
        # ...tp2pp1dp1: non-torch 2.06GiB, 2,390,592 tokens
        ("qwen2", QWEN25_7B, 2, 2_390_592),
        # ...tp4pp1dp1: non-torch 2.13GiB, 5,043,280 tokens
        ("qwen2", QWEN25_7B, 4, 5_043_280),
        # qwen-qwen3-8b--h100-80gb--tp1pp1dp1--8192.log: peak 2.21GiB, 418,688 tokens
        ("qwen3", QWEN3_8B, 1, 418_688),
        # microsoft-phi-4--h100-80gb--tp1pp1dp1--8192.log: peak 1.52GiB, 241,568 tokens
        ("phi3", PHI4, 1, 241_568),
        # moonshotai-kimi-dev-72b--h100-80gb--tp4pp1dp1--8192.log (Qwen2.5-72B shapes): weights
        # 34.01GiB, peak 2.29GiB, non-torch 2.21GiB, 481,296 tokens
        ("qwen2", QWEN25_72B, 4, 481_296),
    ],
)
def test_held_out_rows(arch: str, dims: ModelDims, tp: int, logged: int) -> None:
    plan = _plan(arch, dims, tp=tp)
    _within(_tokens(plan), logged)
    assert plan.fits is True


def _positions(dims: ModelDims, n: int) -> ModelDims:
    return dataclasses.replace(dims, max_position_embeddings=n)


# config.json shapes of the rows below, with their positions (so the rotary table is priced)
CODELLAMA_7B = _positions(ModelDims(4096, 32, 32, 32, 128, 11008, 32016, False), 16384)
GEMMA_7B = _positions(ModelDims(3072, 28, 16, 16, 256, 24576, 256000, True), 8192)
GRANITE31_8B = _positions(ModelDims(4096, 40, 32, 8, 128, 12800, 49155, True), 131072)
GRANITE31_2B = _positions(ModelDims(2048, 40, 32, 8, 64, 8192, 49155, True), 131072)
PHI2 = dataclasses.replace(  # two-matrix GELU MLP; partial rotary 0.4 of head_dim 80
    _positions(ModelDims(2560, 32, 32, 32, 80, 10240, 51200, False), 2048), gated_mlp=False
)


# Held out for the rotary table (plan/memory/rotary.py) and everything else: none of these
# logs was read before the terms were set. Llama-3.1's table, 131,072 × 128 × 2 B = 32 MiB, is
# the 14.99 − 14.96 GiB between the log's "Model loading took" and the checkpoint's bytes.
@pytest.mark.parametrize(
    ("arch", "dims", "dtype", "length", "logged"),
    [
        # codellama-codellama-7b-h--h100-80gb--tp1pp1dp1--8192.log: 12.56 GiB, peak 0.77GiB,
        # 126,256 tokens (CodeLlama-7b-hf: MHA, vocab 32,016)
        ("llama", CODELLAMA_7B, "BF16", 8192, 126_256),
        # google-gemma-7b--h100-80gb--tp1pp1dp1--8192.log: 15.91 GiB, peak 3.63GiB, 129,760
        # (head_dim 256, vocab 256,000, tied)
        ("gemma", GEMMA_7B, "BF16", 8192, 129_760),
        # granite-3-1-8b--h100-80gb--tp1pp1dp1--8192.log: 15.25 GiB, 384,432 tokens
        ("granite", GRANITE31_8B, "BF16", 8192, 384_432),
        # granite-3-1-2b--h100-80gb--tp1pp1dp1--8192.log: 4.74 GiB, 908,048 tokens
        ("granite", GRANITE31_2B, "BF16", 8192, 908_048),
        # microsoft-phi-2--h100-80gb--tp1pp1dp1--2048.log: float16, 5.19 GiB, 226,112 tokens
        ("phi", PHI2, "F16", 2048, 226_112),
        # meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--{2048,4096}.log and
        # meta-llama-llama-3-1-8b--h100-80gb--tp1pp1dp1--{16384,32768}.log: 476,016 tokens at
        # every --max-model-len (the profile runs max_num_batched_tokens = 8,192 tokens)
        ("llama", _positions(LLAMA31_8B, 131072), "BF16", 2048, 476_016),
        ("llama", _positions(LLAMA31_8B, 131072), "BF16", 4096, 476_016),
        ("llama", _positions(LLAMA31_8B, 131072), "BF16", 16384, 476_016),
        ("llama", _positions(LLAMA31_8B, 131072), "BF16", 32768, 476_016),
        # qwen-qwen2-5-7b-instruct--...--{2048,4096}.log, -instruc--...--{16384,32768}.log:
        # 1,096,000, 1,096,000, 1,095,968, 1,096,000 tokens
        ("qwen2", _positions(QWEN25_7B, 32768), "BF16", 2048, 1_096_000),
        ("qwen2", _positions(QWEN25_7B, 32768), "BF16", 32768, 1_096_000),
    ],
)
def test_more_held_out_rows(
    arch: str, dims: ModelDims, dtype: str, length: int, logged: int
) -> None:
    model = ModelInfo(arch, dims, (), dtype, "inline")
    w = Workload(sequence_length=length, engine="vllm", vllm_version="0.19",
                 gpu_memory_utilization=0.95)  # fmt: skip
    plan = estimate(model, Mesh(), split_layers(dims.num_layers, 1), hardware=H100, workload=w)
    _within(_tokens(plan), logged)
    assert plan.fits is True


@pytest.mark.parametrize(
    ("arch", "dims", "dtype", "kv", "quant", "logged"),
    [
        # meta-llama---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log: --kv-cache-dtype fp8,
        # 58.11 GiB, "GPU KV cache size: 952,032 tokens" (1 byte per element)
        ("llama", LLAMA31_8B, "BF16", "fp8", None, 952_032),
        # qwen-qwen2---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log: 2,192,000 tokens
        ("qwen2", QWEN25_7B, "BF16", "fp8", None, 2_192_000),
        # w8a8-redhatai-llam--...-dtf16.log (RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8,
        # int8 weights, a scale per output channel): weights 8.49 GiB, 529,200 tokens
        ("llama", LLAMA31_8B, "F16", None, QuantSpec(method="int8"), 529_200),
        # w4a16-redhatai-lla--...-dtf16.log (...-quantized.w4a16, int4 groups of 128): weights
        # 5.38 GiB, 554,704 tokens
        ("llama", LLAMA31_8B, "F16", None, QuantSpec(method="gptq", group_size=128), 554_704),
        # meta-llama-llama-3---h100-80gb--tp1pp1dp1--8192-qfp8.log (--quantization fp8 at load:
        # a scale per output channel): weights 8.49 GiB, 529,248 tokens
        (
            "llama",
            LLAMA31_8B,
            "BF16",
            None,
            QuantSpec(method="fp8", fp8_scaling="channel"),
            529_248,
        ),
        # w8a8-redhatai-qwen2-5-7b--...log: weights 8.14 GiB, 1,210,272 tokens
        ("qwen2", QWEN25_7B, "BF16", None, QuantSpec(method="int8"), 1_210_272),
        # fp8dyn-redhatai-qwen2-5---...log (RedHatAI/Qwen2.5-7B-Instruct-fp8-dynamic: FP8 weights,
        # a scale per output channel, compressed-tensors): weights 8.14 GiB, peak 2.21GiB,
        # 64.64 GiB, "GPU KV cache size: 1,210,304 tokens"
        (
            "qwen2",
            QWEN25_7B,
            "BF16",
            None,
            QuantSpec(method="fp8", fp8_scaling="channel"),
            1_210_304,
        ),
        # meta-llama-llama-3--h100-80gb--tp1pp1dp1--8192-dtf32.log (--dtype float32): weights
        # 29.98 GiB, peak 2.21GiB, 42.8 GiB, 175,296 tokens
        ("llama", LLAMA31_8B, "F32", None, None, 175_296),
    ],
)
def test_quantized_and_kv_dtype_rows(
    arch: str, dims: ModelDims, dtype: str, kv: str | None, quant: QuantSpec | None, logged: int
) -> None:
    # Held out (Llama-3.1-8B / Qwen2.5-7B in other precisions; the sampler was fitted on the
    # bf16 Llama row only).
    model = ModelInfo(arch, dims, (), dtype, "inline")
    w = Workload(sequence_length=8192, engine="vllm", vllm_version="0.19",
                 gpu_memory_utilization=0.95, kv_cache_dtype=kv)  # fmt: skip
    plan = estimate(model, Mesh(), split_layers(dims.num_layers, 1), hardware=H100, workload=w,
                    quant=quant)  # fmt: skip
    _within(_tokens(plan), logged)


@pytest.mark.parametrize(
    ("pp", "logged"),
    [
        # ...llama-3-1-8b---h100-80gb--tp1pp2dp1--8192.log: last stage "torch peak memory
        # increase: 2.01GiB", first 1.1; the pool is the smaller one: 1,075,312 tokens
        (2, 1_075_312),
        # ...tp1pp4dp1: 2,257,264 tokens
        (4, 2_257_264),
    ],
)
def test_pipeline_rows(pp: int, logged: int) -> None:
    _within(_tokens(_plan("llama", LLAMA31_8B, pp=pp)), logged)


@pytest.mark.xfail(
    strict=True,
    reason="vLLM logged 19,920 tokens (3.04 GiB of KV); shardctl gives 20,848 (+4.7 %; 21,360, "
    "+7.2 %, before the caching allocator's 80 MiB: down_proj [8192, 14784] takes a 232 MiB "
    "block, so 67.71 GiB of weights load as 67.79, the log's 67.8). The pool is a 3 GiB "
    "remainder of 75.23, so the 0.14 GiB left (sampler 2.24 vs 2.29 GiB, non-torch 2.04 vs "
    "2.09: each within 3 %) is 4.7 % of it; no term was refitted to this row",
)
def test_qwen25_72b_tp2_small_pool() -> None:
    # qwen-qwen2-5-72b-instruc--h100-80gb--tp2pp1dp1--8192.log: "Model loading took 67.8 GiB",
    # peak 2.29GiB, non-torch 2.09GiB, "Available KV cache memory: 3.04 GiB", 19,920 tokens.
    _within(_tokens(_plan("qwen2", QWEN25_72B, tp=2)), 19_920)


def test_llama33_70b_fp8_dynamic_tp4_manifest(tmp_path: Path) -> None:
    # fp8dyn-llama-3-3-70b--h100-80gb--tp4pp1dp1--8192.log: "Model loading took 16.96 GiB",
    # peak 1.97GiB, non-torch 2.21GiB, "Available KV cache memory: 54.09 GiB",
    # "GPU KV cache size: 708,992 tokens". The committed manifest, through the CLI.
    path = ROOT / "manifests/llama-3.3-70b-fp8-dynamic-vllm-tp4.yaml"
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["memory_model"]["inputs"]["vllm_version"] == "0.19"
    _within(doc["kv_cache"]["capacity_tokens_per_rank"], 708_992)
    # fp8dyn-llama-3-3-70b--h100-80gb--tp2pp1dp1--8192.log: weights 33.88 GiB, 244,304 tokens
    two = run_cli("plan", str(path), "--tp", "2", "--json")
    assert two.returncode == 0, two.stderr
    _within(json.loads(two.stdout)["kv_cache"]["capacity_tokens_per_rank"], 244_304)


MOE = """
model: {%s}
mesh: {tp: %d}
hardware: {gpu: h100-sxm}
workload: {engine: vllm, vllm_version: "0.19", gpu_memory_utilization: 0.95,
           sequence_length: 8192}
"""
MIXTRAL = (
    "model_type: mixtral, architectures: [MixtralForCausalLM], hidden_size: 4096, "
    "intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32, "
    "num_key_value_heads: 8, num_local_experts: 8, num_experts_per_tok: 2, vocab_size: 32000, "
    "max_position_embeddings: 32768, tie_word_embeddings: false, torch_dtype: bfloat16"
)
QWEN3_30B_A3B = (
    "model_type: qwen3_moe, architectures: [Qwen3MoeForCausalLM], hidden_size: 2048, "
    "intermediate_size: 6144, moe_intermediate_size: 768, num_hidden_layers: 48, "
    "num_attention_heads: 32, num_key_value_heads: 4, head_dim: 128, num_experts: 128, "
    "num_experts_per_tok: 8, decoder_sparse_step: 1, mlp_only_layers: [], norm_topk_prob: true, "
    "vocab_size: 151936, max_position_embeddings: 40960, tie_word_embeddings: false, "
    "torch_dtype: bfloat16"
)


def _manifest_plan(tmp_path: Path, text: str) -> dict[str, Any]:
    path = tmp_path / "moe.yaml"
    path.write_text(text)
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _manifest_tokens(tmp_path: Path, config: str, tp: int) -> int:
    tokens: int = _manifest_plan(tmp_path, MOE % (config, tp))["kv_cache"][
        "capacity_tokens_per_rank"
    ]
    return tokens


def _activation_gib(doc: dict[str, Any]) -> float:
    return float(doc["ranks"][0]["memory"]["activations"]) / GIB


# The MoE rows below are held out for the fused-MoE workspace term (vllm.moe_workspace_bytes:
# TritonExperts' workspace shapes, kept by the worker's WorkspaceManager through the sampler
# run); nothing was fitted to them. Each also checks the activation term against the logged
# "torch peak memory increase".


def test_mixtral_8x7b_tp2(tmp_path: Path) -> None:
    # mistralai-mixtral-8x7b-i--h100-80gb--tp2pp1dp1--8192.log: weights 43.51 GiB, "torch peak
    # memory increase: 1.21GiB", non-torch 2.07GiB, 28.44 GiB, "GPU KV cache size: 465,936".
    # Forward 0.52 GiB + workspace 0.66 (8,192 × 2 × (7,168 + 14,336) × 2 B) = 1.17: +0.4 %
    # (+2.7 % before the workspace was counted).
    doc = _manifest_plan(tmp_path, MOE % (MIXTRAL, 2))
    _within(_activation_gib(doc), 1.21, tol=0.05)
    _within(doc["kv_cache"]["capacity_tokens_per_rank"], 465_936)


def test_qwen3_30b_a3b_tp1(tmp_path: Path) -> None:
    # qwen-qwen3-30b-a3b--h100-80gb--tp1pp1dp1--8192.log: weights 56.88 GiB, peak 2.68GiB,
    # non-torch 0.27GiB, "Available KV cache memory: 15.41 GiB", 168,288 tokens. Sampler 2.24
    # GiB + workspace 0.50 (8,192 × 8 × (2,048 + 2,048) × 2 B) = 2.74: 168,144 tokens, -0.1 %
    # (+3.2 % and xfail before).
    doc = _manifest_plan(tmp_path, MOE % (QWEN3_30B_A3B, 1))
    _within(_activation_gib(doc), 2.68)
    _within(doc["kv_cache"]["capacity_tokens_per_rank"], 168_288)


@pytest.mark.parametrize(
    ("version", "kv_gib", "concurrency"),
    [
        # llm-d-planner accuracy/accuracy_report.md, "vLLM Version Sensitivity": Qwen/Qwen3-14B,
        # H100, utilization 0.95, max_model_len 8192. v0.15.0/v0.16.0: activation 5.64 GiB,
        # non-torch 0.13, KV 41.94 GiB, max concurrency 33.55. The 0.13 of "0.16" was read
        # from this row (it pins it); the sort-path sampler (41 B/logit, from vLLM PR #10511's
        # V0 log) is held out: 5.94 GiB predicted against 5.64.
        ("0.16", 41.94, 33.55),
        # v0.18.0: activation 2.23, non-torch 0.25, KV 45.23 GiB, concurrency 36.18 (held out:
        # Qwen3-14B is not the row the 0.19 sampler constant was fitted to).
        ("0.19", 45.23, 36.18),
    ],
)
def test_qwen3_14b_version_sweep(version: str, kv_gib: float, concurrency: float) -> None:
    plan = _plan("qwen3", QWEN3_14B, version=version)
    assert plan.kv is not None and plan.kv.capacity is not None
    _within(plan.kv.capacity.kv_bytes / GIB, kv_gib)
    _within(plan.kv.capacity.max_concurrency, concurrency)


GEMMA2 = (
    "model_type: gemma2, architectures: [Gemma2ForCausalLM], hidden_size: %d, "
    "intermediate_size: %d, num_hidden_layers: %d, num_attention_heads: %d, "
    "num_key_value_heads: %d, head_dim: %d, vocab_size: 256000, max_position_embeddings: 8192, "
    "sliding_window: 4096, query_pre_attn_scalar: %d, attn_logit_softcapping: 50.0, "
    "final_logit_softcapping: 30.0, hidden_activation: gelu_pytorch_tanh, "
    "tie_word_embeddings: true, torch_dtype: bfloat16"
)


@pytest.mark.parametrize(
    ("shape", "logged"),
    [
        # google/gemma-2-2b-it config.json; google-gemma-2-2b-it--h100-80gb--tp1pp1dp1--8192.log:
        # weights 4.9 GiB, peak 3.62GiB, 66.47 GiB, "GPU KV cache size: 670,160 tokens"
        ((2304, 9216, 26, 8, 4, 256, 256), 670_160),
        # google/gemma-2-9b-it; ...gemma-2-9b-it--...log: 17.22 GiB, 3.65GiB, 168,880 tokens
        ((3584, 14336, 42, 16, 8, 256, 256), 168_880),
        # google/gemma-2-27b-it; ...gemma-2-27b-it--...log: 50.72 GiB, 3.66GiB, 58,672 tokens
        ((4608, 36864, 46, 32, 16, 128, 144), 58_672),
    ],
)
def test_gemma2_hybrid_sliding_window_rows(
    tmp_path: Path, shape: tuple[int, ...], logged: int
) -> None:
    # Held out: half of Gemma-2's layers slide over 4,096 tokens, so vLLM V1 lays the cache out
    # in two groups (kv_layers.py, the hybrid manager read from vLLM's code); these are the first
    # logs that layout is held to. At max_model_len 8,192 the window saves nothing (4,095 + 8,192
    # batched tokens > 8,192), and the count still comes from the grouped layout.
    _within(_manifest_tokens(tmp_path, GEMMA2 % shape, 1), logged)


def test_deepseek_v2_lite_mla_row(tmp_path: Path) -> None:
    # deepseek-ai-deepseek-v2---h100-80gb--tp1pp1dp1--8192.log (DeepSeek-V2-Lite-Chat): weights
    # 29.43 GiB, peak 1.93GiB, non-torch 0.26GiB, 43.61 GiB, "GPU KV cache size: 1,505,552".
    # Held out: MLA's compressed cache, (512 + 64) × 27 layers × 2 B per token. The committed
    # DeepSeek-V2-Lite manifest with the v0.19 workload.
    text = (ROOT / "manifests/deepseek-v2-lite-tp1.yaml").read_text()
    text = text[: text.index("workload:")] + (
        'workload: {engine: vllm, vllm_version: "0.19", gpu_memory_utilization: 0.95, '
        "sequence_length: 8192}\n"
    )
    # Activation: sampler 1.51 GiB + the fused-MoE workspace 0.45 (moe_intermediate_size 1,408,
    # 6 of 64 experts) = 1.95 against the logged 1.93; 1,510,960 tokens, +0.4 % (+1.4 % before).
    doc = _manifest_plan(tmp_path, text)
    _within(_activation_gib(doc), 1.93)
    _within(doc["kv_cache"]["capacity_tokens_per_rank"], 1_505_552)


def test_gpt_oss_20b_tp2_row(tmp_path: Path) -> None:
    # openai-gpt-oss-20b--h100-80gb--tp2pp1dp1--8192.log (default utilization 0.9: "requested
    # memory: 71.27GiB"; the 0.95 run ran out of memory after start-up): weights 7.01 GiB, peak
    # 2.87GiB, non-torch 2.07GiB, 59.32 GiB, "GPU KV cache size: 2,591,776 tokens". Held out;
    # the committed gpt-oss-120b manifest with gpt-oss-20b's shapes (24 layers, 32 experts).
    # Within 3 % (+0.9 %) although the weights are 6.41 GiB against vLLM's 7.01 (its MXFP4 MoE
    # layout holds more than the checkpoint's bytes; not modelled): the pool is large.
    path = _gpt_oss_20b(tmp_path, 2, 0.9)
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    _within(json.loads(done.stdout)["kv_cache"]["capacity_tokens_per_rank"], 2_591_776)


def _gpt_oss_20b(tmp_path: Path, tp: int, utilization: float) -> Path:
    """The committed gpt-oss-120b manifest with gpt-oss-20b's shapes (24 layers, 32 experts)."""
    text = (ROOT / "manifests/gpt-oss-120b-mxfp4-h100.yaml").read_text()
    text = text.replace("num_hidden_layers: 36", "num_hidden_layers: 24")
    text = text.replace("num_local_experts: 128", "num_local_experts: 32")
    start = text.index("  layer_types: [")
    end = text.index("]", start) + 1
    kinds = ", ".join(["sliding_attention", "full_attention"] * 12)
    text = text[:start] + f"  layer_types: [{kinds}]" + text[end:]
    text = text[: text.index("mesh:")] + (
        f"mesh: {{tp: {tp}}}\nhardware: {{gpu: h100-sxm}}\n"
        'workload: {engine: vllm, vllm_version: "0.19", sequence_length: 8192, '
        f"gpu_memory_utilization: {utilization}}}\n"
    )
    path = tmp_path / "gpt-oss-20b.yaml"
    path.write_text(text)
    return path


@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.19 refused gpt-oss-20b at --gpu-memory-utilization 0.95 (tp 1 and tp 2): it "
    "sized the KV cache as planned (58.47 GiB, 1,277,184 tokens at tp 1; shardctl 1,292,400), "
    "captured CUDA graphs (1.84 GiB, outside the budget in 0.19), then ran out of memory "
    "warming up the sampler over 1,024 dummy requests: 786 MiB asked, 0.55 GiB free, 1.78 GiB "
    "reserved by PyTorch but unallocated (fragmentation). Other 0.95 runs of the same sweep with "
    "as much graph memory (Llama-3.3-70B-FP8 tp 2: 1.85 GiB) or larger samplers (Gemma-3, "
    "262k vocab) started, and vLLM's own closing line ('--kv-cache-memory=… to fully utilize "
    "gpu memory' less the KV in use) left 1.46 GiB here where runs with 0.43 GiB started, so no "
    "accounting term separates this one; shardctl says it fits",
)
@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_20b_refused_at_095(tmp_path: Path, tp: int) -> None:
    # openai-gpt-oss-20b--h100-80gb--tp{1,2}pp1dp1--8192.FAILED.log: "torch.OutOfMemoryError:
    # CUDA out of memory. Tried to allocate 786.00 MiB" in _dummy_sampler_run, after "GPU KV
    # cache size: 1,277,184 tokens" (tp 1) / "2,764,768 tokens" (tp 2).
    done = run_cli("plan", str(_gpt_oss_20b(tmp_path, tp, 0.95)), "--json")
    assert done.returncode == 1, "shardctl says it fits where vLLM 0.19 did not start"


def test_tensor_parallel_term_is_one_group_not_per_peer() -> None:
    # vLLM 0.19 on H100: tp 2 → 2.06-2.11 GiB, tp 4 → 2.13-2.21 GiB (flat, not linear in tp).
    for version in ("0.6", "0.16", "0.19"):
        tp2 = non_torch_bytes("h100-sxm", 2, version=version)
        assert all(non_torch_bytes("h100-sxm", t, version=version) == tp2 for t in (4, 8, 16))
        assert tp2 - non_torch_bytes("h100-sxm", 1, version=version) == TP_GROUP_BYTES
    assert round(non_torch_bytes("h100-sxm", 4, version="0.19") / GIB, 2) == 2.04
    # PCIe cards and GPUs without a preset: the group's buffers are small there (vLLM PR #14447,
    # 24 GB GPUs: 0.20 GiB of non-torch memory in all at tp > 1; 4×A30 tp 4: 0.09)
    for gpu in ("l40s", "h100-pcie", None):
        assert non_torch_bytes(gpu, 4) - non_torch_bytes(gpu, 1) == round(0.20 * GIB)
    # every switch-fabric part of the GPU table takes the H100 figure (towards "does not fit")
    for gpu in ("h200", "b200", "a100-80gb", "a100-40gb", "mi300x"):
        assert non_torch_bytes(gpu, 4) - non_torch_bytes(gpu, 1) == TP_GROUP_BYTES


def test_vllm_version_manifest_key_and_refusal(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text((MOE % (MIXTRAL, 2)).replace('vllm_version: "0.19"', "vllm_version: 0.7"))
    done = run_cli("plan", str(path))
    assert done.returncode == 3
    assert "vllm_version" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    # a plain number works as for sglang_version; an explicit max_num_seqs wins over the default
    ok = tmp_path / "ok.yaml"
    ok.write_text(
        (MOE % (MIXTRAL, 2)).replace(
            'vllm_version: "0.19"', "vllm_version: 0.19, max_num_seqs: 256"
        )
    )
    doc = json.loads(run_cli("plan", str(ok), "--json").stdout)
    assert doc["memory_model"]["inputs"]["max_num_seqs"] == 256
    assert doc["memory_model"]["inputs"]["vllm_version"] == "0.19"


@given(
    length=st.integers(1, 200_000),
    batch=st.integers(1, 64),
    tp=st.sampled_from([1, 2, 4, 8]),
    version=st.sampled_from(["0.16", "0.19", "0.21"]),
)
@settings(max_examples=40, deadline=None)
def test_v1_verdict_is_the_capacity(length: int, batch: int, tp: int, version: str) -> None:
    # As for 0.6: the workload fits exactly when its sequences, each in whole blocks, fit in
    # the blocks the profile leaves — so a max_model_len vLLM cannot hold is never "fits".
    model = ModelInfo("llama", LLAMA31_8B, (), "BF16", "inline")
    w = Workload(batch_size=batch, sequence_length=length, engine="vllm", vllm_version=version)
    plan = estimate(model, Mesh(tp=tp), split_layers(32, 1), hardware=H100, workload=w)
    assert plan.fits == (batch * -(-length // 16) * 16 <= _tokens(plan))


def _graphs_plan(version: str, **keys: object) -> MemoryPlan:
    model = ModelInfo("llama", LLAMA31_8B, (), "BF16", "inline")
    w = Workload(sequence_length=8192, engine="vllm", vllm_version=version,
                 gpu_memory_utilization=0.95, **keys)  # type: ignore[arg-type]  # fmt: skip
    return estimate(model, Mesh(), split_layers(32, 1), hardware=H100, workload=w)


def test_v021_subtracts_the_cuda_graph_estimate() -> None:
    """``vllm_version: "0.21"``: vLLM from 0.21.0 subtracts its CUDA-graph estimate before sizing
    the KV cache ("CUDA graph memory profiling is enabled (default since v0.21.0)").

    Not a held-out row: no vLLM >= 0.21 start-up log of a model and GPU this suite prices was
    found, so this checks the accounting against vLLM 0.19's own log of the same run, which
    prints the estimate it did not yet subtract — meta-llama-llama-3-1-8b--h100-80gb--
    tp1pp1dp1--16384.log (llm-d-planner v0.19.0): "CUDA graph pool memory: 0.91 GiB (actual),
    0.84 GiB (estimated)", "Current kv cache memory in use is 58.11 GiB". The 0.84 GiB default
    (CUDA_GRAPH_ESTIMATE_V021) was read from this log, so the row pins it; that 0.21 changed
    nothing else is an assumption, not a measurement.
    """
    v19, v21 = _graphs_plan("0.19"), _graphs_plan("0.21")
    r19, r21 = v19.coords[(0, 0, 0)], v21.coords[(0, 0, 0)]
    assert r19.detail["overhead.cuda_graphs"] == 0
    assert r21.detail["overhead.cuda_graphs"] == round(0.84 * GIB)
    # everything else is 0.19's
    assert (r21.weights, r21.activations) == (r19.weights, r19.activations)
    assert r21.detail["overhead.non_torch"] == r19.detail["overhead.non_torch"]
    assert v21.kv is not None and v21.kv.capacity is not None
    _within(v21.kv.capacity.kv_bytes, (58.11 - 0.84) * GIB)
    # 131,072 B per token at tp 1: the estimate costs 0.84 GiB / 128 KiB ≈ 6,881 tokens
    assert _tokens(v19) - _tokens(v21) == pytest.approx(0.84 * GIB / 131_072, abs=16)


def test_v021_estimate_is_settable() -> None:
    # The logged "Estimated CUDA graph memory: X GiB total" replaces the default (Granite-3.1-2B
    # logged 1.6 GiB in the same sweep); 0 is VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.
    off = _graphs_plan("0.21", cuda_graph_memory=0)
    assert _tokens(off) == _tokens(_graphs_plan("0.19"))
    big = _graphs_plan("0.21", cuda_graph_memory=round(1.6 * GIB))
    assert big.coords[(0, 0, 0)].detail["overhead.cuda_graphs"] == round(1.6 * GIB)
    assert _tokens(big) < _tokens(_graphs_plan("0.21"))
    # earlier versions and other engines charge no graphs unless told
    for version in ("0.2", "0.6", "0.16", "0.19"):
        r = _graphs_plan(version).coords[(0, 0, 0)]
        assert r.detail["overhead.cuda_graphs"] == 0


def test_v021_manifest_key(tmp_path: Path) -> None:
    # `vllm_version: 0.21` in a manifest: the ranks' overhead grows by the estimate, the KV pool
    # shrinks by it; `cuda_graph_memory` in the manifest replaces it.
    docs = {}
    for name, keys in (("v19", "vllm_version: 0.19"), ("v21", "vllm_version: 0.21"),
                       ("v21set", "vllm_version: 0.21, cuda_graph_memory: 2GiB")):  # fmt: skip
        path = tmp_path / f"{name}.yaml"
        path.write_text((MOE % (MIXTRAL, 2)).replace('vllm_version: "0.19"', keys))
        done = run_cli("plan", str(path), "--json")
        assert done.returncode == 0, done.stderr
        docs[name] = json.loads(done.stdout)
    assert docs["v21"]["memory_model"]["inputs"]["vllm_version"] == "0.21"

    def overhead(name: str) -> int:
        return int(docs[name]["ranks"][0]["memory"]["overhead"])

    assert overhead("v21") - overhead("v19") == round(0.84 * GIB)
    assert overhead("v21set") - overhead("v19") == 2 * GIB
    kv = {k: d["kv_cache"]["kv_cache_bytes_per_rank"] for k, d in docs.items()}
    assert kv["v19"] - kv["v21"] == pytest.approx(0.84 * GIB, rel=0.01)


def test_moe_workspace_only_for_16bit_experts_in_v1() -> None:
    # The term follows TritonExperts' unquantized path in V1's WorkspaceManager: not V0 (its
    # fused_moe allocated per call), not dense models, not quantized experts (other kernels).
    from shardctl.plan.memory.vllm import moe_workspace_bytes

    qwen = ModelDims(2048, 48, 32, 4, 128, 768, 151936, False, num_experts=128,
                     experts_per_token=8)  # fmt: skip

    def plan(version: str, quant: QuantSpec | None = None) -> MemoryPlan:
        model = ModelInfo("qwen3_moe", qwen, (), "BF16", "inline")
        w = Workload(sequence_length=8192, engine="vllm", vllm_version=version)
        return estimate(model, Mesh(), split_layers(48, 1), hardware=H100, workload=w,
                        quant=quant)  # fmt: skip

    ws = moe_workspace_bytes(tokens=8192, hidden=2048, expert_intermediate=768, topk=8, tp=1,
                             act_bytes=2)  # fmt: skip
    assert ws == 8192 * 8 * (2048 + 2048) * 2
    for version in ("0.16", "0.19", "0.21"):
        assert plan(version).coords[(0, 0, 0)].detail["activations.moe_workspace"] == ws
    assert "activations.moe_workspace" not in plan("0.6").coords[(0, 0, 0)].detail
    fp8 = plan("0.19", QuantSpec(method="fp8", fp8_scaling="channel")).coords[(0, 0, 0)]
    assert "activations.moe_workspace" not in fp8.detail
    dense = _plan("llama", LLAMA31_8B).coords[(0, 0, 0)]
    assert "activations.moe_workspace" not in dense.detail
    # past VLLM_FUSED_MOE_CHUNK_SIZE (16,384 tokens) the workspaces stop growing; the output
    # (tokens × hidden) does not
    big = moe_workspace_bytes(tokens=32768, hidden=2048, expert_intermediate=768, topk=8, tp=1,
                              act_bytes=2)  # fmt: skip
    assert big == (16384 * 8 * 2048 * 2 + 32768 * 2048) * 2
