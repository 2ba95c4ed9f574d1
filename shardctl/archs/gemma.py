"""Gemma (1): Llama's tensors, tied head by default, ``head_dim`` independent of hidden / heads.

The embedding is scaled by sqrt(hidden) inside the model (no tensor for it). Placement follows
vLLM ``gemma.py`` (``GemmaForCausalLM``).
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES

FAMILY = decoder_family(
    "gemma",
    tied_default=True,
    follows="vLLM gemma.py",
    shape_keys=(*DECODER_SHAPES, "attention_bias"),
    config_keys=(*DECODER_OTHER, "hidden_activation", "use_bidirectional_attention"),
)
