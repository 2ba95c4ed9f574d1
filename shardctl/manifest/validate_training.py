"""The ``workload:``, ``training:``, ``quantization:`` and ``overhead:`` sections."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardctl.manifest import model as m
from shardctl.manifest.fields import Problems, enum, read_dtype, read_positive
from shardctl.manifest.values import (
    Invalid,
    describe,
    read_bool,
    read_float,
    read_int,
    read_size,
    read_str,
)
from shardctl.manifest.yamlstrict import Map, Node, Scalar, Seq
from shardctl.plan.memory.spec import MODALITIES, QuantSpec, TrainingSpec, Workload


@dataclass(frozen=True)
class WorkloadKeys:
    """The ``workload:`` section: the memory model's :class:`Workload`, the mode, and the keys
    only a training step uses (they go into its :class:`TrainingSpec`)."""

    workload: Workload
    mode: str
    micro_batch_size: int | None
    gradient_accumulation_steps: int
    # Whether the manifest gave these (with ``micro_batch_size`` they fix the accumulation).
    batch_given: bool = False
    steps_given: bool = False


def read_workload(section: Map | None, training: bool, problems: Problems) -> WorkloadKeys:
    default_mode = "training" if training else "inference"
    if section is None:
        return WorkloadKeys(Workload(), default_mode, None, 1)
    problems.keys(section, "workload")
    get, path = problems.get, "workload"
    mode = get(section, "mode", path, enum(m.MODES), default_mode)
    if training and mode in ("inference", "weights-only"):
        problems.add(
            Invalid(
                "workload.mode",
                f"is {mode} but a training: section is given",
                section.entries["mode"].line,
                "set mode: training, or remove the training section",
            )
        )
    workload = Workload(
        batch_size=get(section, "batch_size", path, read_positive, 1),
        sequence_length=get(
            section,
            "sequence_length",
            path,
            lambda n, p: read_int(n, p, minimum=0, maximum=2**31),
            0,
        ),
        kv_cache_dtype=get(section, "kv_cache_dtype", path, _kvread_dtype, None),
        gpu_memory_utilization=get(
            section,
            "gpu_memory_utilization",
            path,
            lambda n, p: read_float(n, p, minimum=0.0, maximum=1.0, exclusive_minimum=True),
            0.9,
        ),
        flash_attention=get(section, "flash_attention", path, read_bool, True),
        engine=get(section, "engine", path, enum(m.ENGINES), "generic"),
        max_num_seqs=get(section, "max_num_seqs", path, read_positive, None),
        block_size=get(section, "block_size", path, read_positive, 16),
        profile_tokens=get(section, "max_num_batched_tokens", path, read_positive, None),
        non_torch_memory=get(section, "non_torch_memory", path, read_size, None),
        cuda_graph_memory=get(section, "cuda_graph_memory", path, read_size, None),
        mem_fraction_static=get(section, "mem_fraction_static", path, _fraction, None),
        sglang_version=get(section, "sglang_version", path, enum(("0.4", "0.5")), "0.4"),
        vllm_version=get(
            section, "vllm_version", path, enum(("0.2", "0.6", "0.16", "0.19", "0.21")), "0.6"
        ),
        free_gpu_memory_fraction=get(section, "free_gpu_memory_fraction", path, _fraction, 0.9),
        tokens_per_block=get(section, "tokens_per_block", path, read_positive, 32),
        mm_encoder_tp_mode=get(
            section, "mm_encoder_tp_mode", path, enum(("weights", "data")), "weights"
        ),
        limit_mm_per_prompt=get(section, "limit_mm_per_prompt", path, _limits, ()),
        only_weights=mode == "weights-only",
    )
    return WorkloadKeys(
        workload,
        mode,
        get(section, "micro_batch_size", path, read_positive, None),
        get(section, "gradient_accumulation_steps", path, read_positive, 1),
        batch_given="batch_size" in section.entries,
        steps_given="gradient_accumulation_steps" in section.entries,
    )


def _limits(node: Node, path: str) -> tuple[tuple[str, int], ...]:
    """vLLM ``--limit-mm-per-prompt``: a mapping of modality to items per prompt."""
    if not isinstance(node, Map):
        raise Invalid(
            path,
            f"expected a mapping of modality to items, e.g. {{image: 0, video: 0}}; got "
            f"{describe(node)}",
            node.line,
        )
    out: list[tuple[str, int]] = []
    for key, value in node.entries.items():
        where = f"{path}.{key}"
        if key not in MODALITIES:
            choices = ", ".join(MODALITIES)
            raise Invalid(where, f"is not a modality ({choices})", node.key_lines[key])
        out.append((key, read_int(value, where, minimum=0)))
    return tuple(out)


def _fraction(node: Node, path: str) -> float:
    return read_float(node, path, minimum=0.0, maximum=1.0, exclusive_minimum=True)


def _kvread_dtype(node: Node, path: str) -> str | None:
    if isinstance(node, Scalar) and node.text == "auto":
        return None  # vLLM's spelling for "same as the model"
    return read_dtype(node, path)


def _micro_per_rank(keys: WorkloadKeys, dp: int, problems: Problems) -> int:
    """Without ``micro_batch_size``, ``batch_size`` is the global batch: each dp rank runs
    ``batch_size / (dp × gradient_accumulation_steps)`` sequences per micro-batch (what
    DeepSpeed's ``train_batch_size`` and Megatron's ``--global-batch-size`` mean). Batch 8 on
    dp 8 is one sequence per rank, not eight."""
    batch, steps = keys.workload.batch_size, keys.gradient_accumulation_steps
    if batch % (dp * steps):
        problems.add(
            Invalid(
                "workload.batch_size",
                f"is {batch}, not divisible by mesh.dp × gradient_accumulation_steps = "
                f"{dp} × {steps} = {dp * steps}",
                None,
                "set workload.micro_batch_size, or a batch_size that is a multiple of "
                f"{dp * steps}",
            )
        )
        return 1
    return batch // (dp * steps)


def _steps_from_batch(keys: WorkloadKeys, dp: int, problems: Problems) -> WorkloadKeys:
    """``batch_size`` (global) with ``micro_batch_size``: the accumulation is ``batch / (micro
    × dp)`` (Megatron's ``--global-batch-size`` with ``--micro-batch-size``); given as well, the
    three must agree. Never silently drop the global batch."""
    batch, micro = keys.workload.batch_size, keys.micro_batch_size
    assert micro is not None
    per = micro * dp
    if keys.steps_given:
        steps = keys.gradient_accumulation_steps
        if batch != per * steps:
            problems.add(
                Invalid(
                    "workload.batch_size",
                    f"is {batch}, but micro_batch_size × mesh.dp × gradient_accumulation_steps "
                    f"= {micro} × {dp} × {steps} = {per * steps}",
                    None,
                    "drop one of the three (it is derived from the others), or make them agree",
                )
            )
        return keys
    if batch % per:
        problems.add(
            Invalid(
                "workload.batch_size",
                f"is {batch}, not divisible by micro_batch_size × mesh.dp = {micro} × {dp} = {per}",
                None,
                f"use a batch_size that is a multiple of {per}",
            )
        )
        return keys
    return replace(keys, gradient_accumulation_steps=batch // per)


def read_training(
    section: Map | None, keys: WorkloadKeys, dp: int, problems: Problems, *, cp: int = 1
) -> TrainingSpec:
    """The memory model's :class:`TrainingSpec`: the ``training:`` keys, plus the micro-batch,
    accumulation, sequence length and attention kernel of ``workload:``. The global batch is
    pinned to this manifest's ``mesh.dp`` (a ``--dp`` override or the search keeps it)."""
    w = keys.workload
    micro = keys.micro_batch_size or _micro_per_rank(keys, dp, problems)
    if keys.micro_batch_size is not None and keys.batch_given:
        keys = _steps_from_batch(keys, dp, problems)
    common: dict[str, Any] = {
        "micro_batch_size": micro,
        "sequence_length": w.sequence_length,
        "flash_attention": w.flash_attention,
    }
    if section is None:
        steps = keys.gradient_accumulation_steps
        return TrainingSpec(
            grad_accumulation_steps=steps,
            global_batch_size=micro * steps * dp,
            context_parallel=cp,
            **common,
        )
    problems.keys(section, "training")
    get, path = problems.get, "training"
    zero = get(section, "zero", path, _zero, 0)
    offload_optimizer = get(section, "offload_optimizer", path, enum(m.OFFLOAD), "none")
    offload_params = get(section, "offload_params", path, enum(m.OFFLOAD), "none")
    # DeepSpeed: parameter offload and NVMe offload exist only in ZeRO-3 (ZeRO-Infinity);
    # optimizer offload (ZeRO-Offload) needs ZeRO ≥ 1.
    lines = section.key_lines
    if offload_params != "none" and zero != 3:
        problems.add(
            Invalid(
                "training.offload_params",
                f"{offload_params} offload needs zero: 3, got zero: {zero}",
                lines["offload_params"],
                "set zero: 3 (FULL_SHARD) or offload_params: none",
            )
        )
        offload_params = "none"  # the manifest is refused; keep the spec constructible
    if offload_optimizer == "nvme" and zero != 3:
        problems.add(
            Invalid(
                "training.offload_optimizer",
                f"nvme offload needs zero: 3, got zero: {zero}",
                lines["offload_optimizer"],
            )
        )
    elif offload_optimizer == "cpu" and zero == 0:
        problems.add(
            Invalid(
                "training.offload_optimizer",
                "cpu offload needs zero: 1, 2 or 3, got zero: 0",
                lines["offload_optimizer"],
            )
        )
    steps = (
        get(section, "num_microbatches", path, read_positive, None)
        or keys.gradient_accumulation_steps
    )
    recompute = get(section, "recompute", path, enum(m.RECOMPUTE), "none")
    schedule = get(section, "pipeline_schedule", path, enum(m.PIPELINE_SCHEDULES), "1f1b")
    virtual = get(section, "virtual_stages", path, read_positive, None)
    if (schedule == "interleaved") != (virtual is not None and virtual > 1):
        problems.add(
            Invalid(
                "training.virtual_stages",
                f"pipeline_schedule: {schedule} with virtual_stages: {virtual}: the interleaved "
                "schedule needs virtual_stages >= 2, and virtual_stages needs it",
                lines.get("virtual_stages", lines.get("pipeline_schedule")),
                "set pipeline_schedule: interleaved and virtual_stages: 2 (or more), or drop "
                "virtual_stages",
            )
        )
        schedule, virtual = "1f1b", None  # the manifest is refused; keep the spec constructible
    recompute_layers = get(
        section, "recompute_layers", path, lambda n, p: read_int(n, p, minimum=0), None
    )
    if recompute_layers is not None and recompute != "full":
        problems.add(
            Invalid(
                "training.recompute_layers",
                f"recompute_layers needs recompute: full, got recompute: {recompute}",
                lines["recompute_layers"],
                "set recompute: full (Megatron --recompute-method block), or drop recompute_layers",
            )
        )
        recompute_layers = None
    return TrainingSpec(
        optimizer=get(section, "optimizer", path, enum(m.OPTIMIZERS), "adamw"),
        zero=zero,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        recompute=recompute,
        recompute_layers=recompute_layers,
        lora_rank=get(section, "lora_rank", path, lambda n, p: read_int(n, p, minimum=0), 0),
        lora_targets=get(section, "lora_targets", path, enum(m.LORA_TARGETS), "all-linear"),
        sequence_parallel=get(section, "sequence_parallel", path, read_bool, False),
        master_weights=get(section, "master_weights", path, read_bool, True),
        grad_dtype=get(section, "grad_dtype", path, read_dtype, None),
        pipeline_schedule=schedule,
        virtual_stages=virtual or 1,
        grad_accumulation_steps=steps,
        global_batch_size=micro * steps * dp,
        context_parallel=cp,
        **common,
    )


def _zero(node: Node, path: str) -> int:
    """``0``–``3``, or an FSDP sharding strategy name."""
    if isinstance(node, Scalar) and node.text in m.ZERO_FSDP_NAMES:
        return m.ZERO_FSDP_NAMES[node.text]
    try:
        return read_int(node, path, minimum=0, maximum=3)
    except Invalid:
        names = ", ".join(m.ZERO_FSDP_NAMES)
        raise Invalid(
            path,
            f"expected a ZeRO stage 0-3 or an FSDP strategy ({names}); got {describe(node)}",
            node.line,
        ) from None


def read_quantization(section: Map | None, problems: Problems) -> QuantSpec | None:
    if section is None:
        return None
    problems.keys(section, "quantization")
    get, path = problems.get, "quantization"
    if "method" not in section.entries:
        problems.add(
            Invalid(
                path,
                "missing required key 'method'",
                section.line,
                f"one of {', '.join(m.QUANT_METHODS)}",
            )
        )
        return None
    method = get(section, "method", path, enum(m.QUANT_METHODS), "none")
    overrides = read_overrides(section.entries.get("overrides"), problems)
    if method == "none":
        for key in section.entries:
            if key not in ("method", "overrides"):
                problems.add(
                    Invalid(
                        f"{path}.{key}", "has no effect with method: none", section.key_lines[key]
                    )
                )
        # method none with overrides: a 16-bit model with some tensors in another format.
        return QuantSpec(method="none", overrides=overrides) if overrides else None
    default_group = m.DEFAULT_GROUP_SIZE[method]
    group = get(
        section,
        "group_size",
        path,
        lambda n, p: read_int(n, p, minimum=0, maximum=2**20),
        default_group,
    )
    lines = section.key_lines
    if method in ("mxfp4", "nvfp4") and group != default_group:
        problems.add(
            Invalid(
                f"{path}.group_size",
                f"{method} blocks are {default_group} elements by definition, got {group}",
                lines["group_size"],
            )
        )
    double = get(section, "double_quant", path, read_bool, False)
    if double and method != "nf4":
        problems.add(
            Invalid(
                f"{path}.double_quant", f"applies to nf4 only, not {method}", lines["double_quant"]
            )
        )
    scaling = get(section, "fp8_scaling", path, enum(m.FP8_SCALING), "tensor")
    if "fp8_scaling" in section.entries and method != "fp8":
        problems.add(
            Invalid(
                f"{path}.fp8_scaling", f"applies to fp8 only, not {method}", lines["fp8_scaling"]
            )
        )
    if method == "fp8" and scaling == "block" and "group_size" not in section.entries:
        group = m.FP8_BLOCK
    keep = get(section, "keep_16bit", path, _globs, m.DEFAULT_KEEP_16BIT)
    return QuantSpec(
        method=method,
        group_size=group,
        double_quant=double,
        fp8_scaling=scaling,
        keep_16bit=keep,
        overrides=overrides,
    )


OVERRIDE_DTYPES = ("F32", "F16", "BF16")


def read_overrides(node: Node | None, problems: Problems) -> tuple[m.QuantOverride, ...]:
    """``quantization.overrides``: a list of ``{match, method | dtype[, group_size,
    fp8_scaling]}``; the first entry whose glob matches a tensor's full name wins."""
    path = "quantization.overrides"
    if node is None:
        return ()
    if not isinstance(node, Seq):
        problems.add(
            Invalid(
                path,
                f"expected a list of {{match, method | dtype}}, got {describe(node)}",
                node.line,
            )
        )
        return ()
    out: list[m.QuantOverride] = []
    for i, item in enumerate(node.items):
        where = f"{path}[{i}]"
        if not isinstance(item, Map):
            problems.add(Invalid(where, f"expected a mapping, got {describe(item)}", item.line))
            continue
        problems.keys(item, where, "quantization.overrides[]")
        get, lines = problems.get, item.key_lines
        if "match" not in item.entries:
            problems.add(
                Invalid(where, "missing required key 'match'", item.line, 'e.g. "*.self_attn.*"')
            )
            continue
        glob = get(item, "match", where, read_str, "")
        has = [k for k in ("method", "dtype") if k in item.entries]
        if len(has) != 1:
            problems.add(
                Invalid(
                    where,
                    "expected exactly one of 'method' or 'dtype'"
                    + (", got both" if has else ", got neither"),
                    item.line,
                    "method: fp8 (a weight format, or none: as stored) or dtype: bf16",
                )
            )
            continue
        method = get(item, "method", where, enum(m.QUANT_METHODS), None)
        dtype = get(item, "dtype", where, read_dtype, None)
        if dtype is not None and dtype not in OVERRIDE_DTYPES:
            problems.add(
                Invalid(
                    f"{where}.dtype",
                    f"expected a dense dtype (bfloat16, float16, float32), got {dtype}",
                    lines["dtype"],
                    "for fp8 use method: fp8 (it stores the scales fp8 needs)",
                )
            )
            continue
        group = get(
            item,
            "group_size",
            where,
            lambda n, p: read_int(n, p, minimum=0, maximum=2**20),
            None,
        )
        scaling = get(item, "fp8_scaling", where, enum(m.FP8_SCALING), "tensor")
        for key in ("group_size", "fp8_scaling"):
            if key in item.entries and (method is None or method == "none"):
                problems.add(
                    Invalid(f"{where}.{key}", "applies to a quantizing method only", lines[key])
                )
        if "fp8_scaling" in item.entries and method not in (None, "none", "fp8"):
            problems.add(
                Invalid(
                    f"{where}.fp8_scaling",
                    f"applies to fp8 only, not {method}",
                    lines["fp8_scaling"],
                )
            )
        if method in ("mxfp4", "nvfp4") and group not in (None, m.DEFAULT_GROUP_SIZE[method]):
            problems.add(
                Invalid(
                    f"{where}.group_size",
                    f"{method} blocks are {m.DEFAULT_GROUP_SIZE[method]} elements by "
                    f"definition, got {group}",
                    lines["group_size"],
                )
            )
        if glob:
            out.append(m.QuantOverride(glob, method, dtype, group, scaling))
    return tuple(out)


def _globs(node: Node, path: str) -> tuple[str, ...]:
    if not isinstance(node, Seq):
        raise Invalid(path, f"expected a list of fqn globs, got {describe(node)}", node.line)
    return tuple(read_str(item, f"{path}[{i}]") for i, item in enumerate(node.items))


def read_overhead(section: Map | None, problems: Problems) -> dict[str, int | float]:
    if section is None:
        return {}
    problems.keys(section, "overhead")
    out: dict[str, int | float] = {}
    for key in section.entries:
        if key in m.OVERHEAD_SIZES:
            out[key] = problems.get(section, key, "overhead", read_size, 0)
        elif key in m.OVERHEAD_FRACTIONS:
            out[key] = problems.get(
                section,
                key,
                "overhead",
                lambda n, p: read_float(n, p, minimum=0.0, maximum=0.99),
                0.0,
            )
    return out
