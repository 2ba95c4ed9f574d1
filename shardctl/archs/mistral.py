"""Mistral: Llama's tensors (sliding window is a runtime setting, not a tensor).

Placement follows vLLM ``llama.py`` (Mistral is served by ``LlamaForCausalLM``) and Megatron-Core.
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._family import MegatronDecl  # megatron-moe
from shardctl.archs._keys import DECODER_OTHER, SLIDING

FAMILY = decoder_family(
    "mistral",
    config_keys=(*DECODER_OTHER, *SLIDING),
    sliding_layers="all",  # Mistral-7B-v0.1: every layer, window 4096
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
