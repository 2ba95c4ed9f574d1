"""Llama (1, 2, 3.x): the generic decoder, plus ``attention_bias`` and ``mlp_bias`` from the config.

Placement follows vLLM ``llama.py`` (``LlamaForCausalLM``) and Megatron-Core ``GPTModel``.
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._family import MegatronDecl  # megatron-moe
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES

FAMILY = decoder_family(
    "llama",
    mlp_bias=None,
    shape_keys=(*DECODER_SHAPES, "attention_bias", "mlp_bias"),
    config_keys=(*DECODER_OTHER, "pretraining_tp"),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(),
)
