"""The longest sequence a serving engine accepts for a model, and its refusal past it.

vLLM refuses to start when ``--max-model-len`` exceeds what it derives from the model's config
(``vllm/config/model.py``, ``_get_and_verify_max_len``), before any memory is measured:

    ValueError: User-specified max_model_len (8192) is greater than the derived max_model_len
    (max_position_embeddings=2048.0 or model_max_length=None in model's config.json). To allow
    overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. ...

(microsoft/phi-2 at 8,192 in the llm-d-planner vLLM 0.19 sweep; the same model at 2,048
started). The derivation, on the language model's config:

- the smallest of ``max_position_embeddings``, ``n_positions``, ``max_seq_len``,
  ``seq_length``, ``model_max_length``, ``max_target_positions``, ``max_sequence_length``,
  ``max_seq_length``, ``seq_len``; a config ``model_max_length`` replaces it (Command-R);
- times the rope ``factor`` for rope types other than ``llama3``, ``longrope``/``su`` and
  ``default`` (no factor), except Gemma-3, whose length is already scaled; ``yarn`` starts
  from ``original_max_position_embeddings`` instead;
- no key at all: vLLM takes the user's length (no refusal).

SGLang refuses the same way (``ModelConfig``: "User-specified context_length ... is greater
than the derived context_length"; ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` overrides),
but derives the length its own way (``hf_transformers_utils.get_context_length``): the first
of ``max_sequence_length``, ``seq_length``, ``max_seq_len``, ``model_max_length``,
``max_position_embeddings`` (in that order, not the smallest), times ``rope_scaling``'s
``factor`` unless the rope is ``llama3`` or names ``original_max_position_embeddings`` (so a
Qwen2.5 with yarn × 4 stays at its 32,768 in SGLang and reaches 131,072 in vLLM); no key: 2,048.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardctl.model.types import ModelInfo
from shardctl.plan.memory.rotary import (
    LENGTH_KEYS,
    language_config,
    positive_int,
    positive_number,
    rope_sets,
)

_UNSCALED = ("llama3", "longrope", "su", "default")
_OVERRIDE = {
    "vllm": "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
    "sglang": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",
}


_SGLANG_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def _sglang_max_len(model: ModelInfo) -> tuple[float, str] | None:
    config = language_config(model)[1]
    found = [(v, k) for k in _SGLANG_KEYS if (v := positive_int(config.get(k))) is not None]
    if not found and model.dims is not None and model.dims.max_position_embeddings > 0:
        found = [(model.dims.max_position_embeddings, "max_position_embeddings")]
    if not found:
        return None  # SGLang assumes 2,048; an inline model without a config is not refused
    length, key = found[0]
    scaling = config.get("rope_scaling")
    factor = 1.0
    if isinstance(scaling, Mapping) and scaling:
        factor = positive_number(scaling.get("factor")) or 1.0
        if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
            factor = 1.0
    return length * factor, key


def derived_max_len(model: ModelInfo, engine: str = "vllm") -> tuple[float, str] | None:
    """The maximum length ``engine`` (``"vllm"`` or ``"sglang"``) derives for ``model`` and
    the config key it came from, or None when the config names no length (vLLM then takes the
    user's)."""
    if engine == "sglang":
        return _sglang_max_len(model)
    arch, config = language_config(model)
    found = [(v, k) for k in LENGTH_KEYS if (v := positive_int(config.get(k))) is not None]
    if not found and model.dims is not None and model.dims.max_position_embeddings > 0:
        found = [(model.dims.max_position_embeddings, "max_position_embeddings")]
    if not found:
        return None
    length: float
    length, key = min(found)
    if positive_int(config.get("model_max_length")) is not None:
        length, key = config["model_max_length"], "model_max_length"
    if arch == "gemma3_text":
        return length, key
    factor = 1.0
    for rope in rope_sets(config):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in _UNSCALED:
            continue
        factor = positive_number(rope.get("factor")) or factor
        original = positive_int(rope.get("original_max_position_embeddings"))
        if kind == "yarn" and original is not None:
            length, key = original, "rope original_max_position_embeddings"
    return length * factor, key


def refusal(model: ModelInfo, engine: str, max_model_len: int) -> str | None:
    """Why ``engine`` (``"vllm"`` or ``"sglang"``) refuses to start ``model`` at
    ``max_model_len`` tokens, or None when it accepts the length."""
    if engine not in _OVERRIDE or max_model_len <= 0:
        return None
    got = derived_max_len(model, engine)
    if got is None or max_model_len <= got[0]:
        return None
    length, key = got
    allowed = positive_int(language_config(model)[1].get("model_max_length"))
    if engine == "vllm" and allowed is not None and max_model_len <= allowed:
        return None
    shown = int(length) if float(length).is_integer() else length
    return (
        f"{engine} refuses to start: sequence_length {max_model_len} is longer than the "
        f"model's {shown:,} positions ({key} in config.json); lower workload.sequence_length "
        f"to {int(length)} or less, or run the engine with {_OVERRIDE[engine]} (positions past "
        f"{int(length)} are untrained)"
    )
