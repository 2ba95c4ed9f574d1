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

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
