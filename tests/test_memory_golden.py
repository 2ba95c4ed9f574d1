"""Golden values computed by hand from the published formulas (not from our code)."""

from __future__ import annotations

import pytest

from shardctl.model.types import ModelDims
from shardctl.plan.memory.activations import (
    in_flight_microbatches,
    last_stage_activation_bytes,
    layer_activation_bytes,
)
from shardctl.plan.memory.kv import kv_bytes_per_token, kv_capacity
from shardctl.plan.memory.quant import matrix_bytes
from shardctl.plan.memory.training import model_states, optimizer_bytes_per_param

# The GPT-3-style layer of Korthikanti et al. 2022: MHA, 4h GeLU MLP, dropout, 16-bit.
H, A, S, B = 12288, 96, 2048, 1
GPT = ModelDims(H, 1, A, A, H // A, 4 * H, 51200, False, gated_mlp=False)
SBH = S * B * H


# -- ZeRO paper, Figure 1: Ψ = 7.5e9, Nd = 64, K = 12 ------------------------------------
@pytest.mark.parametrize(("zero", "expected_gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(zero: int, expected_gb: float) -> None:
    s = model_states(7_500_000_000, zero=zero, dp=64)
    assert round(s.total / 1e9, 1) == expected_gb


def test_zero_paper_exact_bytes() -> None:
    psi, nd = 7_500_000_000, 64
    assert model_states(psi, zero=0, dp=nd).total == 16 * psi
    assert model_states(psi, zero=1, dp=nd).total == 4 * psi + 12 * psi // nd
    assert model_states(psi, zero=2, dp=nd).total == 2 * psi + 14 * psi // nd
    assert model_states(psi, zero=3, dp=nd).total == 16 * psi // nd


def test_fp32_grads_variant_is_18_bytes() -> None:
    assert model_states(1000, grad_bytes=4).total == 18 * 1000


def test_offload_moves_optimizer_to_host() -> None:
    s = model_states(1000, zero=2, dp=4, offload_optimizer="cpu")
    assert s.optimizer == 0 and s.host == 12 * 1000 // 4
    s = model_states(1000, zero=3, dp=4, offload_optimizer="nvme", offload_params="cpu")
    assert (s.weights, s.optimizer, s.nvme, s.host) == (0, 0, 3000, 500)


def test_optimizers() -> None:
    assert optimizer_bytes_per_param("adamw") == 12
    assert optimizer_bytes_per_param("sgd") == 8  # fp32 master + momentum
    assert optimizer_bytes_per_param("lion") == 8
    assert optimizer_bytes_per_param("adamw-8bit") == pytest.approx(6 + 8 / 2048)
    assert optimizer_bytes_per_param("adamw", mixed_precision=False) == 8


# -- vLLM paper: 13B (hidden 5120, 40 layers, fp16) → 800 KB per token -------------------
def test_vllm_paper_kv_per_token() -> None:
    d = ModelDims(5120, 40, 40, 40, 128, 13824, 32000, False)
    assert kv_bytes_per_token(d, "F16") == 2 * 40 * 5120 * 2 == 800 * 1024


def test_kv_gqa_fp8_and_replication() -> None:
    # Llama-3-70B: 80 layers, 8 KV heads × 128: 320 KiB/token in bf16, 8× less than MHA.
    d = ModelDims(8192, 80, 64, 8, 128, 28672, 128256, False)
    assert kv_bytes_per_token(d, "BF16") == 2 * 80 * 8 * 128 * 2 == 327680
    assert kv_bytes_per_token(d, "F8_E4M3") == 327680 // 2
    assert kv_bytes_per_token(d, "BF16", tp=8) == 327680 // 8
    # tp = 16 > 8 KV heads: each rank keeps one whole (replicated) head.
    assert kv_bytes_per_token(d, "BF16", tp=16) == 327680 // 8
    assert kv_bytes_per_token(d, "BF16", layers=40, tp=8) == 327680 // 16


def test_kv_capacity_serving_questions() -> None:
    gib = 2**30
    cap = kv_capacity(
        device_memory=80 * gib,
        utilization=0.9,
        non_kv_bytes=40 * gib,
        per_token=40960,
        batch=32,
        sequence_length=8192,
    )
    tokens = (int(80 * gib * 0.9) - 40 * gib) // (40960 * 16) * 16
    assert cap.tokens == tokens
    assert cap.max_batch == tokens // 8192
    assert cap.max_sequence_length == tokens // 32


# -- Korthikanti et al. 2022, Table 2 -----------------------------------------------------
def test_korthikanti_no_parallelism() -> None:
    assert layer_activation_bytes(GPT, seq=S, batch=B) == SBH * 34 + 5 * A * S * S * B


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_parallel(t: int) -> None:
    got = layer_activation_bytes(GPT, seq=S, batch=B, tp=t)
    assert got == SBH * 10 + SBH * 24 // t + 5 * A * S * S * B // t


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_sequence_parallel(t: int) -> None:
    got = layer_activation_bytes(GPT, seq=S, batch=B, tp=t, sequence_parallel=True)
    assert got == SBH * 34 // t + 5 * A * S * S * B // t


@pytest.mark.parametrize("t", [1, 8])
def test_korthikanti_selective_recompute(t: int) -> None:
    got = layer_activation_bytes(
        GPT, seq=S, batch=B, tp=t, sequence_parallel=True, recompute="selective"
    )
    assert got == SBH * 34 // t


def test_korthikanti_full_recompute() -> None:
    assert layer_activation_bytes(GPT, seq=S, batch=B, tp=8, recompute="full") == 2 * SBH


def test_korthikanti_output_layer() -> None:
    # §4.3: 4sbh/t · (1 + v/h) with sequence parallel.
    t, v = 8, 51200
    got = last_stage_activation_bytes(GPT, seq=S, batch=B, tp=t, sequence_parallel=True)
    assert got == 4 * SBH // t + 4 * S * B * v // t


def test_flash_attention_drops_the_quadratic_term() -> None:
    got = layer_activation_bytes(GPT, seq=S, batch=B, flash_attention=True)
    assert got == SBH * 34 + 4 * A * S * B  # fp32 log-sum-exp only


def test_gqa_swiglu_without_dropout() -> None:
    # Llama-style: q = a·d = h, kv = k·d, gated MLP stores 3 intermediates; no dropout.
    d = ModelDims(4096, 1, 32, 8, 128, 14336, 128256, False)
    s, b = 4096, 1
    kv = 8 * 128
    expected = s * b * (4096 * 8 + (2 * 4096 + 2 * kv) * 2 + 3 * 14336 * 2) + 32 * s * s * b * 2
    assert layer_activation_bytes(d, seq=s, batch=b, dropout=False) == expected


def test_one_f_one_b_in_flight() -> None:
    assert [in_flight_microbatches(i, 8, 16) for i in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert [in_flight_microbatches(i, 4, 2) for i in range(4)] == [2, 2, 2, 1]
    assert in_flight_microbatches(3, 4, 16, "gpipe") == 16


# -- Quantization formats -----------------------------------------------------------------
N = 4096 * 4096


def test_quant_formats() -> None:
    assert matrix_bytes("int8", N, 4096, 4096, 1) == N + 4 * 4096
    assert matrix_bytes("gptq", N, 4096, 4096, 1) == N // 2 + 2 * N // 128 + N // 256 + 4 * 4096
    assert matrix_bytes("awq", N, 4096, 4096, 1) == N // 2 + 2 * N // 128 + N // 256
    # QLoRA §3: 0.5 bit/param of constants without double quantization, 0.127 with it.
    assert matrix_bytes("nf4", N, 0, 0, 1, double_quant=False) * 8 / N == pytest.approx(4.5)
    assert matrix_bytes("nf4", N, 0, 0, 1) * 8 / N == pytest.approx(4.127, abs=1e-3)
    assert matrix_bytes("fp8", N, 0, 0, 1) == N + 4
    assert matrix_bytes("fp8-block", N, 0, 0, 1) == N + 4 * 32 * 32
    assert matrix_bytes("mxfp4", N, 0, 0, 1) * 8 / N == 4.25
    assert matrix_bytes("nvfp4", N, 0, 0, 1) == N // 2 + N // 16 + 4
