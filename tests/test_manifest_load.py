"""The manifest's happy paths: every section parsed, normalized and defaulted as documented."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardctl.errors import ManifestError
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.manifest import (
    HardwareSpec,
    Manifest,
    QuantSpec,
    TrainingSpec,
    Workload,
    load_manifest,
    parse_manifest,
)
from shardctl.manifest.model import DEFAULT_KEEP_16BIT

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))


def parse(text: str, base_dir: Path = ROOT) -> Manifest:
    return parse_manifest(text, base_dir=base_dir, source="t.yaml")


def test_minimal_manifest_gets_documented_defaults() -> None:
    m = parse("model: {parameters: 7.5e9}\n")
    assert m.model.parameters == 7_500_000_000
    assert m.model.source == "parameters"
    assert m.mesh == Mesh()
    assert m.hardware == HardwareSpec()
    assert m.layout == LayoutOptions() and m.pipeline is m.layout
    assert m.rules == ()
    assert m.workload == Workload()
    assert m.workload.gpu_memory_utilization == 0.9 and m.workload.flash_attention
    assert m.training is None and m.quantization is None
    assert dict(m.overhead) == {}
    assert m.path is None


def test_manifest_is_frozen() -> None:
    m = parse("model: {parameters: 1000}\n")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.mesh = Mesh(tp=2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.model.inline_config["x"] = 1  # type: ignore[index]


def test_mesh_omitted_axes_are_one() -> None:
    assert parse("model: {parameters: 1000}\nmesh: {pp: 2, tp: 8}\n").mesh == Mesh(pp=2, tp=8)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("80 GB", 80 * 10**9),
        ("85899345920", 85_899_345_920),
        ("8.5e10", 85_000_000_000),
        ("'24 GiB'", 24 * 2**30),
        ("0.5TiB", 2**39),
    ],
)
def test_device_memory_units(text: str, expected: int) -> None:
    m = parse(f"model: {{parameters: 1000}}\nhardware: {{device_memory: {text}}}\n")
    assert m.hardware.device_memory == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("450GB/s", 450 * 10**9),
        ("400Gb/s", 50 * 10**9),
        ("400Gbps", 50 * 10**9),
        ("25GiB/s", 25 * 2**30),
        ("50000000000", 5 * 10**10),
        ("1.5e11", 150 * 10**9),
    ],
)
def test_bandwidth_units(text: str, expected: int) -> None:
    m = parse(f"model: {{parameters: 1000}}\nhardware: {{inter_node_bandwidth: {text}}}\n")
    assert m.hardware.inter_node_bandwidth == expected


def test_gpu_preset_fills_what_is_not_given() -> None:
    m = parse("model: {parameters: 1000}\nhardware: {gpu: H100, intra_node_bandwidth: 400GB/s}\n")
    assert m.hardware.gpu == "h100-sxm"
    assert m.hardware.device_memory == 80 * 2**30
    assert m.hardware.intra_node_bandwidth == 400 * 10**9  # the manifest wins
    assert m.hardware.inter_node_bandwidth == 50 * 10**9  # the preset fills
    explicit = parse("model: {parameters: 1000}\nhardware: {gpu: mi300x, device_memory: 180GiB}\n")
    assert explicit.hardware.device_memory == 180 * 2**30
    assert parse("model: {parameters: 1}\nhardware: {gpu: h200}\n").hardware.device_memory == (
        141 * 2**30
    )


def test_hardware_counts() -> None:
    m = parse(
        "model: {parameters: 1000}\n"
        "hardware: {gpus_per_node: 4, nodes: 3, allow_tp_across_nodes: true}\n"
    )
    assert (m.hardware.gpus_per_node, m.hardware.nodes, m.hardware.gpus) == (4, 3, 12)
    assert m.hardware.allow_tp_across_nodes is True


def test_pipeline_and_layout_sections_feed_layout_options() -> None:
    m = parse(
        "model: {parameters: 1000}\nmesh: {pp: 3}\n"
        "pipeline: {convention: megatron, layers_per_stage: [10, 11, 11]}\n"
        "layout: {vocab_padding: megatron, uneven: chunk}\n"
    )
    assert m.layout == LayoutOptions("megatron", (10, 11, 11), "megatron", "chunk")
    assert parse("model: {parameters: 1}\npipeline: {layers_per_stage: null}\n").layout == (
        LayoutOptions()
    )


def test_rules_are_parsed_in_order_and_normalized() -> None:
    m = parse(
        "model: {parameters: 1000}\n"
        "rules:\n"
        "  - {match: 'model.layers.*.self_attn.qkv_proj.weight', tp: colwise, parts: [q, kv, kv],"
        " heads: q}\n"
        "  - {match: 'lm_head.weight', tp: 'Shard(0)', stage: last}\n"
        "  - {match: 'model.norm.weight', tp: Replicate()}\n"
        "  - {match: '*.experts.*', expert: true, tp: S(1)}\n"
        "  - {match: 'x', parts: [4096, 1024, 1024], tp: S(0)}\n"
    )
    assert m.rules == (
        RuleSpec("model.layers.*.self_attn.qkv_proj.weight", "colwise", ("q", "kv", "kv"), "q"),
        RuleSpec("lm_head.weight", "S(0)", stage="last"),
        RuleSpec("model.norm.weight", "R"),
        RuleSpec("*.experts.*", "S(1)", expert=True),
        RuleSpec("x", "S(0)", (4096, 1024, 1024)),
    )


def test_workload_inference() -> None:
    m = parse(
        "model: {parameters: 1000}\n"
        "workload: {batch_size: 32, sequence_length: 8192, kv_cache_dtype: fp8,\n"
        "           gpu_memory_utilization: 0.95, flash_attention: false}\n"
    )
    assert m.workload == Workload(32, 8192, "F8_E4M3", 0.95, False)
    assert m.mode == "inference"
    assert m.training is None
    auto = parse("model: {parameters: 1}\nworkload: {kv_cache_dtype: auto}\n")
    assert auto.workload.kv_cache_dtype is None


def test_training_section_implies_training_mode_and_accepts_fsdp_names() -> None:
    m = parse(
        "model: {parameters: 1000}\n"
        "training: {zero: HYBRID_SHARD, optimizer: adamw-8bit, offload_optimizer: cpu,\n"
        "           recompute: full, sequence_parallel: true, master_weights: false,\n"
        "           grad_dtype: float32, pipeline_schedule: gpipe, num_microbatches: 8}\n"
    )
    assert m.mode == "training"
    assert m.training == TrainingSpec(
        optimizer="adamw-8bit",
        zero=3,
        offload_optimizer="cpu",
        offload_params="none",
        recompute="full",
        sequence_parallel=True,
        master_weights=False,
        grad_dtype="F32",
        pipeline_schedule="gpipe",
        grad_accumulation_steps=8,  # num_microbatches
        global_batch_size=8,  # micro-batch 1 × 8 × dp 1
        sequence_length=0,  # the workload's
    )


@pytest.mark.parametrize(
    ("name", "stage"),
    [("NO_SHARD", 0), ("SHARD_GRAD_OP", 2), ("FULL_SHARD", 3), ("HYBRID_SHARD", 3), ("2", 2)],
)
def test_zero_names(name: str, stage: int) -> None:
    m = parse(f"model: {{parameters: 1}}\ntraining: {{zero: {name}}}\n")
    assert m.training is not None and m.training.zero == stage


def test_training_mode_without_section_gets_defaults() -> None:
    m = parse("model: {parameters: 1000}\nworkload: {mode: training, micro_batch_size: 2}\n")
    assert m.training == TrainingSpec(micro_batch_size=2, global_batch_size=2, sequence_length=0)


def test_quantization_defaults_per_method() -> None:
    def quant(body: str) -> QuantSpec | None:
        return parse(f"model: {{parameters: 1}}\nquantization: {{{body}}}\n").quantization

    assert quant("method: int4") == QuantSpec("int4", 128)
    assert quant("method: nf4, double_quant: true") == QuantSpec("nf4", 64, double_quant=True)
    assert quant("method: mxfp4") == QuantSpec("mxfp4", 32)
    assert quant("method: nvfp4") == QuantSpec("nvfp4", 16)
    assert quant("method: fp8") == QuantSpec("fp8", 0)
    assert quant("method: fp8, fp8_scaling: block") == QuantSpec("fp8", 128, fp8_scaling="block")
    assert quant("method: int4, group_size: 64, keep_16bit: ['lm_head.*']") == QuantSpec(
        "int4", 64, keep_16bit=("lm_head.*",)
    )
    assert quant("method: none") is None
    assert QuantSpec("int8", 0).keep_16bit == DEFAULT_KEEP_16BIT


def test_overhead_named_overrides() -> None:
    m = parse(
        "model: {parameters: 1}\n"
        "overhead: {cuda_context: 1GiB, nccl_buffers: 536870912, fragmentation: 0.05}\n"
    )
    assert dict(m.overhead) == {"cuda_context": 2**30, "nccl_buffers": 2**29, "fragmentation": 0.05}


def test_inline_config_is_frozen_data_with_yaml12_scalars() -> None:
    m = parse(
        "model:\n"
        "  model_type: mistral\n  hidden_size: 64\n  rms_norm_eps: 1e-05\n"
        "  rope_scaling: {rope_type: llama3, factor: 8.0}\n  architectures: [LlamaForCausalLM]\n"
        "  sliding_window: null\n  tie_word_embeddings: false\n  _name_or_path: '010'\n"
        "  dtype: bf16\n"
    )
    spec = m.model
    assert spec.source == "inline" and spec.dtype == "BF16"
    assert spec.inline_config["rms_norm_eps"] == 1e-05
    assert spec.inline_config["rope_scaling"]["factor"] == 8.0
    assert spec.inline_config["architectures"] == ("LlamaForCausalLM",)
    assert spec.inline_config["sliding_window"] is None
    assert spec.inline_config["tie_word_embeddings"] is False
    assert spec.inline_config["_name_or_path"] == "010"  # quoted: a string
    assert "dtype" not in spec.inline_config  # a manifest key, not a config field
    plain = spec.config_dict()
    json.dumps(plain)  # JSON-ready, as json.load would give
    assert plain["architectures"] == ["LlamaForCausalLM"]


def test_relative_paths_resolve_against_the_manifest_folder(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    manifest = tmp_path / "sub" / "m.yaml"
    manifest.parent.mkdir()
    manifest.write_text("model: {config: ../cfg/config.json, dtype: float16}\n")
    m = load_manifest(manifest)
    assert m.model.config == tmp_path / "cfg" / "config.json"
    assert m.model.dtype == "F16"
    assert m.path == manifest.resolve()
    manifest.write_text("model: {checkpoint: ../ckpt}\n")
    assert load_manifest(manifest).model.checkpoint == tmp_path / "ckpt"
    assert parse_manifest("model: {checkpoint: ckpt}\n", base_dir=tmp_path).model.checkpoint == (
        tmp_path / "ckpt"
    )


def test_missing_paths_name_the_resolved_path(tmp_path: Path) -> None:
    with pytest.raises(
        ManifestError,
        match=r"model\.config: no such file: .*nope\.json.* "
        r"\(line 1\)",
    ):
        parse_manifest("model: {config: nope.json}\n", base_dir=tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ManifestError, match=r"model\.checkpoint: expected a directory"):
        parse_manifest("model: {checkpoint: f}\n", base_dir=tmp_path)


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodel: {parameters: 1000}\n")
    assert load_manifest(path).model.parameters == 1000


# ----------------------------------------------------------------------------- bundled manifests
def test_every_bundled_manifest_loads() -> None:
    assert len(MANIFESTS) >= 8
    for path in MANIFESTS:
        m = load_manifest(path)
        assert m.model.source == "inline", path.name
        assert m.hardware.device_memory is not None, path.name


def _inline(name: str) -> dict[str, object]:
    return load_manifest(ROOT / "manifests" / name).model.config_dict()


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        (
            "llama-3-8b-tp1.yaml",
            dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=128256,
                tie_word_embeddings=False,
                torch_dtype="bfloat16",
                rope_theta=500000.0,
                max_position_embeddings=8192,
            ),
        ),
        (
            "llama-3-70b-tp8.yaml",
            dict(
                hidden_size=8192,
                num_hidden_layers=80,
                num_attention_heads=64,
                num_key_value_heads=8,
                intermediate_size=28672,
                vocab_size=128256,
            ),
        ),
        (
            "llama-3.1-405b-tp8-pp2.yaml",
            dict(
                hidden_size=16384,
                num_hidden_layers=126,
                num_attention_heads=128,
                num_key_value_heads=8,
                intermediate_size=53248,
                vocab_size=128256,
            ),
        ),
        (
            "mixtral-8x7b-tp2-ep4.yaml",
            dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=32000,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        (
            "qwen2-7b-tp4.yaml",
            dict(
                hidden_size=3584,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
                intermediate_size=18944,
                vocab_size=152064,
                tie_word_embeddings=False,
            ),
        ),
        (
            "gpt2-tp1.yaml",
            dict(
                n_embd=768,
                n_layer=12,
                n_head=12,
                vocab_size=50257,
                n_positions=1024,
                tie_word_embeddings=True,
            ),
        ),
        (
            "phi-3-mini-tp2.yaml",
            dict(
                hidden_size=3072,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                intermediate_size=8192,
                vocab_size=32064,
            ),
        ),
    ],
)
def test_bundled_manifests_hold_the_real_config_fields(
    name: str, fields: dict[str, object]
) -> None:
    config = _inline(name)
    assert {k: config[k] for k in fields} == fields


def test_bundled_layouts() -> None:
    meshes = {p.name: load_manifest(p).mesh for p in MANIFESTS}
    assert meshes["llama-3-70b-tp8.yaml"] == Mesh(tp=8)
    assert meshes["llama-3.1-405b-tp8-pp2.yaml"] == Mesh(pp=2, tp=8)
    assert meshes["mixtral-8x7b-tp2-ep4.yaml"] == Mesh(ep=4, tp=2)
    train = load_manifest(ROOT / "manifests" / "llama-3-8b-train-zero3-dp8.yaml")
    assert train.training is not None and train.training.zero == 3
    assert train.mesh == Mesh(dp=8)
    big = load_manifest(ROOT / "manifests" / "llama-3.1-405b-tp8-pp2.yaml")
    assert big.hardware.nodes == 2 and big.hardware.gpus == big.mesh.world


def test_micro_batch_defaults_to_global_over_dp() -> None:
    # Issue 15: batch 8 on dp 8 is one sequence per rank (DeepSpeed train_batch_size, Megatron
    # --global-batch-size), not eight.
    m = parse(
        "model: {parameters: 1000}\nmesh: {dp: 8}\nworkload: {mode: training, batch_size: 8}\n"
    )
    assert m.training is not None
    assert (m.training.micro_batch_size, m.training.global_batch_size) == (1, 8)
    m = parse(
        "model: {parameters: 1000}\nmesh: {dp: 2}\n"
        "workload: {mode: training, batch_size: 16, gradient_accumulation_steps: 2}\n"
    )
    assert m.training is not None and m.training.micro_batch_size == 4


def test_micro_batch_refused_when_global_does_not_divide() -> None:
    with pytest.raises(ManifestError, match=r"workload\.batch_size.*not divisible.*8 × 1 = 8"):
        parse(
            "model: {parameters: 1000}\nmesh: {dp: 8}\nworkload: {mode: training, batch_size: 12}\n"
        )
