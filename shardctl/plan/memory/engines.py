"""The engines a plan can be priced for (``workload.engine``): whose accounting each follows.

One profile per engine, read from the engine's own code (docs/memory-model.md, "Engine
profiles"):

- ``generic``: the model of docs/memory-model.md (training activations after Korthikanti et al.
  2022, 16-bit gradients, states after ZeRO) — the default, for inference and training.
- ``vllm``: inference only, vLLM's start-up profile (:mod:`shardctl.plan.memory.vllm`).
- ``sglang``: inference only, SGLang's token-pool sizing (:mod:`shardctl.plan.memory.sglang`).
- ``trtllm``: inference only, TensorRT-LLM's paged KV cache sizing
  (:mod:`shardctl.plan.memory.trtllm`).
- ``megatron``: training only; Megatron-LM's fused kernels save what Korthikanti et al. count,
  and its gradients accumulate in an fp32 ``main_grad`` (``--accumulate-allreduce-grads-in-fp32``,
  the default with bf16): 2 + 4 + 12 = 18 bytes per parameter, the figure of Megatron-LM's
  ``theoretical_memory_usage.py`` without the distributed optimizer.
- ``hf``: transformers' own modules (``Trainer``, or a plain loop): what autograd saves in
  transformers' RMSNorm (an fp32 copy of its input) and unfused SwiGLU (four intermediate-size
  tensors) — :func:`shardctl.plan.memory.activations.layer_activation_bytes` with
  ``saved="transformers"``; for inference the same as ``generic``.
- ``fsdp``: PyTorch FSDP over transformers' modules: ``hf``'s activations, ZeRO-3-style states.
- ``deepspeed``: DeepSpeed ZeRO over transformers' modules: ``hf``'s activations, fp32 gradient
  partitions (DeepSpeed's ``estimate_zero3_model_states_mem_needs``: 18 bytes per parameter) and
  its ``additional_buffer_factor`` of 1.5 on offloaded host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.errors import InvalidInputError


@dataclass(frozen=True)
class EngineProfile:
    name: str
    modes: tuple[str, ...]  # "inference", "training"
    saved: str = "korthikanti"  # training activations: "korthikanti" | "transformers"
    grad_dtype: str | None = None  # default gradient dtype (None: the model's)
    host_buffer: float = 1.0  # factor on offloaded host memory
    source: str = ""


PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile("generic", ("inference", "training"), source="docs/memory-model.md"),
        EngineProfile("vllm", ("inference",), source="vLLM start-up profile"),
        EngineProfile("sglang", ("inference",), source="SGLang ModelRunner.profile_max_num_token"),
        EngineProfile(
            "trtllm", ("inference",), source="TensorRT-LLM KvCacheCreator.estimate_max_tokens"
        ),
        EngineProfile(
            "megatron",
            ("training",),
            grad_dtype="F32",
            source="Megatron-LM theoretical_memory_usage.py, main_grad in fp32",
        ),
        EngineProfile(
            "hf", ("inference", "training"), saved="transformers", source="transformers modules"
        ),
        EngineProfile("fsdp", ("training",), saved="transformers", source="PyTorch FSDP"),
        EngineProfile(
            "deepspeed",
            ("training",),
            saved="transformers",
            grad_dtype="F32",
            host_buffer=1.5,
            source="DeepSpeed estimate_zero3_model_states_mem_needs (18 B/param, buffer 1.5)",
        ),
    )
}
ENGINES: tuple[str, ...] = tuple(PROFILES)


def engine_profile(name: str, *, training: bool) -> EngineProfile:
    """The profile of ``name`` for the plan's mode; an engine that does not run it is refused."""
    profile = PROFILES[name]
    mode = "training" if training else "inference"
    if mode not in profile.modes:
        fits = [p.name for p in PROFILES.values() if mode in p.modes]
        raise InvalidInputError(
            f"engine {name!r} prices {' and '.join(profile.modes)} only, the workload is {mode}",
            where="workload.engine",
            hint=f"for {mode} use one of: {', '.join(fits)}",
        )
    return profile
