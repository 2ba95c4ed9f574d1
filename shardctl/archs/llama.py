"""Llama (1, 2, 3.x): the generic decoder, plus ``attention_bias`` and ``mlp_bias`` from the config.

Placement follows vLLM ``llama.py`` (``LlamaForCausalLM``) and Megatron-Core ``GPTModel``.
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family

FAMILY = decoder_family("llama", mlp_bias=None)
