"""Qwen2 / Qwen2.5: Llama's tensors with q/k/v biases always and never an o_proj bias.

Placement follows vLLM ``qwen2.py`` (``Qwen2ForCausalLM``: biases split with their weights).
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._family import MegatronDecl  # megatron-moe
from shardctl.archs._keys import DECODER_OTHER, SLIDING

FAMILY = decoder_family(
    "qwen2",
    qkv_bias=True,
    o_bias=False,
    follows="vLLM qwen2.py",
    config_keys=(*DECODER_OTHER, *SLIDING),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
