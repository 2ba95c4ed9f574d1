"""Gemma-2: Gemma plus ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` per layer.

Logit soft-capping and alternating sliding windows are config, not tensors (verify's local
config slices ``layer_types`` to the rank's stage). Placement follows vLLM ``gemma2.py``.
"""

from __future__ import annotations

from shardctl.archs._decoder import decoder_family
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING

FAMILY = decoder_family(
    "gemma2",
    tied_default=True,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    follows="vLLM gemma2.py",
    sliding_layers="even",  # HF Gemma2DecoderLayer.is_sliding = not layer_idx % 2
    shape_keys=(*DECODER_SHAPES, "attention_bias"),
    config_keys=(
        *DECODER_OTHER,
        *SLIDING,
        "hidden_activation",
        "use_bidirectional_attention",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "sliding_window_pattern",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import NO_LM_HEAD, declare  # noqa: E402

FAMILY = declare(FAMILY, NO_LM_HEAD)
