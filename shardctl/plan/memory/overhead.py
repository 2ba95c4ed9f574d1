"""Runtime overhead: memory a process uses beyond its tensors. Named, documented, overridable.

None of these is in ``torch.cuda.max_memory_allocated`` except the workspace; they are what
``nvidia-smi`` shows on top of it. Defaults are typical figures, not laws:

- ``cuda_context`` 512 MiB: the CUDA context and kernel images a PyTorch process loads on its
  first CUDA call (PyTorch CUDA-semantics notes; vLLM's ``non_torch_memory`` in its profiler
  reports 0.3–0.9 GiB on H100).
- ``nccl_buffers`` 256 MiB when any mesh axis is above 1: NCCL's channel buffers
  (``NCCL_BUFFSIZE`` 4 MiB × channels × peers; NCCL environment-variable docs).
- ``framework`` 32 MiB: the cuBLAS workspace Hopper needs (``CUBLAS_WORKSPACE_CONFIG``;
  cuBLAS docs recommend 32 MiB on Hopper) and small framework allocations.
- ``reserved`` 0: whatever else the user holds back (a co-located process, a margin).
- ``dispatch_buffers`` 0: pre-allocated MoE all-to-all buffers beyond the per-pass ones the
  activations already count (:func:`shardctl.plan.memory.activations.dispatch_buffer_bytes`),
  e.g. DeepEP's fixed NVSHMEM buffers; counted on ranks with ``ep > 1``.
- ``fragmentation`` 5 %: the caching allocator's reserved-but-unallocated share of the tensors
  above (PyTorch ``memory_reserved`` vs ``memory_allocated``; DeepSpeed and FSDP reports).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.errors import InvalidInputError

MiB = 1 << 20


# The ``overhead:`` names, in bytes and as a fraction (the manifest reads these same keys).
SIZES = ("cuda_context", "nccl_buffers", "framework", "dispatch_buffers", "reserved")
FRACTIONS = ("fragmentation",)


@dataclass(frozen=True)
class OverheadSpec:
    cuda_context: int = 512 * MiB
    nccl_buffers: int = 256 * MiB
    framework: int = 32 * MiB
    reserved: int = 0
    fragmentation: float = 0.05
    dispatch_buffers: int = 0

    def __post_init__(self) -> None:
        for key in SIZES:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInputError(
                    f"expected a non-negative byte count, got {v!r}", where=f"overhead.{key}"
                )
        if not 0 <= self.fragmentation < 1:
            raise InvalidInputError(
                f"expected 0 <= fragmentation < 1, got {self.fragmentation}",
                where="overhead.fragmentation",
            )


def overhead_bytes(
    spec: OverheadSpec, tensors: int, *, distributed: bool, expert_parallel: bool = False
) -> dict[str, int]:
    """The named overhead items for one rank whose tensors take ``tensors`` bytes.

    >>> overhead_bytes(OverheadSpec(), 10 * 2**30, distributed=False)["fragmentation"]
    536870912
    """
    out = {
        "cuda_context": spec.cuda_context,
        "nccl_buffers": spec.nccl_buffers if distributed else 0,
        "framework": spec.framework,
        "reserved": spec.reserved,
        "fragmentation": int(tensors * spec.fragmentation),
    }
    if expert_parallel:
        out["dispatch_buffers"] = spec.dispatch_buffers
    return out
