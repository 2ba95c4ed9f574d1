"""Gemma-3 (text: ``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma-2's four norms per
layer plus Qwen3-style per-head ``q_norm`` / ``k_norm [head_dim]``; 5 local (sliding-window)
layers to 1 global, tied embeddings, a 262,144-token vocabulary.

On disk (``save_pretrained``)::

    model.embed_tokens.weight [V, H]  (scaled by sqrt(H) inside the embedding module)
    self_attn.{q,k,v,o}_proj.weight   self_attn.q_norm.weight / k_norm.weight [head_dim]
    input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
    post_feedforward_layernorm [H]    mlp.{gate,up,down}_proj.weight    model.norm.weight [H]

The per-head norms act on one head, so every rank holds them whole (replicated). Sliding windows
and local/global rope are config (``layer_types``: verify's local config slices it to the rank's
stage). Placement follows vLLM ``gemma3.py`` (``Gemma3ForCausalLM``).

The multimodal config (model_type ``gemma3``, ``Gemma3ForConditionalGeneration``) is
:mod:`gemma3_mm`: this model under ``language_model.`` beside a SigLIP tower.
"""

from __future__ import annotations

import dataclasses

from shardctl.archs._decoder import decoder_dims, decoder_family
from shardctl.archs._family import Config
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.model.types import ModelDims


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    if config.get("head_dim") is None:  # transformers' Gemma3TextConfig default, not H / heads
        config = {**config, "head_dim": 256}
    return decoder_dims(config, tied, where)


_FAMILY = decoder_family(
    "gemma3",
    model_types=("gemma3_text",),
    tied_default=True,
    qk_norm=True,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    follows="vLLM gemma3.py (Gemma3ForCausalLM)",
    sliding_layers="pattern",  # without layer_types: 5 local : 1 global (sliding_window_pattern)
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
        "_sliding_window_pattern",
        "rope_local_base_freq",
    ),
)
FAMILY = dataclasses.replace(_FAMILY, dims=_dims, sliding_period=6)  # Gemma3TextConfig default

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
