"""The ``workload.engine: trtllm`` profile: TensorRT-LLM's KV cache sizing of one rank.

TensorRT-LLM's PyTorch backend (``tensorrt_llm/_torch/pyexecutor/_util.py``,
``KvCacheCreator.estimate_max_tokens`` and ``_cal_max_tokens``) loads the weights, runs dummy
context requests of ``max_num_tokens`` tokens in all (default 8192) with a small temporary KV
cache, measures the peak (torch's peak + what CUDA shows outside torch: context, NCCL, CUDA
graphs) and keeps a fraction of the rest::

    available_kv = (total_gpu_memory − peak + tmp_kv) × free_gpu_memory_fraction   # default 0.9
    max_tokens   = floor(available_kv / kv_size_per_token)
    "[MemUsageChange] Allocated X GiB for max tokens in paged KV cache (N)"
                   N = max_tokens rounded up to whole blocks of tokens_per_block (default 32)

``kv_size_per_token`` is ``layers · kv_heads/tp · head_dim · 2 · bytes`` (``_get_cache_size_per
_token``; MLA: ``kv_lora_rank + qk_rope_head_dim`` once, not split over tp). The default fraction
0.9 is ``_get_free_gpu_memory_fraction``. So, with ``peak − tmp_kv = weights + activations +
non_torch``, the KV cache gets ``0.9 × (device − weights − activations − non_torch)``; the other
10 % is charged here as ``overhead.kv_reserve``, so the one verdict (``total ≤ device memory``) is
"the workload's tokens fit in the paged KV cache".

Not read from TensorRT-LLM: the activation peak of the dummy run (priced with the same
decoder-layer working set as the vLLM profile, :func:`shardctl.plan.memory.vllm.forward_peak_bytes`,
over ``max_num_tokens`` tokens) and the non-torch memory (vLLM's measured figures,
:func:`shardctl.plan.memory.vllm.non_torch_bytes`: the same CUDA context and NCCL buffers).
No public TensorRT-LLM log with a known model, GPU and settings was found to hold the whole
prediction to; see docs/memory-model.md, "The TensorRT-LLM profile".
"""

from __future__ import annotations

from dataclasses import dataclass

FREE_GPU_MEMORY_FRACTION = 0.9  # KvCacheConfig.free_gpu_memory_fraction default (_util.py)
TOKENS_PER_BLOCK = 32  # "Number of tokens per block: 32." (PyTorch backend default)
MAX_NUM_TOKENS = 8192  # the dummy context requests' tokens in all (max_num_tokens default)


def max_kv_tokens(
    *, total: int, peak: int, tmp_kv: int, fraction: float, per_token: int, tokens_per_block: int
) -> tuple[int, int]:
    """``(available_kv_bytes, tokens)`` as ``_cal_max_tokens`` and the KV cache manager give
    them: bytes ``(total − peak + tmp_kv) × fraction``, tokens rounded up to whole blocks.

    The public log of 2025-12-20 (an engine with 73,728 B per token): total 119.70 GiB, peak
    113.65 GiB, tmp_kv 0.56 GiB → 5.95 GiB, 86,711 tokens → "(86720)" in blocks of 32.
    """
    available = int((total - peak + tmp_kv) * fraction)
    tokens = max(available, 0) // per_token if per_token else 0
    blocks = -(-tokens // tokens_per_block)
    return available, blocks * tokens_per_block


@dataclass(frozen=True)
class TrtllmOverhead:
    """The non-weight, non-KV terms of one rank (bytes), all inside ``device_memory``."""

    non_torch: int
    cuda_graphs: int
    kv_reserve: int  # (1 − fraction) × what the profile left free

    def items(self) -> dict[str, int]:
        return {
            "non_torch": self.non_torch,
            "cuda_graphs": self.cuda_graphs,
            "kv_reserve": self.kv_reserve,
        }


def kv_reserve_bytes(device_memory: int | None, used: int, fraction: float) -> int:
    """The ``1 − fraction`` of the memory left after the profile that the KV cache leaves."""
    if device_memory is None:
        return 0
    return int(max(device_memory - used, 0) * (1 - fraction))
