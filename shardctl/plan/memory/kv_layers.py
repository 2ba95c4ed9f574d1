"""KV cache per layer: sliding-window layers, MLA's compressed cache, mixed attention.

A full-attention layer stores ``2 · k_r · d`` elements per token for every token of the
sequence (:mod:`.kv`). Two kinds of layer store less:

- **sliding window** (Mistral-7B-v0.1: every layer, window 4096; Gemma-2: every other layer,
  HF ``Gemma2DecoderLayer.is_sliding = not layer_idx % 2``; any config with ``layer_types``):
  only the last ``window`` tokens, so a sequence of ``s`` tokens costs ``min(window, s)``
  tokens of that layer (vLLM's ``SlidingWindowSpec``). Mistral-7B-v0.1 at 32k: 4.0 GiB →
  0.5 GiB per sequence.
- **MLA** (DeepSeek-V2/V3, config ``kv_lora_rank`` and ``qk_rope_head_dim``): one latent
  vector of ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, not per head,
  and the same on every tp rank (vLLM's ``MLAAttentionSpec``: no K/V split over heads).
  DeepSeek-V3: (512 + 64) · 61 layers · 2 bytes = 70,272 B per token in bf16.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardctl.archs import find
from shardctl.dtypes import DTYPE_BITS
from shardctl.model.types import ModelDims
from shardctl.plan.memory.shapes import kv_heads_per_rank


def _window(config: Mapping[str, Any]) -> int | None:
    w = config.get("sliding_window")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def layer_windows(
    model_type: str, config: Mapping[str, Any], num_layers: int
) -> tuple[int | None, ...]:
    """Per layer, its attention window in tokens, ``None`` for full attention.

    >>> layer_windows("gemma2", {"sliding_window": 4096}, 4)
    (4096, None, 4096, None)
    """
    window = _window(config)
    types = config.get("layer_types")
    if window is not None and isinstance(types, Sequence) and len(types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window is None or config.get("use_sliding_window") is False:
        return (None,) * num_layers
    # Without layer_types, the family file says which layers slide.
    family = find(model_type)
    sliding = family.sliding_layers if family is not None else "none"
    if sliding == "all":
        return (window,) * num_layers
    if sliding == "even":
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if sliding == "pattern":  # Gemma-3: every N-th layer global, HF Gemma3TextConfig
        n = config.get("sliding_window_pattern", config.get("_sliding_window_pattern"))
        if n is None and family is not None:
            n = family.sliding_period
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return tuple(window if (i + 1) % n else None for i in range(num_layers))
    return (None,) * num_layers


def mla_latent_width(config: Mapping[str, Any]) -> int | None:
    """``kv_lora_rank + qk_rope_head_dim`` for an MLA model, else ``None``."""
    rank, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    if isinstance(rank, int) and isinstance(rope, int) and rank > 0:
        return rank + rope
    return None


def layer_bytes_per_token(
    dims: ModelDims, dtype: str, *, tp: int, mla_width: int | None = None
) -> int:
    """Bytes one token adds to one layer's cache on one tp rank.

    >>> from shardctl.model.types import ModelDims
    >>> d = ModelDims(7168, 61, 128, 128, 128, 18432, 129280, False)
    >>> layer_bytes_per_token(d, "BF16", tp=8, mla_width=512 + 64) * 61  # DeepSeek-V3
    70272
    """
    nbytes = DTYPE_BITS[dtype] // 8
    if mla_width is not None:
        return mla_width * nbytes
    return 2 * kv_heads_per_rank(dims.num_kv_heads, tp) * dims.head_dim * nbytes


def sequence_kv_bytes(
    per_layer: int, windows: Sequence[int | None], length: int, *, block_size: int = 1
) -> int:
    """KV bytes of one sequence of ``length`` tokens over ``windows`` (one entry per layer),
    each layer's tokens rounded up to whole blocks of ``block_size``.

    >>> sequence_kv_bytes(131072 // 32, (4096,) * 32, 32768) / 2**30  # Mistral-7B-v0.1
    0.5
    """
    total = 0
    for w in windows:
        tokens = length if w is None else min(w, length)
        total += -(-tokens // block_size) * block_size
    return per_layer * total


def hybrid_groups(windows: Sequence[int | None]) -> tuple[int, tuple[tuple[int | None, int], ...]]:
    """vLLM V1's KV cache groups for layers of several attention kinds (``kv_cache_utils.
    _get_kv_cache_config_uniform_page_size``): the layers are sorted by kind (full, or each
    sliding window); ``group_size`` is the fewest layers of any kind, and each kind is split
    into groups of ``group_size`` layers, its last group padded with empty layers. Returns
    ``(group_size, ((window, layers incl. padding), ...))``; one kind: ``(layers, ((w, n),))``.

    >>> hybrid_groups([1024] * 5 + [None] + [1024] * 5 + [None])  # Gemma-3's 5:1
    (2, ((1024, 10), (None, 2)))
    >>> hybrid_groups([1024] * 52 + [None] * 10)  # 62 layers of Gemma-3-27B: 8 padding layers
    (10, ((1024, 60), (None, 10)))
    """
    counts: dict[int | None, int] = {}
    for w in windows:
        counts[w] = counts.get(w, 0) + 1
    if not counts:
        return 0, ()
    size = min(counts.values())
    return size, tuple((w, -(-n // size) * size) for w, n in counts.items())


def vllm_layer_tokens(
    window: int | None, length: int, *, block_size: int, batched_tokens: int
) -> int:
    """Token slots (whole blocks) one layer reserves for one sequence of ``length`` tokens in
    vLLM V1 (``kv_cache_interface``, ``max_memory_usage_bytes``): a full-attention layer
    ``cdiv(length, block)`` blocks; a sliding-window layer ``cdiv(min(window − 1 +
    max_num_batched_tokens, length), block) + 1`` — a prefill chunk attends to the window
    before it, and the window need not start at a block boundary.

    >>> vllm_layer_tokens(4096, 32768, block_size=16, batched_tokens=2048)
    6160
    """
    if window is None:
        return -(-length // block_size) * block_size
    tokens = min(window - 1 + batched_tokens, length)
    return (-(-tokens // block_size) + 1) * block_size


def vllm_sequence_kv_bytes(
    per_layer: int,
    windows: Sequence[int | None],
    length: int,
    *,
    block_size: int,
    batched_tokens: int,
) -> int:
    """KV bytes vLLM V1 reserves for one sequence over ``windows`` (one entry per layer): each
    layer's :func:`vllm_layer_tokens`; with layers of several kinds, the padding layers of
    :func:`hybrid_groups` too (their blocks are allocated with their group's)."""
    kinds = set(windows)
    if len(kinds) > 1:
        _size, groups = hybrid_groups(windows)
        pairs: Sequence[tuple[int | None, int]] = groups
    else:
        pairs = [(w, 1) for w in windows]
    slots = sum(
        n * vllm_layer_tokens(w, length, block_size=block_size, batched_tokens=batched_tokens)
        for w, n in pairs
    )
    return per_layer * slots
