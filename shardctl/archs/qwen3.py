"""Qwen3 (dense): Llama's tensors plus per-head RMSNorm ``self_attn.q_norm/k_norm [head_dim]``.

The q/k norms act on one head, so every rank holds them whole (replicated). Placement follows
vLLM ``qwen3.py`` (``Qwen3ForCausalLM``).
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._family import MegatronDecl  # megatron-moe
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING

FAMILY = decoder_family(
    "qwen3",
    qk_norm=True,
    follows="vLLM qwen3.py",
    shape_keys=(*DECODER_SHAPES, "attention_bias"),
    config_keys=(*DECODER_OTHER, *SLIDING),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(),
)
