"""The ``workload.engine: vllm`` profile: vLLM's own start-up accounting of one rank.

vLLM (V0 ``Worker.determine_num_available_blocks``; V1 ``gpu_worker.determine_available_memory``
with the ``memory_profiling`` helper of ``vllm/utils``) sizes its KV cache once, at start-up::

    budget     = total_gpu_memory × gpu_memory_utilization      # total as CUDA reports it
    kv_bytes   = budget − weights − non_torch − activation_peak − cuda_graphs
    blocks     = floor(kv_bytes / (block_size × bytes_per_token))   # per rank, min over ranks
    tokens     = blocks × block_size
    concurrency at max_model_len = tokens / max_model_len   ("Maximum concurrency …: 1.56x")

and refuses to start when one sequence of ``max_model_len`` tokens does not fit ("The model's
max seq len (29000) is larger than the maximum number of tokens that can be stored in KV
cache (23648)"). Every constant below cites the log it was read from; see
docs/memory-model.md, "The vLLM profile".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardctl.model.types import ModelDims
from shardctl.plan.memory.hardware import GPUS, GiB, HardwareSpec, switched

# Which vLLM's accounting the profile follows (``workload.vllm_version``):
# - "0.2": V0 of December 2023 (v0.2.5-v0.2.6, torch 2.1.1; vLLM PR #2031's rows): the 0.6
#   terms as they were then — ``Worker.profile_num_available_blocks`` charged
#   ``total − free`` after the profile run (``torch.cuda.mem_get_info``, PR #2031), the profile
#   forward ran ``max(max_model_len, 2048)`` tokens (``SchedulerConfig``) and the sampler 256
#   sequences — plus, when tp > 1, every row-parallel all-reduce output of that forward
#   (:func:`retained_allreduce_bytes`): NCCL's ``record_stream`` kept them from reuse (vLLM
#   issue #2150), fixed by ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (PR #2151, 2023-12-17);
# - "0.6": V0 as of PR #10511 (v0.6.5; the rows of issue 15's table): non-torch counted from
#   before the instance (CUDA context included), sampler over 256 sequences, profile forward over
#   ``max(max_model_len, 2048)`` tokens;
# - "0.19": the V1 engine as measured in 0.18-0.19 (``gpu_worker.determine_available_memory``
#   with ``memory_profiling``: non-torch counted from ``init_snapshot``, taken after the CUDA
#   context and before the distributed init, so the context is not charged, NCCL is), defaults
#   of ``EngineArgs.get_batch_defaults`` for ``vllm serve``;
# - "0.16": the V1 engine as measured at 0.15-0.16: the same, but a profile peak that matches
#   the top-k/top-p sort-path sampler (0.6's 41 B per logit, over V1's 1,024 sequences) and a
#   tp-1 non-torch increase of 0.13 GiB (llm-d-planner accuracy_report.md, "vLLM Version
#   Sensitivity": Qwen3-14B on H100, activation 5.64 GiB and non-torch 0.13 at v0.15-v0.16,
#   2.23 and 0.13 at v0.17, 0.25 from v0.18). Which earlier V1 releases did the same is not
#   established: the July 2025 Qwen3-235B log agrees with it (+2.5 % in KV bytes), a vLLM
#   0.11.1 log (4×A30, OPT-2.7B, tp 4: "torch peak memory increase: 0.22GiB") does not;
# - "0.21": the V1 engine from 0.21.0: "0.19"'s terms, and the CUDA-graph memory vLLM estimates
#   during the profile is subtracted before the KV cache is sized ("CUDA graph memory
#   profiling is enabled (default since v0.21.0)", ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``;
#   the estimate of vLLM PR #30515, off by default until then): :data:`CUDA_GRAPH_ESTIMATE_V021`
#   unless ``workload.cuda_graph_memory`` gives the logged "Estimated CUDA graph memory".
VLLM_VERSIONS = ("0.2", "0.6", "0.16", "0.19", "0.21")
V1_VERSIONS = ("0.16", "0.19", "0.21")
# Versions that price like "0.19" apart from the CUDA-graph estimate.
V019_LIKE = ("0.19", "0.21")
# vLLM >= 0.21's default CUDA-graph estimate per rank, when the workload does not give the
# logged figure. vLLM measures it (``profile_cudagraph_memory``: it captures the first two graphs
# of each mode against a small dummy KV cache and extrapolates the second one's increase to the
# rest), so it is a reading, not a formula: 0.84 GiB is what vLLM 0.19 logged as the estimate
# for Llama-3.1-8B and CodeLlama-7B on H100 at the default capture sizes (1-512,
# FULL_AND_PIECEWISE): "CUDA graph pool memory: 0.91 GiB (actual), 0.84 GiB (estimated)"
# (llm-d-planner accuracy/results/v0.19.0/logs, commit d3121e05). The same sweep logs 1.6 GiB
# for Granite-3.1-2B (actual 0.84), and public logs range from 0.05 to 33 GiB: set
# ``cuda_graph_memory`` from the log where it matters.
CUDA_GRAPH_ESTIMATE_V021 = round(0.84 * GiB)

# Non-torch memory of one rank at tp = 1 (CUDA context, cuBLAS workspace, allocator slack outside
# torch's counters), as vLLM 0.6 measured it on that GPU:
# - h100-sxm 1.79 GiB: vLLM PR #10511 ("non_torch_memory 1.79GiB", Llama-3-8B, tp 1);
# - a100-80gb 0.77 GiB: vLLM PR #2031, Llama-2-7B tp 1: 7,449 blocks with torch's peak vs 7,351
#   with the device's (total − free), 98 blocks × 8 MiB;
# - any other GPU 0.35 GiB: vLLM issue #10517, RTX 3090 ("non_torch_memory=0.35GiB").
NON_TORCH_TP1: dict[str, int] = {
    "h100-sxm": round(1.79 * GiB),
    "a100-80gb": round(0.77 * GiB),
}
NON_TORCH_TP1_OTHER = round(0.35 * GiB)
# vLLM 0.19 at tp = 1: "non-torch forward increase memory: 0.25GiB" (Llama-3.1-8B; 0.24-0.25 in
# every tp-1 run on H100 of llm-d-planner's v0.19.0 sweep, accuracy/results/v0.19.0/logs); with
# pp > 1 and tp 1, 0.07 GiB per rank (the pp-2 and pp-4 runs of the same sweep).
NON_TORCH_TP1_V019 = round(0.25 * GiB)
# V1 up to 0.16 at tp = 1: 0.13 GiB (Qwen3-14B at v0.15-v0.16 in llm-d-planner's version
# report; that row pins it, tests/test_plan_accuracy_vllm_v1.py).
NON_TORCH_TP1_V016 = round(0.13 * GiB)
NON_TORCH_PP_V019 = round(0.07 * GiB)
# What a tensor-parallel group adds per rank: the communicators' buffers (torch's NCCL process
# group, vLLM's PyNcclCommunicator and custom all-reduce IPC buffers), allocated once per group,
# so the same at tp 2 and tp 4 — not a per-peer term. Read from vLLM PR #10511 (v0.6.5, H100):
# 3.58 GiB at tp 2 against 1.79 at tp 1. Held-out check, vLLM 0.19 on H100 (llm-d-planner
# sweep): tp 2 adds 1.81-1.86 GiB over tp 1, tp 4 adds 1.88-1.96 (Llama-3.1-8B, Qwen2.5-7B,
# Llama-3.3-70B-FP8). Measured on H100 only; other GPUs take the same figure (towards "does not
# fit"); ``workload.non_torch_memory`` overrides.
TP_GROUP_BYTES = round(1.79 * GiB)
# GPUs that take it: the switched ones of the GPU table (``GpuPreset.switched``: NVSwitch SXM
# parts and MI300X), where NCCL opens many channels (its buffers are NCCL_BUFFSIZE per channel
# and protocol), measured on H100 SXM only; MI300X unmeasured (towards "does not fit"). Any
# other GPU (PCIe cards, no preset): 0.20 GiB, the most non-torch memory two tp > 1 logs over
# PCIe show in all — vLLM PR #14447 (davidsyoung, 2025-04-12; V0, 24 GB GPUs,
# "non_torch_memory takes 0.20GiB" on every worker) and a vLLM 0.11.1 issue on 4×A30
# ("OPT-2.7B OOM while OPT-6.7B works fine", tp 4: "non-torch forward increase memory:
# 0.09GiB").
TP_GROUP_BYTES_OTHER = round(0.20 * GiB)

# The sampler of vLLM's profile run: ``max_num_seqs`` dummy sequences (default 256) sampled with
# top-p/top-k so the sort path runs: fp32 logits, sorted values and int64 indices, softmax,
# cumsum, masks. 41 bytes per logit reproduces PR #10511's "PyTorch activation peak memory
# 1.26GiB" for Llama-3-8B (256 × 128,256 logits), the same at tp 1 and tp 2 (logits are gathered
# on one rank and sampled there).
SAMPLER_BYTES_PER_LOGIT = 41
# vLLM 0.19's profile peak per logit of ``_dummy_sampler_run`` (consistent with a sampler without
# the top-k/top-p sort: bf16 logits, their fp32 copy, probabilities, exponential noise ≈ 14 B,
# plus what the forward still holds — a reading, not a measurement): fitted to one row,
# "torch peak memory increase: 1.89GiB" of Llama-3.1-8B tp 1 (1,024 × 128,256 logits), and held
# out against Qwen2.5-7B (2.21 GiB logged, 2.24 predicted) and Llama-3.3-70B (1.96-1.97, 1.89).
SAMPLER_BYTES_PER_LOGIT_V019 = 15.45
MAX_NUM_SEQS = 256  # vLLM default ``max_num_seqs``
BLOCK_SIZE = 16  # vLLM default ``block_size`` (tokens per paged block)
# vLLM V0 without chunked prefill: ``max_num_batched_tokens = max(max_model_len, 2048)``
# (``SchedulerConfig``); every row of issue 15's table ran that way.
MIN_BATCHED_TOKENS = 2048
# vLLM V1 ``EngineArgs.get_batch_defaults`` for ``vllm serve``: on a GPU of at least 70 GiB
# that is not an A100, 8,192 batched tokens and 1,024 sequences; otherwise 2,048 and 256.
LARGE_GPU_BYTES = 70 * GiB
V1_SERVE_DEFAULTS = {"large": (8192, 1024), "other": (2048, 256)}


def v1_batch_defaults(gpu: str | None, device_memory: int | None) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` vLLM V1 picks for ``vllm serve`` on this GPU.

    >>> v1_batch_defaults("h100-sxm", 79 * GiB), v1_batch_defaults("a100-80gb", 79 * GiB)
    ((8192, 1024), (2048, 256))
    """
    large = (device_memory or 0) >= LARGE_GPU_BYTES and "a100" not in (gpu or "")
    return V1_SERVE_DEFAULTS["large" if large else "other"]


def cuda_reported_memory(gpu: str | None, device_memory: int | None) -> int | None:
    """``device_memory`` as CUDA reports it for a preset whose GPU table entry knows it (an "80
    GB" H100 gives 79.22 GiB: ``GpuPreset.cuda_memory``), else unchanged."""
    preset = GPUS.get(gpu) if gpu is not None else None
    if preset is not None and preset.cuda_memory is not None:
        return preset.cuda_memory
    return device_memory


def engine_hardware(hardware: HardwareSpec, engine: str, *, training: bool) -> HardwareSpec:
    """The hardware as the engine sees it: the device size CUDA reports (every engine allocates
    from it; an explicit ``device_memory`` stays as given). The one place ``plan`` and ``plan
    --search`` get their budget's device size from."""
    del engine, training
    memory = cuda_reported_memory(hardware.gpu, hardware.device_memory)
    return replace(hardware, device_memory=memory)


def non_torch_bytes(gpu: str | None, tp: int, *, version: str = "0.6", pp: int = 1) -> int:
    """vLLM's measured non-torch memory of one rank: the tp-1 figure of that GPU and version,
    plus one tensor-parallel group's buffers when ``tp > 1`` (:data:`TP_GROUP_BYTES` on
    :func:`~shardctl.plan.memory.hardware.switched` GPUs, else :data:`TP_GROUP_BYTES_OTHER`).

    >>> [round(non_torch_bytes("h100-sxm", tp) / GiB, 2) for tp in (1, 2, 8)]
    [1.79, 3.58, 3.58]
    >>> round(non_torch_bytes("h100-sxm", 4, version="0.19") / GiB, 2)
    2.04
    """
    if version in V019_LIKE:
        base = NON_TORCH_PP_V019 if pp > 1 and tp == 1 else NON_TORCH_TP1_V019
    elif version == "0.16":
        base = NON_TORCH_TP1_V016
    else:
        base = NON_TORCH_TP1.get(gpu or "", NON_TORCH_TP1_OTHER)
    if tp == 1:
        return base
    return base + (TP_GROUP_BYTES if switched(gpu) else TP_GROUP_BYTES_OTHER)


def default_cuda_graph_bytes(version: str) -> int:
    """CUDA-graph memory vLLM subtracts before sizing the KV cache when the workload does not say:
    the estimate from 0.21 on, else 0 (graphs are captured after the KV cache is allocated).

    >>> default_cuda_graph_bytes("0.19"), round(default_cuda_graph_bytes("0.21") / GiB, 2)
    (0, 0.84)
    """
    return CUDA_GRAPH_ESTIMATE_V021 if version == "0.21" else 0


def profile_tokens(max_model_len: int, max_num_batched_tokens: int | None) -> int:
    """Tokens of vLLM's profile forward: the setting, or V0's ``max(max_model_len, 2048)``."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return max(max_model_len, MIN_BATCHED_TOKENS)


def profile_batch(
    version: str,
    *,
    gpu: str | None,
    device_memory: int | None,
    max_model_len: int,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
) -> tuple[int, int]:
    """``(tokens, sequences)`` of the profile run: the settings, else that version's defaults
    (0.6: ``max(max_model_len, 2048)`` tokens and 256 sequences; V1: ``vllm serve``'s by GPU,
    :func:`v1_batch_defaults`).

    >>> profile_batch("0.19", gpu="h100-sxm", device_memory=79 * GiB, max_model_len=8192,
    ...               max_num_batched_tokens=None, max_num_seqs=None)
    (8192, 1024)
    """
    if version in V1_VERSIONS:
        tokens, seqs = v1_batch_defaults(gpu, device_memory)
    else:
        tokens, seqs = profile_tokens(max_model_len, None), MAX_NUM_SEQS
    return (
        tokens if max_num_batched_tokens is None else max_num_batched_tokens,
        seqs if max_num_seqs is None else max_num_seqs,
    )


def forward_peak_bytes(dims: ModelDims, *, tokens: int, tp: int, act_bytes: int) -> int:
    """Peak of one decoder layer's forward over ``tokens`` tokens on one tp rank.

    During the MLP's down projection vLLM's Llama layer holds the layer input, the residual,
    ``gate_up`` ``[T, 2f/t]`` (still bound while the function runs), the activation ``[T, f/t]``
    and the output ``[T, h]``: ``T · B · (3h + 3f/t)``. Reproduces issue #10517's profiles of
    Llama-3.1-8B: 2.07 GiB at 20,000 tokens and 2.99 GiB at 29,000 (peak_torch − weights).

    >>> from shardctl.model.types import ModelDims
    >>> d = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False)
    >>> round(forward_peak_bytes(d, tokens=29000, tp=1, act_bytes=2) / GiB, 2)
    2.99
    """
    mlp = 3 * dims.intermediate_size // tp if dims.gated_mlp else 2 * dims.intermediate_size // tp
    return tokens * act_bytes * (3 * dims.hidden_size + mlp)


def sampler_peak_bytes(
    vocab_size: int, max_num_seqs: int = MAX_NUM_SEQS, *, version: str = "0.6"
) -> int:
    """The profile run's sampler over ``max_num_seqs`` sequences of ``vocab_size`` logits."""
    per_logit = SAMPLER_BYTES_PER_LOGIT_V019 if version in V019_LIKE else SAMPLER_BYTES_PER_LOGIT
    return int(max_num_seqs * vocab_size * per_logit)


def allreduce_count(num_layers: int, *, first_stage: bool) -> int:
    """All-reduces of one profile forward over a stage: two per decoder layer (attention's
    ``o_proj`` and the MLP's ``down_proj``, both ``RowParallelLinear``) and one after the
    vocabulary-parallel embedding on the first stage."""
    return 2 * num_layers + (1 if first_stage else 0)


def retained_allreduce_bytes(
    dims: ModelDims, *, tokens: int, num_layers: int, first_stage: bool, act_bytes: int
) -> int:
    """vLLM 0.2's extra profile memory at tp > 1: each all-reduce's ``[tokens, hidden]`` output
    stays reserved until the profile ends.

    In December 2023 vLLM all-reduced with ``torch.distributed.all_reduce`` on NCCL, and torch
    < 2.1.2's ``ProcessGroupNCCL`` called ``record_stream`` on the tensor, so the caching
    allocator would not hand its block out again until the host saw the NCCL stream's event
    (pytorch PR #76861): "when using TP, the activation memory for all reduce is not reused"
    (vLLM issue #2150, Llama-70B TP 8). That none is reused within the profile forward (the
    host ahead of the GPU throughout) is this function's assumption; two all-reduces per layer
    is Llama's layout (a layer with parallel attention and MLP, as Falcon's, reduces once).
    ``mem_get_info`` after the run (PR #2031) sees every such block. Fixed by
    ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (vLLM PR #2151; issue #2248: back on torch 2.0.1,
    which lacks the variable, gone with 2.1.2).

    >>> from shardctl.model.types import ModelDims
    >>> d = ModelDims(8192, 80, 64, 8, 128, 28672, 32000, False)
    >>> retained_allreduce_bytes(d, tokens=4096, num_layers=80, first_stage=True,
    ...                          act_bytes=2) / GiB
    10.0625
    """
    count = allreduce_count(num_layers, first_stage=first_stage)
    return count * tokens * dims.hidden_size * act_bytes


# ``VLLM_FUSED_MOE_CHUNK_SIZE`` default (vllm/envs.py): the fused-MoE kernel runs at most this
# many tokens at a time, so its workspaces are sized for ``min(tokens, 16384)``.
FUSED_MOE_CHUNK_SIZE = 16 * 1024


def moe_workspace_bytes(
    *, tokens: int, hidden: int, expert_intermediate: int, topk: int, tp: int, act_bytes: int
) -> int:
    """The V1 fused-MoE kernel's workspace after the profile forward (16-bit experts).

    ``FusedMoEModularKernel._allocate_buffers`` (vllm/model_executor/layers/fused_moe/
    modular_kernel.py) takes ``workspace13``, ``workspace2`` and the output from the worker's
    ``WorkspaceManager`` (vllm/v1/worker/workspace.py, ``get_simultaneous``): one buffer that
    grows to the largest request and is kept for the life of the worker — so it is still
    allocated while the profile's sampler runs, and torch's peak counts it on top. With one
    chunk workspace13 and the output share memory: ``max(ws13, out) + ws2`` elements in the
    activation dtype. ``TritonExperts.workspace_shapes`` (M tokens, N = 2·I/tp for gated
    experts, K = hidden): ws13 ``(M, topk, max(I/tp, K))``, ws2 ``(M, topk, max(N, K))``,
    output ``(M, K)``.

    >>> round(moe_workspace_bytes(tokens=8192, hidden=2048, expert_intermediate=768, topk=8,
    ...                           tp=1, act_bytes=2) / GiB, 3)  # Qwen3-30B-A3B
    0.5
    """
    m = min(tokens, FUSED_MOE_CHUNK_SIZE)
    i = expert_intermediate // tp
    ws13 = m * topk * max(i, hidden)
    ws2 = m * topk * max(2 * i, hidden)
    out = tokens * hidden
    elems = max(ws13, out) + ws2 if tokens <= m else ws13 + ws2 + out
    return elems * act_bytes


def encoder_cache_bytes(
    *, budget_tokens: int, item_tokens: int, hidden: int, act_bytes: int
) -> int:
    """A multimodal model's dummy encoder outputs, held through V1's profile run.

    ``GPUModelRunner.profile_run`` (vllm/v1/worker/gpu_model_runner.py) runs the encoder on as
    many of the largest items as the encoder budget holds (``compute_encoder_budget``:
    ``max(max_num_batched_tokens, tokens of one item)``; "Encoder cache will be initialized
    with a budget of 8192 tokens, and profiled with 32 image items of the maximum feature
    size"), keeps the outputs in ``encoder_cache["tmp"]`` while the decoder's dummy forward and
    the sampler run, and clears them after: they sit under torch's peak, ``item_tokens`` ×
    ``hidden`` (the text width the projector maps to) per item in the model dtype.

    >>> encoder_cache_bytes(budget_tokens=8192, item_tokens=256, hidden=5376, act_bytes=2)
    88080384
    """
    budget = max(budget_tokens, item_tokens)
    return budget // item_tokens * item_tokens * hidden * act_bytes


def profile_activation_bytes(
    dims: ModelDims,
    *,
    tokens: int,
    tp: int,
    act_bytes: int,
    max_num_seqs: int,
    last_stage: bool,
    version: str = "0.6",
) -> int:
    """vLLM's "PyTorch activation peak memory": the forward, or the sampler after it (the
    forward's tensors are freed by then), whichever is larger; the sampler only where the
    logits are (the last stage)."""
    fwd = forward_peak_bytes(dims, tokens=tokens, tp=tp, act_bytes=act_bytes)
    samp = sampler_peak_bytes(dims.vocab_size, max_num_seqs, version=version) if last_stage else 0
    return max(fwd, samp)


@dataclass(frozen=True)
class VllmOverhead:
    """The profile's non-KV, non-weight terms of one rank (bytes)."""

    non_torch: int
    cuda_graphs: int

    def items(self) -> dict[str, int]:
        return {"non_torch": self.non_torch, "cuda_graphs": self.cuda_graphs}
