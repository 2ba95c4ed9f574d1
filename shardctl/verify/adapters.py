"""What the sharded forward must know per architecture: names, local config, module fixes.

A rank builds transformers' own model class from a *local* config (heads, kv heads,
intermediate size and vocab divided by tp; only its stage's layers), loads its local tensors by
their on-disk names, then wraps the modules whose outputs are partial sums (row-parallel) or
vocab slices. The adapter says which modules those are::

    llama  o_proj, down_proj: row-parallel (weight [out, in/tp], all-reduce, bias once)
    gpt2   attn.c_proj, mlp.c_proj: row-parallel, but Conv1D stores [in, out] -> [in/tp, out]

Fused tensors (Phi-3 ``qkv_proj`` / ``gate_up_proj``, GPT-2 ``c_attn``) are split by the model
at its *local* sizes: a rank holding ``[Q_r; K_r; V_r]`` computes correctly, a rank holding a
plain chunk of ``[Q; K; V]`` does not — which is what the forward level is there to catch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shardctl.errors import InvalidInputError

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
SUPPORTED: tuple[str, ...] = (*_LLAMA_LIKE, "gpt2")


@dataclass(frozen=True)
class Dims:
    """Global sizes the local config divides."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    experts: int
    tied: bool


@dataclass(frozen=True)
class Adapter:
    """Per-architecture names (relative to the model root) and conventions."""

    arch: str
    layer_prefix: str  # "model.layers" -> "model.layers.{i}."
    embeddings: tuple[str, ...]  # token (vocab) embedding first
    final_norm: str
    lm_head: str
    row_parallel: tuple[str, ...]  # module paths inside a layer
    conv1d: bool  # GPT-2: weights stored [in, out]

    @property
    def layer_re(self) -> re.Pattern[str]:
        return re.compile(rf"^{re.escape(self.layer_prefix)}\.(\d+)\.(.+)$")


def adapter_for(arch: str) -> Adapter:
    if arch == "gpt2":
        return Adapter(
            arch="gpt2",
            layer_prefix="transformer.h",
            embeddings=("transformer.wte", "transformer.wpe"),
            final_norm="transformer.ln_f",
            lm_head="lm_head",
            row_parallel=("attn.c_proj", "mlp.c_proj"),
            conv1d=True,
        )
    if arch in _LLAMA_LIKE:
        return Adapter(
            arch=arch,
            layer_prefix="model.layers",
            embeddings=("model.embed_tokens",),
            final_norm="model.norm",
            lm_head="lm_head",
            row_parallel=("self_attn.o_proj",)
            if arch == "mixtral"
            else ("self_attn.o_proj", "mlp.down_proj"),
            conv1d=False,
        )
    raise InvalidInputError(
        f"forward level does not support architecture {arch!r}",
        hint=f"supported: {', '.join(SUPPORTED)}; use --level bitwise",
    )


def dims_of(cfg: dict[str, Any]) -> Dims:
    arch = cfg.get("model_type", "")
    if arch == "gpt2":
        hidden = int(cfg.get("n_embd", 768))
        heads = int(cfg.get("n_head", 12))
        return Dims(
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            intermediate=int(cfg.get("n_inner") or 4 * hidden),
            vocab=int(cfg["vocab_size"]),
            layers=int(cfg.get("n_layer", 12)),
            experts=0,
            tied=bool(cfg.get("tie_word_embeddings", True)),
        )
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return Dims(
        hidden=hidden,
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        layers=int(cfg["num_hidden_layers"]),
        experts=int(cfg.get("num_local_experts") or 0),
        tied=bool(cfg.get("tie_word_embeddings", arch == "gemma")),
    )


def _div(what: str, n: int, tp: int) -> int:
    if n % tp:
        raise InvalidInputError(
            f"forward level needs tp={tp} to divide {what}={n}",
            hint="uneven tensor-parallel splits are checked by --level bitwise only",
        )
    return n // tp


def local_config(
    cfg: dict[str, Any],
    *,
    tp: int,
    ep: int,
    first_layer: int,
    num_layers: int,
    vocab: int,
) -> dict[str, Any]:
    """The config of one rank's model: local heads/intermediate/vocab, its stage's layers.

    ``kv heads`` become ``max(1, kv // tp)``: with ``tp > kv`` each rank holds one replicated
    kv head (rank r: head ``r // (tp / kv)``). Experts stay global here (the router scores all
    of them); the expert module is rebuilt with the rank's experts (see ``tp_model``).
    """
    d = dims_of(cfg)
    local = dict(cfg)
    if d.kv_heads % tp and tp % d.kv_heads:
        raise InvalidInputError(
            f"tp={tp} and num_key_value_heads={d.kv_heads}: one must divide the other"
        )
    if cfg.get("model_type") == "gpt2":
        # Built with the global n_head (GPT-2 derives head_dim from it); tp_model then swaps
        # the attention projections for local ones and sets num_heads / split_size.
        local["n_inner"] = _div("n_inner", d.intermediate, tp)
        _div("n_head", d.heads, tp)
        local["n_layer"] = num_layers
    else:
        local["num_attention_heads"] = _div("num_attention_heads", d.heads, tp)
        local["num_key_value_heads"] = max(1, d.kv_heads // tp)
        local["head_dim"] = d.head_dim
        local["intermediate_size"] = _div("intermediate_size", d.intermediate, tp)
        local["num_hidden_layers"] = num_layers
        if d.experts:
            _div("num_local_experts", d.experts, ep)
        types = cfg.get("layer_types")
        if isinstance(types, list) and len(types) == d.layers:
            local["layer_types"] = types[first_layer : first_layer + num_layers]
        if "max_window_layers" in cfg:
            local["max_window_layers"] = max(0, int(cfg["max_window_layers"]) - first_layer)
    local["vocab_size"] = vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(local.get(key), int) and local[key] >= vocab:
            local[key] = None
    return local
