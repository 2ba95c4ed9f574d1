"""IBM Granite (3.x dense): Llama's tensors; the differences are config scalars, not tensors.

``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` (the attention scale)
and ``logits_scaling`` act on activations, so they survive tensor parallelism unchanged;
``attention_bias`` / ``mlp_bias`` come from the config. Placement follows vLLM ``granite.py``
(``GraniteForCausalLM``, Llama's parallel linears).
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES

FAMILY = decoder_family(
    "granite",
    mlp_bias=None,
    follows="vLLM granite.py",
    shape_keys=(*DECODER_SHAPES, "attention_bias", "mlp_bias"),
    config_keys=(
        *DECODER_OTHER,
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
