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
