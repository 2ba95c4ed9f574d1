"""config.json -> the exact tensors ``save_pretrained`` writes, per architecture; no torch.

Supported ``model_type`` values: llama, mistral, qwen2, qwen3, mixtral, gpt2, phi3, gemma,
gemma2 (:data:`SUPPORTED`). Each family is one small function listing ``(fqn, shape)`` pairs;
shapes follow PyTorch storage:

- ``nn.Linear`` weights are ``[out, in]`` (q_proj ``[heads·head_dim, hidden]``);
- GPT-2's ``Conv1D`` weights are ``[in, out]`` (c_attn ``[H, 3H]``, c_fc ``[H, n_inner]``,
  attn.c_proj ``[H, H]``, mlp.c_proj ``[n_inner, H]``);
- tied embeddings (``tie_word_embeddings``) mean no ``lm_head.weight`` on disk;
- Mixtral experts as the hub files store them (``block_sparse_moe.experts.{e}.w1/w2/w3``),
  not transformers 5's packed in-memory form.

Checked against transformers 5.23 ``save_pretrained`` (tests/test_inventory_real.py): GPT-2's
``attn.bias`` / ``attn.masked_bias`` buffers are *not* written, so they are not listed.

Order: sorted by fqn, which is the order ``save_pretrained`` writes a single-dtype model into one
file (safetensors orders tensors by dtype alignment, then name).

Missing fields: the shape-defining ones (hidden, layers, heads, intermediate, vocab; GPT-2's
``n_embd``, ``n_layer``, ``n_head``, ``n_positions``, ``vocab_size``) are required; the rest get
transformers' defaults (``num_key_value_heads`` = heads, ``head_dim`` = hidden / heads,
``tie_word_embeddings`` per family, biases off).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.model.types import ModelDims, TensorInfo

Shapes = list[tuple[str, tuple[int, ...]]]

# transformers' default for a missing tie_word_embeddings, per family.
_TIED_DEFAULT: dict[str, bool] = {
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "qwen3": False,
    "mixtral": False,
    "phi3": False,
    "gpt2": True,
    "gemma": True,
    "gemma2": True,
}

SUPPORTED: tuple[str, ...] = tuple(sorted(_TIED_DEFAULT))


def model_type_of(config: Mapping[str, Any], *, where: str = "config") -> str:
    """The config's ``model_type``, checked to be a supported family."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidInputError(
            f"missing 'model_type' (got {model_type!r})",
            where=where,
            hint=f"set model_type to one of: {', '.join(SUPPORTED)}",
        )
    if model_type not in _TIED_DEFAULT:
        raise InvalidInputError(
            f"unsupported model_type {model_type!r}",
            where=where,
            hint=f"supported: {', '.join(SUPPORTED)}; for another architecture inventory a "
            "checkpoint directory and give its rules in the manifest",
        )
    return model_type


def _int(config: Mapping[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    """A positive integer field; ``default`` (if given) when the key is absent or null."""
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise InvalidInputError(
            f"missing {key!r} (needed to derive tensor shapes)",
            where=where,
            hint=f'add "{key}": <positive integer> to the config',
        )
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{key!r}: expected a positive integer, got {value!r}", where=where)
    return value


def _bool(config: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInputError(f"{key!r}: expected true or false, got {value!r}", where=where)
    return value


def _divide(a: int, b: int, what: str, where: str) -> int:
    if a % b:
        raise InvalidInputError(
            f"{what}: {a} is not divisible by {b}", where=where, hint="set 'head_dim' explicitly"
        )
    return a // b


def dims_from_config(config: Mapping[str, Any], *, where: str = "config") -> ModelDims:
    """The numbers layout rules need; Llama-3-8B -> ``ModelDims(4096, 32, 32, 8, 128, ...)``."""
    model_type = model_type_of(config, where=where)
    tied = _bool(config, "tie_word_embeddings", where, _TIED_DEFAULT[model_type])
    if model_type == "gpt2":
        hidden = _int(config, "n_embd", where)
        heads = _int(config, "n_head", where)
        return ModelDims(
            hidden_size=hidden,
            num_layers=_int(config, "n_layer", where),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=_divide(hidden, heads, "n_embd / n_head", where),
            intermediate_size=_int(config, "n_inner", where, default=4 * hidden),
            vocab_size=_int(config, "vocab_size", where),
            tie_word_embeddings=tied,
            max_position_embeddings=_int(config, "n_positions", where),
            gated_mlp=False,
        )
    hidden = _int(config, "hidden_size", where)
    heads = _int(config, "num_attention_heads", where)
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = _divide(hidden, heads, "hidden_size / num_attention_heads", where)
    else:
        head_dim = _int(config, "head_dim", where)
    kv_heads = _int(config, "num_key_value_heads", where, default=heads)
    moe = model_type == "mixtral"
    return ModelDims(
        hidden_size=hidden,
        num_layers=_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(config, "intermediate_size", where),
        vocab_size=_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        num_experts=_int(config, "num_local_experts", where) if moe else 0,
        experts_per_token=_int(config, "num_experts_per_tok", where) if moe else 0,
        max_position_embeddings=_int(config, "max_position_embeddings", where, default=0),
        gated_mlp=True,
    )


# ---- per-family tensor lists: (fqn, shape), any order; the caller sorts -------------------


def _attention(p: str, d: ModelDims, *, qkv_bias: bool, o_bias: bool) -> Shapes:
    """Separate q/k/v/o projections, ``nn.Linear`` ``[out, in]``."""
    q, kv, h = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    out: Shapes = [
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
    ]
    if qkv_bias:
        out += [
            (f"{p}.self_attn.q_proj.bias", (q,)),
            (f"{p}.self_attn.k_proj.bias", (kv,)),
            (f"{p}.self_attn.v_proj.bias", (kv,)),
        ]
    if o_bias:
        out.append((f"{p}.self_attn.o_proj.bias", (h,)))
    return out


def _gated_mlp(p: str, d: ModelDims, *, bias: bool) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    out: Shapes = [
        (f"{p}.mlp.gate_proj.weight", (i, h)),
        (f"{p}.mlp.up_proj.weight", (i, h)),
        (f"{p}.mlp.down_proj.weight", (h, i)),
    ]
    if bias:
        out += [
            (f"{p}.mlp.gate_proj.bias", (i,)),
            (f"{p}.mlp.up_proj.bias", (i,)),
            (f"{p}.mlp.down_proj.bias", (h,)),
        ]
    return out


def _norms(p: str, d: ModelDims, names: tuple[str, ...]) -> Shapes:
    return [(f"{p}.{n}.weight", (d.hidden_size,)) for n in names]


def _decoder(config: Mapping[str, Any], d: ModelDims, layer: Callable[[str], Shapes]) -> Shapes:
    """The ``model.*`` skeleton shared by the Llama-like families."""
    out: Shapes = [
        ("model.embed_tokens.weight", (d.vocab_size, d.hidden_size)),
        ("model.norm.weight", (d.hidden_size,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (d.vocab_size, d.hidden_size)))
    for i in range(d.num_layers):
        out += layer(f"model.layers.{i}")
    return out


def _llama_like(config: Mapping[str, Any], d: ModelDims, where: str) -> Shapes:
    """llama, mistral, qwen2, qwen3, gemma, gemma2."""
    model_type = config["model_type"]
    attention_bias = _bool(config, "attention_bias", where, False)
    # qwen2 always has q/k/v biases and never an o_proj bias; the others follow attention_bias.
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias
    mlp_bias = _bool(config, "mlp_bias", where, False) if model_type == "llama" else False
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    if model_type == "gemma2":
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")

    def layer(p: str) -> Shapes:
        out = _attention(p, d, qkv_bias=qkv_bias, o_bias=o_bias)
        if model_type == "qwen3":  # per-head RMSNorm on q and k
            out += [
                (f"{p}.self_attn.q_norm.weight", (d.head_dim,)),
                (f"{p}.self_attn.k_norm.weight", (d.head_dim,)),
            ]
        return out + _gated_mlp(p, d, bias=mlp_bias) + _norms(p, d, norms)

    return _decoder(config, d, layer)


def _mixtral(config: Mapping[str, Any], d: ModelDims, where: str) -> Shapes:
    """Experts as on the hub: w1 = gate ``[I, H]``, w2 = down ``[H, I]``, w3 = up ``[I, H]``."""
    h, i = d.hidden_size, d.intermediate_size

    def layer(p: str) -> Shapes:
        moe = f"{p}.block_sparse_moe"
        out = _attention(p, d, qkv_bias=False, o_bias=False)
        out.append((f"{moe}.gate.weight", (d.num_experts, h)))  # the router
        for e in range(d.num_experts):
            out += [
                (f"{moe}.experts.{e}.w1.weight", (i, h)),
                (f"{moe}.experts.{e}.w2.weight", (h, i)),
                (f"{moe}.experts.{e}.w3.weight", (i, h)),
            ]
        return out + _norms(p, d, ("input_layernorm", "post_attention_layernorm"))

    return _decoder(config, d, layer)


def _phi3(config: Mapping[str, Any], d: ModelDims, where: str) -> Shapes:
    """Fused ``qkv_proj`` ``[(heads + 2·kv)·head_dim, H]`` and ``gate_up_proj`` ``[2I, H]``."""
    h, i = d.hidden_size, d.intermediate_size
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim

    def layer(p: str) -> Shapes:
        return [
            (f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.mlp.gate_up_proj.weight", (2 * i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
            *_norms(p, d, ("input_layernorm", "post_attention_layernorm")),
        ]

    return _decoder(config, d, layer)


def _gpt2(config: Mapping[str, Any], d: ModelDims, where: str) -> Shapes:
    """``Conv1D`` weights are ``[in, out]``; every linear and LayerNorm has a bias."""
    h, i = d.hidden_size, d.intermediate_size
    out: Shapes = [
        ("transformer.wte.weight", (d.vocab_size, h)),
        ("transformer.wpe.weight", (d.max_position_embeddings, h)),
        ("transformer.ln_f.weight", (h,)),
        ("transformer.ln_f.bias", (h,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (d.vocab_size, h)))
    for n in range(d.num_layers):
        p = f"transformer.h.{n}"
        out += [
            (f"{p}.ln_1.weight", (h,)),
            (f"{p}.ln_1.bias", (h,)),
            (f"{p}.attn.c_attn.weight", (h, 3 * h)),
            (f"{p}.attn.c_attn.bias", (3 * h,)),
            (f"{p}.attn.c_proj.weight", (h, h)),
            (f"{p}.attn.c_proj.bias", (h,)),
            (f"{p}.ln_2.weight", (h,)),
            (f"{p}.ln_2.bias", (h,)),
            (f"{p}.mlp.c_fc.weight", (h, i)),
            (f"{p}.mlp.c_fc.bias", (i,)),
            (f"{p}.mlp.c_proj.weight", (i, h)),
            (f"{p}.mlp.c_proj.bias", (h,)),
        ]
    return out


_FAMILIES: dict[str, Callable[[Mapping[str, Any], ModelDims, str], Shapes]] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "gemma": _llama_like,
    "gemma2": _llama_like,
    "mixtral": _mixtral,
    "phi3": _phi3,
    "gpt2": _gpt2,
}
assert set(_FAMILIES) == set(SUPPORTED)


def tensors_from_config(
    config: Mapping[str, Any], dtype: str, *, where: str = "config"
) -> tuple[TensorInfo, ...]:
    """Every tensor ``save_pretrained`` writes for ``config``, sorted by fqn, all in ``dtype``.

    ``dtype`` is a safetensors code (``"BF16"``); see :func:`shardctl.dtypes.normalize_dtype`.
    """
    dims = dims_from_config(config, where=where)
    shapes = _FAMILIES[config["model_type"]](config, dims, where)
    return tuple(TensorInfo(fqn, shape, dtype) for fqn, shape in sorted(shapes))
