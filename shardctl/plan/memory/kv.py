"""KV cache: bytes per token, per rank, and the serving questions it answers.

Per token, every layer stores one key and one value vector per KV head (Kwon et al. 2023,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", §3;
the vLLM paper's 13B example: 2 · 40 layers · 5120 · 2 bytes = 800 KB per token)::

    kv_bytes_per_token = 2 · layers · num_kv_heads · head_dim · bytes(kv_cache_dtype)

GQA (Ainslie et al. 2023) stores ``num_kv_heads`` heads, not ``num_heads``. On a tp rank:
``num_kv_heads / tp`` heads, or one whole head when ``tp > num_kv_heads`` (vLLM
``num_kv_head_replicas``); a pipeline stage stores only its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.dtypes import DTYPE_BITS
from shardctl.model.types import ModelDims
from shardctl.plan.memory.budget import memory_budget
from shardctl.plan.memory.shapes import kv_heads_per_rank

VLLM_BLOCK_SIZE = 16  # tokens per paged KV block (vLLM default ``block_size``)


def kv_bytes_per_token(
    dims: ModelDims, dtype: str, *, layers: int | None = None, tp: int = 1
) -> int:
    """K and V bytes one token adds on one rank holding ``layers`` layers at tp degree ``tp``.

    >>> from shardctl.model.types import ModelDims
    >>> d = ModelDims(5120, 40, 40, 40, 128, 13824, 32000, False)  # the vLLM paper's 13B
    >>> kv_bytes_per_token(d, "F16")  # 800 KB
    819200
    """
    n_layers = dims.num_layers if layers is None else layers
    heads = kv_heads_per_rank(dims.num_kv_heads, tp)
    return 2 * n_layers * heads * dims.head_dim * DTYPE_BITS[dtype] // 8


@dataclass(frozen=True)
class KvCapacity:
    """What a rank can hold once weights, activations and overhead are placed.

    ``tokens`` is rounded down to whole paged blocks of ``block_size`` tokens (vLLM
    ``determine_num_available_blocks``); ``max_batch`` at the workload's sequence length and
    ``max_sequence_length`` at its batch are per dp replica. ``blocks``, ``kv_bytes`` (the
    blocks' bytes) and ``max_concurrency`` (sequences of the workload's length the blocks hold,
    vLLM's "Maximum concurrency for N tokens per request: 1.56x") are vLLM's own units.
    """

    budget: int  # gpu_memory_utilization × device memory
    available: int  # budget minus everything but the KV cache (may be negative)
    tokens: int
    max_batch: int
    max_sequence_length: int
    blocks: int = 0
    block_size: int = VLLM_BLOCK_SIZE
    kv_bytes: int = 0
    max_concurrency: float = 0.0
    engine: str = "generic"
    groups: int = 1  # vLLM V1 hybrid KV cache groups sharing the blocks

    def engine_units(self) -> dict[str, int | float]:
        """The capacity as the engine's own start-up log states it."""
        if self.engine == "sglang":  # "max_total_num_tokens=N", "KV Cache is allocated. #tokens"
            return {"max_total_num_tokens": self.tokens}
        if self.engine == "trtllm":  # "Allocated X GiB for max tokens in paged KV cache (N)"
            return {
                "max_tokens_in_paged_kv_cache": self.tokens,
                "tokens_per_block": self.block_size,
                "blocks": self.blocks,
            }
        # vLLM: "# GPU blocks", "GPU KV cache size: N tokens", "Maximum concurrency …: 1.56x"
        out: dict[str, int | float] = {
            "num_gpu_blocks": self.blocks,
            "gpu_kv_cache_tokens": self.tokens,
            "max_concurrency": round(self.max_concurrency, 2),
        }
        if self.groups > 1:
            out["kv_cache_groups"] = self.groups
        return out


def kv_capacity(
    *,
    device_memory: int,
    utilization: float,
    non_kv_bytes: int,
    per_token: int,
    batch: int,
    sequence_length: int,
    block_size: int = VLLM_BLOCK_SIZE,
    sequence_bytes: int | None = None,
    engine: str = "generic",
    round_up: bool = False,
    groups: int = 1,
) -> KvCapacity:
    """Tokens of KV one rank can hold under ``utilization`` (vLLM ``gpu_memory_utilization``).

    >>> kv_capacity(device_memory=100, utilization=1.0, non_kv_bytes=36, per_token=2,
    ...             batch=2, sequence_length=8, block_size=1).tokens
    32
    """
    budget = memory_budget(device_memory, training=False, gpu_memory_utilization=utilization)
    assert budget is not None
    available = budget - non_kv_bytes
    if per_token <= 0:
        return KvCapacity(budget, available, 0, 0, 0, engine=engine)
    if round_up:  # TensorRT-LLM: whole tokens, then up to whole blocks
        blocks = -(-(max(available, 0) // per_token) // block_size)
    else:
        blocks = max(available, 0) // (per_token * block_size)
    # vLLM V1 hybrid models: ``per_token`` is one token slot of a whole group of layers and
    # each of the ``groups`` takes its blocks from the same pool ("GPU KV cache size" =
    # num_blocks // groups × block_size).
    tokens = blocks // groups * block_size
    kv_bytes = blocks * block_size * per_token
    if sequence_bytes is None:
        sequence_bytes = per_token * sequence_length
    concurrency = kv_bytes / sequence_bytes if sequence_bytes else 0.0
    return KvCapacity(
        budget=budget,
        available=available,
        tokens=tokens,
        max_batch=int(concurrency) if sequence_length else 0,
        max_sequence_length=tokens // batch if batch else 0,
        blocks=blocks,
        block_size=block_size,
        kv_bytes=kv_bytes,
        max_concurrency=concurrency,
        engine=engine,
        groups=groups,
    )
