"""The serving engines' rotary tables: a ``[positions, rotary_dim]`` cos/sin cache per rank.

vLLM and SGLang build rotary embeddings through ``get_rope``, which computes every position's
cos and sin once at model construction and keeps them on the device as a non-persistent buffer
(``RotaryEmbedding.cos_sin_cache``, ``register_buffer(..., persistent=False)``). It is not in
the checkpoint, so the weights' bytes miss it, but it is allocated inside the engine's weight
measurement (vLLM: "Model loading took"; SGLang: "Load weight end ... mem usage") on every rank.
``get_rope`` caches one instance per distinct ``(head_size, rotary_dim, max_position, rope
parameters, dtype)``, so a model holds one table per distinct rope (Gemma-3: a local and a
global one), not one per layer.

Rows, per ``rope_type`` (vLLM ``model_executor/layers/rotary_embedding``, read 2026-11):

- ``default``, ``llama3``, ``ntk``: ``max_position_embeddings`` (``base.py``
  ``_compute_cos_sin_cache``: ``torch.arange(max_position_embeddings)``);
- ``linear`` and ``dynamic`` (with ``factor``): ``max_position_embeddings · factor``
  (``linear_scaling_rope.py``, ``dynamic_ntk_scaling_rope.py``);
- ``yarn`` and DeepSeek's ``deepseek_yarn``: ``original_max_position_embeddings · factor``
  (``get_rope`` passes the original length; the class multiplies by the factor);
- ``longrope`` (Phi-3 128k): a short table of ``original_max_position_embeddings`` rows and a
  long one of ``max_position_embeddings`` rows, concatenated.

Columns: ``rotary_dim`` = ``head_dim · partial_rotary_factor`` (GPT-NeoX ``rotary_pct``,
DeepSeek's ``qk_rope_head_dim``, MiniMax-M2's own ``rotary_dim`` key, which vLLM
``minimax_m2.py`` turns into the factor). Element size:

- vLLM: the model's dtype (``cache = cache.to(dtype)``; ``use_flashinfer`` is hard-wired
  ``False`` in ``base.py``), except gpt-oss, whose attention asks ``get_rope(...,
  dtype=torch.float32)``;
- SGLang on CUDA: float32 (``layers/rotary_embedding.py``: ``if not _is_cuda: cache =
  cache.to(dtype)`` — "cache needs to be in FP32 for numerical stability").

Measured: Llama-4-Scout's ``max_position_embeddings`` is 10,485,760, so its one llama3 table is
10,485,760 × 128 × 2 B = 2.5 GiB per rank. vLLM 0.19's "Model loading took 53.12 GiB" at tp 4
on H100 (llm-d-planner accuracy logs) is the 50.59 GiB of tensor-parallel weights plus this
table; without it shardctl priced 16 % more KV tokens than vLLM allocated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardctl.archs import find, language_model
from shardctl.model.types import ModelInfo

# families whose vLLM attention builds its rope in float32 whatever the model's dtype
_FP32_IN_VLLM = frozenset({"gpt_oss"})


def positive_number(x: Any) -> float | None:
    """``x`` as a float when it is a positive int or float (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0:
        return None
    return float(x)


def positive_int(x: Any) -> int | None:
    """``x`` when it is a positive int (not a bool), else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


# the config keys a maximum length may sit under (vLLM ``_get_and_verify_max_len``'s list)
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config's language-model section (Llama-4, Gemma-3, Mistral-3: the engines'
    ``hf_text_config``) when the top level names no length, else the config itself."""
    sub = config.get("text_config")
    if isinstance(sub, Mapping) and not any(k in config for k in LENGTH_KEYS):
        return sub
    return config


def language_config(model: ModelInfo) -> tuple[str, Mapping[str, Any]]:
    """``model``'s language model as ``(model_type, config)``: a multimodal family's text
    section with its config class's defaults (``archs.language_model``: Gemma-3's
    ``gemma3_text``), else :func:`text_config` of the config itself."""
    arch, config = language_model(model.architecture, model.config)
    return arch, text_config(config)


def rope_sets(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The distinct rope parameter sets a model builds: ``rope_parameters`` (transformers 5:
    one dict, or one per layer type) or ``rope_scaling`` (transformers 4), else the default."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        per_type = [v for v in params.values() if isinstance(v, Mapping)]
        if per_type and len(per_type) == len(params):
            return per_type  # {"full_attention": {...}, "sliding_attention": {...}}
        return [params]
    scaling = config.get("rope_scaling")
    return [scaling] if isinstance(scaling, Mapping) and scaling else [{}]


def _rows(rope: Mapping[str, Any], config: Mapping[str, Any], max_position: int) -> int | None:
    """Positions in one rope's table (None: a rope type this module does not know)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    factor = positive_number(rope.get("factor"))
    original = positive_int(rope.get("original_max_position_embeddings")) or positive_int(
        config.get("original_max_position_embeddings")
    )
    if kind in ("default", "llama3", "ntk", "mllama4"):
        return max_position
    if kind in ("linear", "dynamic"):
        if kind == "dynamic" and factor is None:  # the alpha variant keeps the length
            return max_position
        return math.ceil(max_position * factor) if factor is not None else None
    if kind in ("yarn", "deepseek_yarn", "deepseek_llama_scaling"):
        if factor is None or original is None:
            return None
        return math.ceil(original * factor)
    if kind in ("longrope", "su"):
        return None if original is None else original + max_position
    return None


def _rotary_dim(arch: str, config: Mapping[str, Any], head_dim: int) -> int:
    rope_dim = positive_int(config.get("qk_rope_head_dim"))  # MLA: the rope part of each head
    if rope_dim is not None:
        return rope_dim
    rotary = positive_int(config.get("rotary_dim"))  # MiniMax-M2: 64 of 128 (vLLM's factor)
    if rotary is not None and config.get("partial_rotary_factor") is None:
        return min(rotary, head_dim)
    fraction = positive_number(config.get("partial_rotary_factor"))
    if fraction is None:
        params = config.get("rope_parameters")
        if isinstance(params, Mapping):
            fraction = positive_number(params.get("partial_rotary_factor"))
    if fraction is None and arch == "gpt_neox":
        fraction = positive_number(config.get("rotary_pct")) or 0.25  # GPTNeoXConfig's default
    return int(head_dim * (fraction if fraction is not None else 1.0))


def rotary_cache_bytes(model: ModelInfo, dtype_bytes: int, *, engine: str) -> int:
    """Bytes of the cos/sin tables one rank of ``engine`` (``"vllm"`` or ``"sglang"``) builds
    for ``model`` at activation element size ``dtype_bytes``; 0 when the model has no rotary
    embedding or its length is unknown (a bare parameter count, dimensions without
    ``max_position_embeddings``)."""
    dims = model.dims
    if dims is None:
        return 0
    family = find(model.architecture)
    if family is not None and family.memory(model.config).positions:
        return 0  # learned absolute positions (GPT-2): no rotary table
    arch, config = language_config(model)
    if config.get("alibi") is True or config.get("position_embedding_type") == "alibi":
        return 0  # Falcon-7B-style ALiBi: no rotary table
    max_position = positive_int(config.get("max_position_embeddings")) or (
        dims.max_position_embeddings
    )
    if max_position <= 0:
        return 0
    if engine == "sglang":
        item = 4
    elif arch in _FP32_IN_VLLM:
        item = 4
    else:
        item = dtype_bytes
    rotary_dim = _rotary_dim(arch, config, dims.head_dim)
    tables: dict[str, int] = {}  # one table per distinct rope, as get_rope caches them
    for rope in rope_sets(config):
        rows = _rows(rope, config, max_position)
        if rows is not None:
            tables[repr(sorted(rope.items(), key=lambda kv: str(kv[0])))] = rows
    local = positive_number(config.get("rope_local_base_freq"))
    if arch == "gemma3_text" and len(tables) == 1 and local is not None:
        # Gemma-3 (transformers 4 config): the sliding layers use the default rope at
        # ``rope_local_base_freq``, the global ones ``rope_scaling`` (vLLM gemma3.py)
        tables["local"] = max_position
    return sum(rows * rotary_dim * item for rows in tables.values())
