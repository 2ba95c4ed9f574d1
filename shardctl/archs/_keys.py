"""Config keys shared by the families' ``shape_keys`` / ``config_keys`` (a manifest's ``model:``).

From transformers 5.23's config classes (``LlamaConfig().to_dict()`` …) plus the spellings older
hub ``config.json`` files still carry. ``shape_keys`` are read by the family's inventory (they set
the plan's bytes); ``config_keys`` do not change any tensor's shape (rope settings, token ids,
dropout, norm epsilons, activations): accepted and ignored. ``sliding_window`` is among the
latter: the KV cache is priced for the whole context (an upper bound; vLLM's hybrid allocator can
hold less for sliding-window layers).
"""

from __future__ import annotations

# PretrainedConfig's own keys and the generation/tokenizer ids every family's config carries.
COMMON = (
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
ROPE = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
DECODER_SHAPES = (
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
DECODER_OTHER = (*COMMON, *ROPE, "hidden_act", "rms_norm_eps", "attention_dropout")
SLIDING = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
