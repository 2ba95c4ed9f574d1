"""The config keys a manifest may type under ``model:`` (inline HF config fields), per family.

Two lists per family, from transformers 5.23's config classes (``LlamaConfig().to_dict()`` …)
plus the spellings older hub ``config.json`` files still carry:

- :data:`SHAPE_KEYS`: the keys :mod:`shardctl.model.archs` reads — they set tensor shapes, so
  the plan's bytes;
- :data:`PASS_THROUGH`: keys transformers configs carry that do not change any tensor's shape
  (rope settings, token ids, dropout, norm epsilons, activations). Accepted and ignored.
  ``sliding_window`` is here too: the KV cache is priced for the whole context (an upper bound;
  vLLM's hybrid allocator can hold less for sliding-window layers).

Any other key typed in the manifest is an error with a did-you-mean (``num_key_value_head`` →
``num_key_value_heads``): a typo there silently changes the model. A ``config.json`` named by
``model.config`` is not checked this way (real files carry many more keys).
"""

from __future__ import annotations

import difflib

# PretrainedConfig's own keys and the generation/tokenizer ids every family's config carries.
_COMMON = (
    "model_type",
    "architectures",
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "tie_encoder_decoder",
    "auto_map",
    "num_labels",
    "cache_implementation",
)
_ROPE = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
_LLAMA_SHAPES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)
_LLAMA_OTHER = (*_COMMON, *_ROPE, "hidden_act", "rms_norm_eps", "attention_dropout")
_SLIDING = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "llama": (*_LLAMA_SHAPES, "attention_bias", "mlp_bias"),
    "mistral": _LLAMA_SHAPES,
    "qwen2": _LLAMA_SHAPES,
    "qwen3": (*_LLAMA_SHAPES, "attention_bias"),
    "mixtral": (*_LLAMA_SHAPES, "num_local_experts", "num_experts_per_tok"),
    "phi3": _LLAMA_SHAPES,
    "gemma": (*_LLAMA_SHAPES, "attention_bias"),
    "gemma2": (*_LLAMA_SHAPES, "attention_bias"),
    "gpt2": (
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "n_positions",
        "vocab_size",
        "tie_word_embeddings",
    ),
}

PASS_THROUGH: dict[str, tuple[str, ...]] = {
    "llama": (*_LLAMA_OTHER, "pretraining_tp"),
    "mistral": (*_LLAMA_OTHER, *_SLIDING),
    "qwen2": (*_LLAMA_OTHER, *_SLIDING),
    "qwen3": (*_LLAMA_OTHER, *_SLIDING),
    "mixtral": (
        *_LLAMA_OTHER,
        *_SLIDING,
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    ),
    "phi3": (
        *_LLAMA_OTHER,
        *_SLIDING,
        "embd_pdrop",
        "resid_pdrop",
        "original_max_position_embeddings",
    ),
    "gemma": (*_LLAMA_OTHER, "hidden_activation", "use_bidirectional_attention"),
    "gemma2": (
        *_LLAMA_OTHER,
        *_SLIDING,
        "hidden_activation",
        "use_bidirectional_attention",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "sliding_window_pattern",
    ),
    "gpt2": (
        *_COMMON,
        "n_ctx",  # older configs' copy of n_positions; shapes use n_positions
        "activation_function",
        "add_cross_attention",
        "attn_pdrop",
        "embd_pdrop",
        "resid_pdrop",
        "layer_norm_epsilon",
        "reorder_and_upcast_attn",
        "scale_attn_by_inverse_layer_idx",
        "scale_attn_weights",
        "summary_activation",
        "summary_first_dropout",
        "summary_proj_to_labels",
        "summary_type",
        "summary_use_proj",
        "task_specific_params",
    ),
}
assert set(SHAPE_KEYS) == set(PASS_THROUGH)

# Keys that do change memory but are read elsewhere: say where instead of ignoring them.
REDIRECTED = {
    "quantization_config": "give the manifest's quantization: section (method, group_size)",
}


def known_keys(model_type: str) -> tuple[str, ...] | None:
    """Every key the manifest accepts inline for ``model_type``; None for other families."""
    if model_type not in SHAPE_KEYS:
        return None
    return SHAPE_KEYS[model_type] + PASS_THROUGH[model_type]


def unknown_key_hint(model_type: str, key: str) -> str:
    """``did you mean 'num_key_value_heads'?`` — shape keys first, then the pass-through list."""
    if key in REDIRECTED:
        return REDIRECTED[key]
    for pool in (SHAPE_KEYS[model_type], PASS_THROUGH[model_type]):
        close = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
        if close:
            return f"did you mean {close[0]!r}?"
    return (
        f"{model_type} keys that set shapes: {', '.join(SHAPE_KEYS[model_type])}; keys that "
        "do not change memory are accepted and ignored (docs: manifest reference); or point "
        "model.config at a config.json"
    )
