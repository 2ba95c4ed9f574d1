"""The ``workload.engine: sglang`` profile: SGLang's own start-up accounting of one rank.

SGLang (``python/sglang/srt/model_executor/model_runner.py``, ``ModelRunner.init_torch_distributed``
→ ``load_model`` → ``profile_max_num_token``; 0.4.x, the ``profile_available_bytes`` of its later
``pool_configurator.py`` computes the same) sizes its token pool once, at start-up::

    total      = free memory after CUDA/NCCL init (min over ranks; "Load weight begin. avail mem")
    available  = free memory after the weights load ("Load weight end. avail mem")
    rest       = available − total × (1 − mem_fraction_static)
    max_total_num_tokens = floor(rest / cell_size)      ("KV Cache is allocated. #tokens: N")
    cell_size  = layers · kv_heads/tp · head_dim · 2 · bytes(kv dtype)   (MLA: (kv_lora_rank +
                 qk_rope_head_dim) · layers · bytes, no factor 2 and no tp split)

i.e. ``rest = (device − init) × mem_fraction_static − weights − load_extra``. The share
``1 − mem_fraction_static`` of what was free after init is left for activations, CUDA graphs and
the request-to-token table; it is charged here as the ``overhead.reserve`` item, so the one
verdict (``total ≤ device memory``) is exactly "the workload's tokens fit in the token pool".
Every constant cites the log or source it was read from; see docs/memory-model.md, "The SGLang
profile".
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.plan.memory.hardware import GPUS, GiB

# ``ServerArgs.__post_init__`` (python/sglang/srt/server_args.py, 0.4.x): the default
# ``mem_fraction_static`` by tensor-parallel size (world size in later 0.4 releases).
_DEFAULT_FRACTION = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))

# Memory used before "Load weight begin" on one rank at tp 1: CUDA context, cuBLAS, torch.
# - h100-sxm 0.63 GiB: sgl-project/sglang PR #4760 log (Llama-3.1-8B, H100, 2025-03-25):
#   "Load weight end … avail mem=63.48 GB, mem usage=15.11 GB" → 78.59 GiB free of 79.22.
#   (An older log, 2025-01-23: "Load weight begin. avail mem=78.81 GB" → 0.41 GiB.)
# - any other GPU: 0.35 GiB, the CUDA context vLLM measured on an RTX 3090 (vLLM issue #10517),
#   no SGLang figure found.
INIT_TP1: dict[str, int] = {"h100-sxm": round(0.63 * GiB)}
INIT_TP1_OTHER = round(0.35 * GiB)
# tp > 1: what ``init_torch_distributed`` allocates (NCCL communicators, custom all-reduce
# buffers) before "Load weight begin", per rank, by GPU:
# - h100-sxm 1.25 GiB: "Init torch distributed ends. mem usage=1.25 GB" (SGLang 0.5.2rc2, 8×H100
#   80GB HBM3, --tp 8, nccl 2.27.3; blog "Grok2 OnPrem Deployment via sglang", Shivank
#   Chaudhary, 2025-09-14, found through the code search). SGLang's "GB" are GiB
#   (``get_available_gpu_memory`` divides by 1 << 30). Taken as one group's buffers, the same at
#   every tp > 1, as vLLM's logs show on H100 (vllm.py, ``TP_GROUP_BYTES``), and for the same
#   GPUs as vLLM's figure (``GpuPreset.switched``: NVSwitch parts and MI300X; measured on
#   H100 only);
# - any other GPU 0.13 GiB: "Init torch distributed ends. mem usage=0.13 GB" (SGLang log,
#   4×L4 over PCIe, 2025-03-08).
# - h200 1.96 GiB: "[TP0] Init torch distributed ends. mem usage=1.96 GB" (1.77-2.01 over the 8
#   ranks; sgl-project/sglang PR #11716, 2025-10-16, 8 GPUs with 137 GB free: H200, tp 8).
#   Whether the gap to the H100 figure is the GPU or the SGLang release is not known.
INIT_DISTRIBUTED: dict[str, int] = {g: round(1.25 * GiB) for g, p in GPUS.items() if p.switched}
INIT_DISTRIBUTED["h200"] = round(1.96 * GiB)
INIT_DISTRIBUTED_OTHER = round(0.13 * GiB)
# What loading allocates beyond the weights' bytes (workspaces): "mem usage" of "Load weight
# end" minus Llama-3.1-8B's 14.96 GiB of bf16 weights in three public logs: 15.02 (2025-07-14),
# 15.09 (2025-01-23), 15.11 GB (PR #4760) → 0.06, 0.13, 0.15; the median, less that model's
# float32 rotary table (131,072 positions × 128 × 4 B = 64 MiB), which is priced per model
# (:mod:`.rotary`, item ``rotary_cache``).
LOAD_EXTRA = round(0.13 * GiB) - 131_072 * 128 * 4
PAGE_SIZE = 1  # ``--page-size`` default: one token per page


def default_mem_fraction_static(tp: int) -> float:
    """SGLang's default ``mem_fraction_static`` for ``tp`` GPUs.

    >>> default_mem_fraction_static(1), default_mem_fraction_static(4)
    (0.88, 0.85)
    """
    for at_least, fraction in _DEFAULT_FRACTION:
        if tp >= at_least:
            return fraction
    return _DEFAULT_FRACTION[-1][1]


SGLANG_VERSIONS = ("0.4", "0.5")


def default_mem_fraction_static_v05(device_memory: int, *, tp: int, pp: int = 1) -> float:
    """SGLang ≥ 0.5.3's default (sgl-project/sglang PR #10975; ``server_args.py``,
    ``_handle_gpu_memory_settings``): a reserve in MiB for activations and CUDA graphs, from the
    GPU-memory bucket's ``chunked_prefill_size`` and ``cuda_graph_max_bs``::

        reserved = 512 + 1.5 · max(chunked_prefill_size, 2048) + 2 · cuda_graph_max_bs
                   + 1024 · tp · pp / 8          (at least 10 GiB on GPUs above 60 GiB)
        mem_fraction_static = round((gpu_mem − reserved) / gpu_mem, 3)

    ``gpu_mem`` is SGLang's ``get_nvgpu_memory_capacity`` (nvidia-smi's total, MiB); the
    device memory of the plan is used. Not modelled: DP attention, speculative decoding,
    piecewise CUDA graphs, multimodal adjustments (each reserves more).

    >>> default_mem_fraction_static_v05(80 * 2**30, tp=1)  # H100 (8k chunk, 256 graphs)
    0.836
    >>> default_mem_fraction_static_v05(48 * 2**30, tp=1)  # L40S (4k chunk, 32 graphs)
    0.861
    """
    mib = device_memory / 2**20
    if mib < 20 * 1024:
        chunk, graphs = 2048, 8
    elif mib < 35 * 1024:
        chunk, graphs = 2048, 24 if tp < 4 else 80
    elif mib < 60 * 1024:
        chunk, graphs = 4096, 32 if tp < 4 else 160
    elif mib < 160 * 1024:
        chunk, graphs = 8192, 256 if tp < 4 else 512
    else:
        chunk, graphs = 16384, 512
    reserved = 512 + max(chunk, 2048) * 1.5 + graphs * 2 + tp * pp / 8 * 1024
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


def init_bytes(gpu: str | None, ranks: int) -> int:
    """Memory one rank uses before its weights load (``total_gpu_memory`` = device − this);
    ``ranks`` is the process group's size (tp · pp · ep of one replica)."""
    base = INIT_TP1.get(gpu or "", INIT_TP1_OTHER)
    group = INIT_DISTRIBUTED.get(gpu or "", INIT_DISTRIBUTED_OTHER)
    return base + (group if ranks > 1 else 0)


@dataclass(frozen=True)
class SglangOverhead:
    """The non-weight, non-KV terms of one rank (bytes), all inside ``device_memory``."""

    init: int  # CUDA context etc. before the weights load
    load_extra: int  # allocated while loading, beyond the weights
    reserve: int  # (device − init) × (1 − mem_fraction_static): activations, CUDA graphs

    def items(self) -> dict[str, int]:
        return {"init": self.init, "load_extra": self.load_extra, "reserve": self.reserve}


def sglang_overhead(
    device_memory: int | None, *, gpu: str | None, ranks: int, fraction: float, init: int | None
) -> SglangOverhead:
    """The profile's overhead items; ``init`` overrides the measured table."""
    used = init_bytes(gpu, ranks) if init is None else init
    reserve = 0 if device_memory is None else int((device_memory - used) * (1 - fraction))
    return SglangOverhead(init=used, load_extra=LOAD_EXTRA, reserve=reserve)
