"""The engines' cos/sin tables (``overhead.rotary_cache``, shardctl/plan/memory/rotary.py).

Each expected size is worked out by hand from vLLM's ``get_rope`` (rows per rope type, columns
``rotary_dim``, the model's dtype; gpt-oss float32) and SGLang's (float32 on CUDA), on the
bundled manifests' configs (copied from the published config.json files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, Workload, estimate
from shardctl.plan.memory.rotary import rotary_cache_bytes
from shardctl.plan.memory.shapes import split_layers
from tests._cli import ROOT, run_cli

MIB = 2**20


def _model(manifest: str) -> ModelInfo:
    config: dict[str, Any] = yaml.safe_load((ROOT / "manifests" / manifest).read_text())["model"]
    return from_config(config)


@pytest.mark.parametrize(
    ("manifest", "vllm", "sglang"),
    [
        # Llama-4-Scout: llama3 rope, 10,485,760 positions × head_dim 128 (text_config)
        ("llama-4-scout-mm-tp8.yaml", 10_485_760 * 128 * 2, 10_485_760 * 128 * 4),
        # Gemma-3-27B: a local table (default rope, 131,072 rows) and a global one (linear,
        # factor 8: 1,048,576 rows), head_dim 128
        ("gemma-3-27b-text-tp4.yaml", (131_072 + 1_048_576) * 128 * 2, (131_072 + 1_048_576) * 512),
        # gpt-oss-120b: yarn, original 4,096 × factor 32 rows, head_dim 64, float32 in vLLM
        ("gpt-oss-120b-tp8.yaml", 131_072 * 64 * 4, 131_072 * 64 * 4),
        # DeepSeek-V3: deepseek_yarn, 4,096 × 40 rows of qk_rope_head_dim 64
        ("deepseek-v3-tp8-pp2.yaml", 163_840 * 64 * 2, 163_840 * 64 * 4),
        # Phi-3-mini-4k: default rope, 4,096 rows, head_dim 96
        ("phi-3-mini-tp2.yaml", 4_096 * 96 * 2, 4_096 * 96 * 4),
        # Phi-2: partial_rotary_factor 0.4 of head_dim 80 → 32 columns, 2,048 rows, float16
        ("phi-2-tp2.yaml", 2_048 * 32 * 2, 2_048 * 32 * 4),
        # Falcon-40B: rotary (alibi false), 2,048 rows, head_dim 64
        ("falcon-40b-tp8.yaml", 2_048 * 64 * 2, 2_048 * 64 * 4),
        # GPT-2: learned positions, no table
        ("gpt2-tp1.yaml", 0, 0),
    ],
)
def test_table_sizes_follow_get_rope(manifest: str, vllm: int, sglang: int) -> None:
    model = _model(manifest)
    assert rotary_cache_bytes(model, 2, engine="vllm") == vllm
    assert rotary_cache_bytes(model, 2, engine="sglang") == sglang


def test_rope_types_and_their_rows() -> None:
    dims = ModelDims(4096, 2, 32, 8, 128, 1024, 1000, False, max_position_embeddings=8192)

    def size(config: dict[str, Any], arch: str = "llama") -> int:
        return rotary_cache_bytes(ModelInfo(arch, dims, (), "BF16", "config", config), 2,
                                  engine="vllm")  # fmt: skip

    row = 128 * 2
    assert size({}) == 8192 * row  # dims' max_position_embeddings, default rope
    assert size({"max_position_embeddings": 4096}) == 4096 * row
    assert size({"rope_scaling": {"type": "linear", "factor": 2.0}}) == 16_384 * row
    assert size({"rope_scaling": {"rope_type": "dynamic", "factor": 1.5}}) == 12_288 * row
    assert size({"rope_scaling": {"rope_type": "dynamic", "alpha": 3.0}}) == 8192 * row
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    assert size({"rope_scaling": yarn}) == 8192 * row
    longrope = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    assert size({"rope_scaling": longrope, "original_max_position_embeddings": 4096}) == (
        (4096 + 8192) * row
    )
    # transformers 5: rope_parameters, one per layer type → one table each
    per_type = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert size({"rope_parameters": per_type}) == (8 * 8192 + 8192) * row
    assert size({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}) == (
        8192 * 64 * 2
    )
    assert size({"rotary_pct": 0.25}, "gpt_neox") == 8192 * 32 * 2
    assert size({}, "gpt_neox") == 8192 * 32 * 2  # GPTNeoXConfig's default rotary_pct
    # a rope this module does not know, and an unknown length: nothing priced
    assert size({"rope_scaling": {"rope_type": "future", "factor": 2.0}}) == 0
    assert size({"alibi": True}, "falcon") == 0
    no_length = ModelDims(4096, 2, 32, 8, 128, 1024, 1000, False)
    assert rotary_cache_bytes(ModelInfo("llama", no_length, (), "BF16", "inline"), 2,
                              engine="vllm") == 0  # fmt: skip


def _vllm_tokens(manifest: Path) -> tuple[int, dict[str, int]]:
    done = run_cli("plan", str(manifest), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return out["kv_cache"]["capacity_tokens_per_rank"], out["memory_model"]["detail_per_stage"][0]


def test_llama4_scout_tp4_h100_vllm_019_row(tmp_path: Path) -> None:
    # llm-d-incubation/llm-d-planner accuracy/results/v0.19.0/logs/
    # meta-llama-llama-4-scout--h100-80gb--tp4pp1dp1--8192.log (commit d3121e05): vllm serve
    # meta-llama/Llama-4-Scout-17B-16E-Instruct --tensor-parallel-size 4 --max-model-len 8192
    # --gpu-memory-utilization 0.95: "Model loading took 53.12 GiB", "torch peak memory
    # increase: 3.19GiB", "non-torch forward increase memory: 2.17GiB", "Available KV cache
    # memory: 16.75 GiB", "GPU KV cache size: 365,968 tokens". The weights are 50.59 GiB per
    # rank; the other 2.5 GiB is the rotary table of 10,485,760 positions. Without it shardctl
    # gave 425,568 tokens (+16.3 %).
    text = (ROOT / "manifests/llama-4-scout-mm-tp8.yaml").read_text()
    head, _, _ = text.partition("mesh: {tp: 8}")
    path = tmp_path / "scout.yaml"
    path.write_text(
        head + "mesh: {tp: 4}\nhardware: {gpu: h100-sxm}\nworkload:\n  sequence_length: 8192\n"
        '  engine: vllm\n  vllm_version: "0.19"\n  gpu_memory_utilization: 0.95\n'
    )
    tokens, detail = _vllm_tokens(path)
    assert detail["overhead.rotary_cache"] == 10_485_760 * 128 * 2
    assert abs(tokens - 365_968) <= 0.03 * 365_968, tokens


def test_qwen15_moe_a27b_h100_vllm_019_row(tmp_path: Path) -> None:
    # ...logs/qwen-qwen1-5-moe-a2-7b--h100-80gb--tp1pp1dp1--8192.log: "Model loading took
    # 26.67 GiB", peak 2.47GiB, "GPU KV cache size: 250,304 tokens". Qwen/Qwen1.5-MoE-A2.7B
    # config.json: 60 experts of 1,408, top 4, a shared expert of 5,632, 8,192 positions.
    path = tmp_path / "qmoe.yaml"
    config = {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    workload = {"sequence_length": 8192, "engine": "vllm", "vllm_version": "0.19",
                "gpu_memory_utilization": 0.95}  # fmt: skip
    doc = {"model": config, "mesh": {"tp": 1}, "hardware": {"gpu": "h100-sxm"},
           "workload": workload}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    tokens, detail = _vllm_tokens(path)
    assert detail["overhead.rotary_cache"] == 8192 * 128 * 2
    assert abs(tokens - 250_304) <= 0.03 * 250_304, tokens


def test_same_weights_longer_table_is_the_logged_difference() -> None:
    # Kimi-Dev-72B is Qwen2.5-72B's shapes with 131,072 positions instead of 32,768. vLLM 0.19
    # at tp 2 (same sweep): "Model loading took 67.82 GiB" against 67.8 — the tables differ by
    # (131,072 − 32,768) × 128 × 2 B = 24 MiB = 0.023 GiB.
    def table(positions: int) -> int:
        dims = ModelDims(8192, 80, 64, 8, 128, 29568, 152064, False,
                         max_position_embeddings=positions)  # fmt: skip
        return rotary_cache_bytes(ModelInfo("qwen2", dims, (), "BF16", "inline"), 2,
                                  engine="vllm")  # fmt: skip

    assert table(131_072) - table(32_768) == 24 * MIB
    assert round((table(131_072) - table(32_768)) / 2**30, 2) == round(67.82 - 67.8, 2)


def test_the_table_reaches_every_engine_that_builds_one() -> None:
    dims = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False, max_position_embeddings=131072)
    model = ModelInfo("llama", dims, (), "BF16", "inline")
    h100 = HardwareSpec.preset("h100-sxm")

    def item(engine: str) -> int | None:
        plan = estimate(model, Mesh(), split_layers(32, 1), hardware=h100,
                        workload=Workload(sequence_length=8192, engine=engine))  # fmt: skip
        return plan.coords[(0, 0, 0)].detail.get("overhead.rotary_cache")

    assert item("vllm") == 131_072 * 128 * 2
    assert item("sglang") == 131_072 * 128 * 4
    # transformers computes rope per step from inv_freq: no table; TRT-LLM not modelled
    assert item("hf") is None and item("trtllm") is None


# -- the engines' length check (plan/memory/context_length.py) -----------------------------


def _phi2(tmp_path: Path, length: int, engine: str = "vllm") -> Path:
    text = (ROOT / "manifests/phi-2-tp2.yaml").read_text()
    head, _, _ = text.partition("mesh: {tp: 2}")
    version = '\n  vllm_version: "0.19"' if engine == "vllm" else ""
    path = tmp_path / f"phi2-{engine}-{length}.yaml"
    path.write_text(
        head + "mesh: {tp: 1}\nhardware: {gpu: h100-sxm}\nworkload:\n"
        f"  sequence_length: {length}\n  engine: {engine}{version}\n"
    )
    return path


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_length_past_the_models_positions_does_not_fit(tmp_path: Path, engine: str) -> None:
    # llm-d-planner's vLLM 0.19 sweep: microsoft/phi-2 (max_position_embeddings 2048) with
    # --max-model-len 8192 did not start ("User-specified max_model_len (8192) is greater
    # than the derived max_model_len (max_position_embeddings=2048.0 ...)"); at 2048 it did.
    # shardctl said "fits" for both before this check.
    long = run_cli("plan", str(_phi2(tmp_path, 8192, engine)), "--json")
    assert long.returncode == 1, long.stderr
    doc = json.loads(long.stdout)
    refusal = doc["memory_model"]["engine_refusal"]
    assert doc["fits"] is False and "2,048 positions" in refusal
    assert "max_position_embeddings" in refusal and "sequence_length" in refusal
    assert refusal in doc["memory_model"]["warnings"]
    text = run_cli("plan", str(_phi2(tmp_path, 8192, engine)))
    assert text.returncode == 1 and "does not fit: " + engine + " refuses" in text.stdout
    # the search agrees: no layout is priced, each rejected for the length
    found = run_cli("plan", str(_phi2(tmp_path, 8192, engine)), "--search", "--json")
    assert found.returncode == 1, found.stderr
    got = json.loads(found.stdout)
    assert got["candidates"] == [] and got["rejected"]["engine_refuses_length"] > 0
    short = run_cli("plan", str(_phi2(tmp_path, 2048, engine)), "--json")
    assert (
        short.returncode == 0 and json.loads(short.stdout)["memory_model"]["engine_refusal"] is None
    )


def test_derived_length_follows_vllm() -> None:
    from shardctl.plan.memory.context_length import derived_max_len, refusal

    def derived(config: dict[str, Any], arch: str = "llama") -> float | None:
        got = derived_max_len(ModelInfo(arch, None, (), "BF16", "config", config))
        return None if got is None else got[0]

    assert derived({"max_position_embeddings": 4096}) == 4096
    assert derived({"max_position_embeddings": 4096, "seq_length": 2048}) == 2048  # smallest
    assert derived({"max_position_embeddings": 4096, "model_max_length": 16384}) == 16384
    assert derived({}) is None  # no key: vLLM takes the user's length
    # llama3 keeps the length; linear multiplies; yarn starts from the original length
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert derived({"max_position_embeddings": 131072, "rope_scaling": llama3}) == 131072
    linear = {"rope_type": "linear", "factor": 4.0}
    assert derived({"max_position_embeddings": 4096, "rope_scaling": linear}) == 16384
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert derived({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072
    # Gemma-3's length is already scaled
    gemma3 = {"max_position_embeddings": 131072, "rope_scaling": linear}
    assert derived(gemma3, "gemma3_text") == 131072
    # a multimodal config: the language model's section
    assert derived({"text_config": {"max_position_embeddings": 10_485_760}}, "llama4") == 10_485_760
    # the refusal names the key and the override; other engines and lengths within: none
    model = ModelInfo("phi", None, (), "F16", "config", {"max_position_embeddings": 2048})
    why = refusal(model, "vllm", 2049)
    assert why is not None and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in why
    assert refusal(model, "vllm", 2048) is None and refusal(model, "hf", 8192) is None
    assert refusal(model, "trtllm", 8192) is None


def test_refusal_without_a_budget_is_still_a_verdict(tmp_path: Path) -> None:
    # No device memory, so no memory verdict, but the engine would not start: exit 1, said once.
    path = _phi2(tmp_path, 8192)
    path.write_text(path.read_text().replace("hardware: {gpu: h100-sxm}\n", ""))
    done = run_cli("plan", str(path))
    assert done.returncode == 1, done.stderr
    assert "does not fit: vllm refuses to start" in done.stdout
    assert "no verdict" not in done.stdout


def test_sglang_derives_its_length_its_own_way() -> None:
    from shardctl.plan.memory.context_length import derived_max_len, refusal

    def both(config: dict[str, Any], arch: str = "qwen2") -> tuple[float | None, float | None]:
        model = ModelInfo(arch, None, (), "BF16", "config", config)
        got = [derived_max_len(model, e) for e in ("vllm", "sglang")]
        return (None if got[0] is None else got[0][0], None if got[1] is None else got[1][0])

    # Qwen2.5 with yarn × 4: vLLM 32,768 × 4; SGLang keeps 32,768 (original named in the rope)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert both({"max_position_embeddings": 32768, "rope_scaling": yarn}) == (131072, 32768)
    # the first key in SGLang's order, the smallest in vLLM's
    assert both({"max_position_embeddings": 4096, "seq_length": 8192}) == (4096, 8192)
    # Gemma-3's linear factor: skipped by vLLM, applied by SGLang
    linear = {"rope_type": "linear", "factor": 8.0}
    assert both({"max_position_embeddings": 131072, "rope_scaling": linear}, "gemma3_text") == (
        131072,
        1_048_576,
    )
    model = ModelInfo("qwen2", None, (), "BF16", "config",
                      {"max_position_embeddings": 32768, "rope_scaling": yarn})  # fmt: skip
    assert refusal(model, "vllm", 65536) is None
    why = refusal(model, "sglang", 65536)
    assert why is not None and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in why
