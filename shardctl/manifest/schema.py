"""The manifest's JSON Schema (draft 2020-12), for editors and CI linters.

Built from the validator's own key lists and choices (:data:`validate.SECTION_KEYS`,
:mod:`shardctl.manifest.model`), so the two cannot drift; a test pins the committed copy in
``shardctl/schema/manifest.schema.json``. The loader stays the authority: it also refuses what a
schema cannot say (YAML 1.1 spellings, duplicate keys, anchors, cross-field rules).
"""

from __future__ import annotations

from typing import Any

from shardctl.manifest import model as m
from shardctl.manifest.fields import INLINE_POSITIVE_INTS, SECTION_KEYS
from shardctl.manifest.limits import MAX_AXIS, MAX_DIM
from shardctl.plan.memory.hardware import gpu_names
from shardctl.plan.memory.spec import MODALITIES

SCHEMA_ID = "https://shardctl.dev/schema/manifest.schema.json"
_NUMBER = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
SIZE_PATTERN = rf"^\s*{_NUMBER}\s*(?:B|kB|KB|MB|GB|TB|PB|KiB|MiB|GiB|TiB|PiB)?\s*$"
RATE_PATTERN = (
    rf"^\s*{_NUMBER}\s*(?:(?:B|kB|KB|MB|GB|TB|PB|KiB|MiB|GiB|TiB|PiB)/s|"
    r"[KMGT]b/s|[KMGT]bit/s|[KMGT]bps)?\s*$"
)
TP_PATTERN = (
    r"^\s*(?:S\(\s*[0-9]+\s*\)|Shard\(\s*[0-9]+\s*\)|R|Replicate(?:\(\))?"
    r"|colwise|rowwise|vocab)\s*$"
)
DTYPE_EXAMPLES = ["bfloat16", "float16", "float32", "fp8", "BF16"]


def _enum(choices: tuple[str, ...], doc: str) -> dict[str, Any]:
    return {"enum": list(choices), "description": doc}


def _int(doc: str, minimum: int = 1, maximum: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "minimum": minimum, "description": doc}
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _bool(doc: str) -> dict[str, Any]:
    return {"type": "boolean", "description": doc}


def _dtype(doc: str) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "description": doc, "examples": DTYPE_EXAMPLES}


def _size(doc: str) -> dict[str, Any]:
    return {"$ref": "#/$defs/size", "description": doc}


def _rate(doc: str) -> dict[str, Any]:
    return {"$ref": "#/$defs/rate", "description": doc}


def _object(section: str, properties: dict[str, Any], doc: str) -> dict[str, Any]:
    assert tuple(properties) == SECTION_KEYS[section], f"schema out of sync for {section}"
    return {
        "type": "object",
        "description": doc,
        "properties": properties,
        "additionalProperties": False,
    }


def _model() -> dict[str, Any]:
    inline = {
        key: {
            **_int(f"HF config field {key} (null: derived)", 1, MAX_DIM),
            "type": ["integer", "null"],
        }
        for key in INLINE_POSITIVE_INTS
    }
    return {
        "type": "object",
        "description": "The model: exactly one of config, checkpoint, parameters, or inline HF "
        "config fields (model_type plus the config.json fields).",
        "properties": {
            "config": {
                "type": "string",
                "minLength": 1,
                "description": "Path to an HF config.json (relative to this file).",
            },
            "checkpoint": {
                "type": "string",
                "minLength": 1,
                "description": "Path to an HF checkpoint directory (exact, from "
                "safetensors headers).",
            },
            "parameters": {
                "description": "A bare parameter count for what-if planning, e.g. 7.5e9 "
                "(scientific notation allowed; must be a whole number).",
                "anyOf": [
                    {"type": "integer", "minimum": 1},
                    {"type": "number", "exclusiveMinimum": 0},
                    {"type": "string", "pattern": rf"^\s*{_NUMBER}\s*$"},
                ],
            },
            "dtype": _dtype("Weight dtype; default: the config's torch_dtype."),
            "model_type": {
                "type": "string",
                "minLength": 1,
                "description": "Inline config: the HF model_type (llama, qwen2, ...).",
            },
            **inline,
        },
        "additionalProperties": True,
        "oneOf": [
            {"required": ["config"]},
            {"required": ["checkpoint"]},
            {"required": ["parameters"]},
            {"required": ["model_type"]},
        ],
    }


def _rules() -> dict[str, Any]:
    rule = _object(
        "rules[]",
        {
            "match": {
                "type": "string",
                "minLength": 1,
                "description": "fnmatch glob on the fqn, e.g. model.layers.*.mlp.down_proj.weight",
            },
            "tp": {
                "type": "string",
                "pattern": TP_PATTERN,
                "description": "Placement on the tp axis: S(<dim>), R, colwise, rowwise or vocab.",
            },
            "parts": {
                "type": "array",
                "minItems": 2,
                "items": {
                    "anyOf": [{"type": "integer", "minimum": 1}, {"enum": list(m.RULE_PART_NAMES)}]
                },
                "description": (
                    "Fused sections along the sharded dim: sizes, q/kv/intermediate/hidden, or "
                    "equal (an equal share of what the others leave)."
                ),
            },
            "heads": _enum(m.RULE_HEADS, "The sharded dim is made of q or kv heads."),
            "stage": _enum(
                m.RULE_STAGES, "Pin a non-layer tensor to the first, last or all stages."
            ),
            "expert": _bool("The tensor is an expert weight, split over ep."),
            "groups": _enum(
                m.RULE_HEADS,
                "The parts repeat once per q or kv head (interleaved fused qkv: GPT-NeoX, Falcon).",
            ),
        },
        "An override rule; rules are ordered and the first match wins.",
    )
    rule["required"] = ["match"]
    rule["anyOf"] = [{"required": [k]} for k in SECTION_KEYS["rules[]"] if k != "match"]
    return {
        "type": "array",
        "items": rule,
        "description": "Placement overrides, before the architecture preset's rules.",
    }


def _mesh_section() -> dict[str, Any]:
    return _object(
        "mesh",
        {
            **{
                axis: _int(f"Degree of the {axis} axis (default 1).", 1, MAX_AXIS)
                for axis in SECTION_KEYS["mesh"]
                if axis != "expert_placement"
            },
            "expert_placement": _enum(
                m.EXPERT_PLACEMENTS,
                "separate (default): ep is its own mesh axis; shared: experts spread over "
                "the tp x dp ranks of attention, ep = tp x dp (vLLM "
                "--enable-expert-parallel, Megatron expert groups over dp).",
            ),
        },
        "Device mesh, outer to inner pp, dp, ep, tp; omitted axes are 1.",
    )


def _hardware_section() -> dict[str, Any]:
    return _object(
        "hardware",
        {
            "device_memory": _size("Memory per GPU: 80GiB (2^30), 80GB (10^9) or bytes."),
            "gpus_per_node": _int("GPUs per node (default 8).", 1, 1024),
            "nodes": _int("Nodes (default 1).", 1, MAX_AXIS),
            "gpu": {
                "type": "string",
                "examples": list(gpu_names()),
                "description": "A GPU preset filling device_memory and bandwidths.",
            },
            "intra_node_bandwidth": _rate("Per GPU, per direction: 450GB/s, 400Gb/s (bits)."),
            "inter_node_bandwidth": _rate("Per GPU, per direction: 50GB/s, 400Gb/s (bits)."),
            "allow_tp_across_nodes": _bool("Let a tp group span nodes (default false)."),
        },
        "The cluster.",
    )


def _pipeline_section() -> dict[str, Any]:
    return _object(
        "pipeline",
        {
            "convention": _enum(
                m.PIPELINE_CONVENTIONS,
                "How layers split over pp stages when they don't divide evenly (default even).",
            ),
            "layers_per_stage": {
                "type": ["array", "null"],
                "items": {"type": "integer", "minimum": 0},
                "description": "Explicit layer count per stage (one per pp stage).",
            },
        },
        "Pipeline stage assignment.",
    )


def _layout_section() -> dict[str, Any]:
    return _object(
        "layout",
        {
            "vocab_padding": _enum(
                m.VOCAB_PADDING,
                "Pad the vocab to a multiple of tp (default), of 128*tp (megatron), or not at all.",
            ),
            "uneven": _enum(m.UNEVEN, "Uneven splits: error (default) or torch.chunk rule."),
        },
        "Named layout conventions where engines differ.",
    )


def _workload_section() -> dict[str, Any]:
    return _object(
        "workload",
        {
            "mode": _enum(
                m.MODES,
                "inference (default), training, or weights-only (no KV cache, no "
                "activations: said in the output).",
            ),
            "batch_size": _int("Sequences per batch (default 1)."),
            "sequence_length": _int("Tokens per sequence; 0 = weights only (default).", 0),
            "kv_cache_dtype": _dtype("KV cache dtype (default: the model's; fp8 or auto)."),
            "gpu_memory_utilization": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 1,
                "description": "Fraction of memory usable (default 0.9).",
            },
            "flash_attention": _bool("Flash attention (default true)."),
            "engine": _enum(
                m.ENGINES,
                "Memory profile: generic (default), vllm (vLLM's start-up accounting; "
                "sequence_length is then max_model_len), sglang (SGLang's token pool), "
                "trtllm (TensorRT-LLM's paged KV cache). megatron: plan also prints the "
                "shardctl reshard command writing the layout as a torch_dist checkpoint.",
            ),
            "max_num_seqs": _int(
                "vLLM max_num_seqs: sequences in the profile (256; vllm_version 0.19: 1024 "
                "on GPUs of 70 GiB or more other than A100)."
            ),
            "max_num_batched_tokens": _int(
                "vLLM max_num_batched_tokens of the profile run "
                "(default max(sequence_length, 2048))."
            ),
            "block_size": _int("vLLM KV block size in tokens (default 16)."),
            "non_torch_memory": _size("vLLM non-torch memory per rank (default: measured)."),
            "cuda_graph_memory": _size(
                "CUDA graph memory charged before the KV cache (default 0; vllm_version 0.21: "
                "vLLM's estimate, 0.84 GiB per rank unless given)."
            ),
            "mem_fraction_static": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 1,
                "description": "SGLang mem_fraction_static (default: SGLang's by tp).",
            },
            "sglang_version": {
                "enum": ["0.4", "0.5", 0.4, 0.5],
                "description": "SGLang default mem_fraction_static: 0.4 by tp (default), 0.5 by "
                "GPU memory (>= 0.5.3).",
            },
            "vllm_version": {
                "enum": ["0.2", "0.6", "0.16", "0.19", "0.21", 0.2, 0.6, 0.16, 0.19, 0.21],
                "description": "vLLM accounting: 0.6 V0 start-up profile (default), 0.2 V0 of "
                "December 2023 (all-reduce outputs kept at tp > 1), 0.16 the "
                "V1 engine as measured at 0.15-0.16, 0.19 V1 from 0.17 (non-torch from "
                "init_snapshot, vllm serve's batch defaults), 0.21 V1 from 0.21 (0.19 with the "
                "CUDA-graph estimate subtracted).",
            },
            "free_gpu_memory_fraction": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 1,
                "description": "TensorRT-LLM KV cache share of free memory (default 0.9).",
            },
            "tokens_per_block": _int("TensorRT-LLM KV block size in tokens (default 32)."),
            "mm_encoder_tp_mode": _enum(
                ("weights", "data"),
                "vLLM --mm-encoder-tp-mode: weights (default) splits a multimodal tower over "
                "tp; data replicates it on every rank (Qwen-VL and Llama-4 towers).",
            ),
            "limit_mm_per_prompt": {
                "type": "object",
                "properties": {k: {"type": "integer", "minimum": 0} for k in MODALITIES},
                "additionalProperties": False,
                "description": "vLLM --limit-mm-per-prompt, e.g. {image: 0, video: 0}: with "
                "every modality of a model's tower at 0, vLLM builds no tower (text only).",
            },
            "micro_batch_size": _int("Training micro-batch (default: batch_size)."),
            "gradient_accumulation_steps": _int("Default 1."),
        },
        "What runs on the cluster.",
    )


def _training_section() -> dict[str, Any]:
    return _object(
        "training",
        {
            "optimizer": _enum(m.OPTIMIZERS, "Default adamw."),
            "zero": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 3},
                    {"enum": list(m.ZERO_FSDP_NAMES)},
                ],
                "description": "ZeRO stage 0-3 over dp, or an FSDP sharding strategy.",
            },
            "offload_optimizer": _enum(m.OFFLOAD, "Default none; needs zero>=1 (nvme: 3)."),
            "offload_params": _enum(m.OFFLOAD, "Default none; needs zero 3."),
            "recompute": _enum(m.RECOMPUTE, "Activation recomputation (default none)."),
            "sequence_parallel": _bool("Megatron sequence parallelism (default false)."),
            "master_weights": _bool("fp32 master weights (default true)."),
            "grad_dtype": _dtype("Gradient dtype (default: the model's)."),
            "pipeline_schedule": _enum(
                m.PIPELINE_SCHEDULES, "Default 1f1b; interleaved needs virtual_stages."
            ),
            "virtual_stages": _int(
                "Model chunks per pipeline rank for the interleaved schedule (Megatron "
                "--num-virtual-stages-per-pipeline-rank), >= 2."
            ),
            "recompute_layers": {
                "type": "integer",
                "minimum": 0,
                "description": "With recompute: full, recompute only the first N layers of "
                "each stage (Megatron --recompute-method block --recompute-num-layers N).",
            },
            "num_microbatches": _int(
                "Microbatches per step (default: gradient_accumulation_steps)."
            ),
            "lora_rank": {
                "type": "integer",
                "minimum": 0,
                "description": "LoRA adapter rank; the base is frozen (with quantization.method"
                ": nf4, QLoRA). Default 0: full fine-tuning.",
            },
            "lora_targets": _enum(m.LORA_TARGETS, "Adapted linears (PEFT target_modules)."),
        },
        "Training states; giving this section implies workload.mode: training.",
    )


def _quantization_section() -> dict[str, Any]:
    return {
        **_object(
            "quantization",
            {
                "method": _enum(m.QUANT_METHODS, "Weight quantization method."),
                "group_size": _int(
                    "Elements per scale group; 0 = per channel/tensor. Default per "
                    "method: int4 128, nf4 64, mxfp4 32, nvfp4 16.",
                    0,
                ),
                "double_quant": _bool("nf4 double quantization (default false)."),
                "fp8_scaling": _enum(
                    m.FP8_SCALING,
                    "fp8 scales per tensor (default), per output row (channel: FBGEMM) "
                    "or 128x128 block.",
                ),
                "keep_16bit": {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "description": "fqn globs (fnmatch on full tensor names, any tensor) left "
                    "in 16-bit; a glob that matches nothing is refused; default: "
                    + ", ".join(m.DEFAULT_KEEP_16BIT),
                },
                "overrides": {
                    "type": "array",
                    "description": "Per-tensor formats, first match wins (before keep_16bit "
                    "and method): e.g. {match: '*.self_attn.*', dtype: bf16}, {match: "
                    "'model.layers.0.*', method: none}, {match: '*.mlp.experts.*', method: "
                    "mxfp4}. A match that names no tensor is refused.",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["match"],
                        "properties": {
                            "match": {"type": "string", "minLength": 1},
                            "method": _enum(
                                m.QUANT_METHODS, "Weight format (none: as stored, 16-bit)."
                            ),
                            "dtype": _enum(
                                ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32"),
                                "Dense dtype.",
                            ),
                            "group_size": _int("Elements per scale group.", 0),
                            "fp8_scaling": _enum(m.FP8_SCALING, "fp8 scale granularity."),
                        },
                        "oneOf": [{"required": ["method"]}, {"required": ["dtype"]}],
                    },
                },
            },
            "Quantized weights.",
        ),
        "required": ["method"],
    }


def _overhead_section() -> dict[str, Any]:
    return _object(
        "overhead",
        {
            **{k: _size(f"Override of the {k} overhead (bytes).") for k in m.OVERHEAD_SIZES},
            **{
                k: {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 0.99,
                    "description": f"Override of the {k} fraction.",
                }
                for k in m.OVERHEAD_FRACTIONS
            },
        },
        "Named overrides of the memory model's runtime overheads.",
    )


def _sections() -> dict[str, Any]:
    return {
        "model": _model(),
        "mesh": _mesh_section(),
        "hardware": _hardware_section(),
        "pipeline": _pipeline_section(),
        "layout": _layout_section(),
        "rules": _rules(),
        "workload": _workload_section(),
        "training": _training_section(),
        "quantization": _quantization_section(),
        "overhead": _overhead_section(),
    }


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema of a shardctl manifest (a fresh dict on every call)."""
    sections = _sections()
    assert tuple(sections) == SECTION_KEYS[""], "schema out of sync with the top-level keys"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "shardctl manifest",
        "description": "Model, mesh, hardware and workload for shardctl plan. Generated by "
        "`shardctl schema`.",
        "type": "object",
        "required": ["model"],
        "properties": sections,
        "additionalProperties": False,
        "$defs": {
            "size": {
                "anyOf": [
                    {"type": "integer", "minimum": 0},
                    {"type": "number", "minimum": 0},
                    {"type": "string", "pattern": SIZE_PATTERN},
                ]
            },
            "rate": {
                "anyOf": [
                    {"type": "integer", "minimum": 1},
                    {"type": "number", "exclusiveMinimum": 0},
                    {"type": "string", "pattern": RATE_PATTERN},
                ]
            },
        },
    }
