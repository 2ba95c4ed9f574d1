"""The one memory budget a rank is judged against, and the one verdict.

``plan``, ``plan --search``, the exit code, the text and the JSON all call these two functions;
nothing else compares a rank with device memory.

Budget = what the serving or training engine lets the run use:

- inference: ``device_memory × gpu_memory_utilization`` — vLLM preallocates exactly this share
  (``gpu_memory_utilization``, default 0.9) and fits weights, activations and the KV cache
  inside it; SGLang's ``mem_fraction_static`` is the same idea. A plan that fits raw memory
  but not this share fails to start in vLLM ("No available memory for the cache blocks").
- ``engine: sglang`` / ``trtllm``: ``device_memory``; their reserves (``1 −
  mem_fraction_static`` of the memory free before the weights, ``1 − free_gpu_memory_fraction``
  of the memory free after the profile) are priced as ``overhead`` items instead.
- training: ``device_memory`` — PyTorch's caching allocator has no such cap
  (``torch.cuda.set_per_process_memory_fraction`` defaults to 1.0); the CUDA context, NCCL
  buffers and fragmentation are priced as the ``overhead`` component instead.
"""

from __future__ import annotations

# Engines whose reserve is priced as an ``overhead`` item inside the whole device (SGLang's
# ``1 − mem_fraction_static``, TensorRT-LLM's ``1 − free_gpu_memory_fraction``): their budget
# is the device memory, and ``gpu_memory_utilization`` does not apply.
WHOLE_DEVICE_ENGINES = ("sglang", "trtllm")


def engine_utilization(engine: str, gpu_memory_utilization: float) -> float:
    """The share of device memory the budget takes for ``engine``.

    >>> engine_utilization("vllm", 0.9), engine_utilization("sglang", 0.9)
    (0.9, 1.0)
    """
    return 1.0 if engine in WHOLE_DEVICE_ENGINES else gpu_memory_utilization


def memory_budget(
    device_memory: int | None, *, training: bool, gpu_memory_utilization: float
) -> int | None:
    """Bytes one rank may use; ``None`` when device memory is unknown (no verdict).

    >>> memory_budget(80 * 2**30, training=False, gpu_memory_utilization=0.9) / 2**30
    72.0
    """
    if device_memory is None:
        return None
    if training:
        return device_memory
    return int(device_memory * gpu_memory_utilization)


def fits(peak: int, budget: int | None) -> bool | None:
    """The verdict: the fullest rank within the budget (``None``: unknown device memory)."""
    return None if budget is None else peak <= budget
