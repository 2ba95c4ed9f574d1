"""The one memory budget a rank is judged against, and the one verdict.

``plan``, ``plan --search``, the exit code, the text and the JSON all call these two functions;
nothing else compares a rank with device memory.

Budget = what the serving or training engine lets the run use:

- inference: ``device_memory × gpu_memory_utilization`` — vLLM preallocates exactly this share
  (``gpu_memory_utilization``, default 0.9) and fits weights, activations and the KV cache
  inside it; SGLang's ``mem_fraction_static`` is the same idea. A plan that fits raw memory
  but not this share fails to start in vLLM ("No available memory for the cache blocks").
- training: ``device_memory`` — PyTorch's caching allocator has no such cap
  (``torch.cuda.set_per_process_memory_fraction`` defaults to 1.0); the CUDA context, NCCL
  buffers and fragmentation are priced as the ``overhead`` component instead.
"""

from __future__ import annotations


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
