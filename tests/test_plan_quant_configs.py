"""``plan`` from a published ``quantization_config`` pasted inline (or in a config.json): the
stored tensors its format writes are priced, and the answer is held to vLLM 0.19's start-up
logs of those very releases.

Source of the rows: llm-d-incubation/llm-d-planner, ``accuracy/results/v0.19.0/logs/`` (commit
d3121e059da88662db39a926a3ead964be97359b), ``vllm serve`` on H100 at
``--gpu-memory-utilization 0.95 --max-model-len 8192``. The logs name the releases and what vLLM
chose for them ("Using scheme: CompressedTensorsW8A8Int8"); the ``quantization_config`` below
is what llm-compressor's schemes write for them (``W8A8``: int8 per output channel with dynamic
per-token activations; ``W4A16``: int4 per group of 128, pack-quantized; ``FP8_DYNAMIC``: FP8
per channel), with ``ignore: [lm_head]``. Held out: nothing here was fitted to these rows; the
same rows through ``quantization: {method: ...}`` are in tests/test_plan_accuracy_vllm_v1.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._cli import run_cli

LLAMA31_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
QWEN25_7B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
LLAMA33_70B = {
    **LLAMA31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def ct(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if acts is not None:
        group["input_activations"] = acts
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
    }


INT8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
INT4 = {
    "num_bits": 4,
    "type": "int",
    "strategy": "group",
    "group_size": 128,
    "symmetric": True,
    "dynamic": False,
}
FP8 = {**INT8, "type": "float"}
FP8_TOKEN = {**TOKEN, "type": "float"}
W8A8 = ct("int-quantized", INT8, TOKEN)


def manifest(tmp_path: Path, model: dict[str, Any], tp: int = 1, **extra: Any) -> Path:
    doc = {
        "model": model,
        "mesh": {"tp": tp},
        "hardware": {"gpu": "h100-sxm"},
        "workload": {
            "engine": "vllm",
            "vllm_version": "0.19",
            "gpu_memory_utilization": 0.95,
            "sequence_length": 8192,
        },
        **extra,
    }
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


@pytest.mark.parametrize(
    ("model", "tp", "logged"),
    [
        # w8a8-redhatai-llam--h100-80gb--tp1pp1dp1--8192-dtf16.log
        # (RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8, --dtype float16): 529,200 tokens
        ({**LLAMA31_8B, "torch_dtype": "float16", "quantization_config": W8A8}, 1, 529_200),
        # w4a16-redhatai-lla--...-dtf16.log (...-quantized.w4a16): 554,704 tokens
        (
            {
                **LLAMA31_8B,
                "torch_dtype": "float16",
                "quantization_config": ct("pack-quantized", INT4),
            },
            1,
            554_704,
        ),
        # w8a8-redhatai-qwen2-5-7b--h100-80gb--tp1pp1dp1--8192.log: 1,210,272 tokens
        ({**QWEN25_7B, "torch_dtype": "bfloat16", "quantization_config": W8A8}, 1, 1_210_272),
        # fp8dyn-llama-3-3-70b--h100-80gb--tp{4,2}pp1dp1--8192.log
        # (RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic): 708,992 and 244,304 tokens
        (
            {
                **LLAMA33_70B,
                "torch_dtype": "bfloat16",
                "quantization_config": ct("float-quantized", FP8, FP8_TOKEN),
            },
            4,
            708_992,
        ),
        (
            {
                **LLAMA33_70B,
                "torch_dtype": "bfloat16",
                "quantization_config": ct("float-quantized", FP8, FP8_TOKEN),
            },
            2,
            244_304,
        ),
    ],
    ids=[
        "llama31-8b-w8a8",
        "llama31-8b-w4a16",
        "qwen25-7b-w8a8",
        "llama33-70b-fp8-tp4",
        "llama33-70b-fp8-tp2",
    ],
)
def test_published_quantized_releases(
    tmp_path: Path, model: dict[str, Any], tp: int, logged: int
) -> None:
    done = run_cli("plan", str(manifest(tmp_path, model, tp)), "--json")
    assert done.returncode == 0, done.stderr
    tokens = json.loads(done.stdout)["kv_cache"]["capacity_tokens_per_rank"]
    assert abs(tokens - logged) <= 0.01 * logged, f"{tokens} vs {logged}"


def test_int8_release_is_priced_as_stored(tmp_path: Path) -> None:
    """The int-quantized release stores I8 weights and a bf16 scale per output row; the manifest's
    ``quantization: {method: int8}`` prices an fp32 scale per row: the two differ by exactly
    2 bytes per row of the quantized linears (and the head, in ``ignore``, stays 16-bit)."""
    model = {**QWEN25_7B, "torch_dtype": "bfloat16"}
    stored = run_cli(
        "plan", str(manifest(tmp_path, {**model, "quantization_config": W8A8})), "--json"
    )
    assert stored.returncode == 0, stored.stderr
    priced = run_cli(
        "plan", str(manifest(tmp_path, model, quantization={"method": "int8"})), "--json"
    )
    assert priced.returncode == 0, priced.stderr
    h, ff, layers = 3584, 18944, 28
    rows = layers * (h + 2 * 512 + h + 2 * ff + h)  # q, k, v, o, gate, up, down
    a = json.loads(stored.stdout)["ranks"][0]["memory"]["weights"]
    b = json.loads(priced.stdout)["ranks"][0]["memory"]["weights"]
    assert b - a == 2 * rows


def test_a_quantized_config_and_a_quantization_section_are_refused(tmp_path: Path) -> None:
    path = manifest(
        tmp_path,
        {**QWEN25_7B, "torch_dtype": "bfloat16", "quantization_config": W8A8},
        quantization={"method": "int4"},
    )
    done = run_cli("plan", str(path))
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "already quantized" in lines[0] and "int-quantized" in lines[0]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        (
            {"config_groups": {"g": {"weights": {**INT8, "strategy": "tensor_group"}}}},
            "strategy 'tensor_group'",
        ),
        (
            {"config_groups": {"g": {"weights": {**INT8, "num_bits": 16}}}},
            "int num_bits 16 in format int-quantized",
        ),
        (
            {"config_groups": {"g": {"weights": {**INT8, "strategy": "group"}}}},
            "strategy group without a group_size",
        ),
    ],
)
def test_bad_quantization_config_is_one_line(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    model = {**QWEN25_7B, "quantization_config": {**W8A8, **change}}
    done = run_cli("plan", str(manifest(tmp_path, model)))
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "quantization_config" in lines[0], lines
