"""The generic Llama-style decoder: each Llama-like family file declares only its differences.

On disk (transformers ``save_pretrained``, ``nn.Linear`` weights ``[out, in]``)::

    model.embed_tokens.weight        [V, H]
    model.layers.{i}.self_attn.q_proj.weight   [heads·head_dim, H]   (k/v: kv_heads·head_dim)
    model.layers.{i}.self_attn.o_proj.weight   [H, heads·head_dim]
    model.layers.{i}.mlp.gate_proj/up_proj.weight  [I, H];  down_proj [H, I]
    model.layers.{i}.input_layernorm/post_attention_layernorm.weight  [H]
    model.norm.weight [H];  lm_head.weight [V, H] (absent when tied)

Placement (vLLM ``LlamaForCausalLM`` / Megatron-Core GPT): embedding and head vocab-parallel
``S(0)``; q/k/v and gate/up column-parallel by whole heads; o and down row-parallel; norms
replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardctl.archs._family import (
    LINEAR_PROJECTIONS,
    Config,
    ExpertSpec,
    Family,
    ForwardSpec,
    Localize,
    MegatronDecl,  # megatron-moe
    MemoryFlags,
    Shapes,
    divide,
    get_bool,
    get_int,
    local_div,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

R = "R"
LLAMA_FOLLOWS = "vLLM llama.py (LlamaForCausalLM) / Megatron-Core GPTModel"

# ---- rules (first match wins) ------------------------------------------------------------

# Attention of every Llama-like model: q/k/v split by whole heads, o by q heads along its input.
ATTENTION_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.self_attn.q_proj.*", tp="colwise", heads="q"),
    RuleSpec("model.layers.*.self_attn.k_proj.*", tp="colwise", heads="kv"),
    RuleSpec("model.layers.*.self_attn.v_proj.*", tp="colwise", heads="kv"),
    RuleSpec("model.layers.*.self_attn.o_proj.*", tp="rowwise", heads="q"),
)
MLP_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.mlp.gate_proj.*", tp="colwise"),
    RuleSpec("model.layers.*.mlp.up_proj.*", tp="colwise"),
    RuleSpec("model.layers.*.mlp.down_proj.*", tp="rowwise"),
)
# input_layernorm, post_attention_layernorm, Gemma-2's pre/post_feedforward_layernorm, q/k norms.
NORM_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*layernorm.*", tp=R),
    RuleSpec("model.layers.*.self_attn.[qk]_norm.*", tp=R),
)
# ``embedding`` stage: first, and also last when the head is tied and pp > 1.
END_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.embed_tokens.weight", tp="vocab", stage="embedding"),
    RuleSpec("model.norm.*", tp=R, stage="last"),
    RuleSpec("lm_head.weight", tp="vocab", stage="last"),
)
RULES: tuple[RuleSpec, ...] = END_RULES + ATTENTION_RULES + MLP_RULES + NORM_RULES

# ---- config -> dims -> tensors -------------------------------------------------------------


def decoder_dims(config: Config, tied: bool, where: str, *, experts_key: str = "") -> ModelDims:
    """Llama-3-8B -> ``ModelDims(4096, 32, 32, 8, 128, ...)``; ``experts_key`` for MoE."""
    hidden = get_int(config, "hidden_size", where)
    heads = get_int(config, "num_attention_heads", where)
    if config.get("head_dim") is None:
        head_dim = divide(hidden, heads, "hidden_size / num_attention_heads", where)
    else:
        head_dim = get_int(config, "head_dim", where)
    return ModelDims(
        hidden_size=hidden,
        num_layers=get_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=get_int(config, "num_key_value_heads", where, default=heads),
        head_dim=head_dim,
        intermediate_size=get_int(config, "intermediate_size", where),
        vocab_size=get_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        num_experts=get_int(config, experts_key, where) if experts_key else 0,
        experts_per_token=get_int(config, "num_experts_per_tok", where) if experts_key else 0,
        max_position_embeddings=get_int(config, "max_position_embeddings", where, default=0),
        gated_mlp=True,
    )


def attention(p: str, d: ModelDims, *, qkv_bias: bool, o_bias: bool) -> Shapes:
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


def gated_mlp(p: str, d: ModelDims, *, bias: bool) -> Shapes:
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


def norms(p: str, d: ModelDims, names: tuple[str, ...]) -> Shapes:
    return [(f"{p}.{n}.weight", (d.hidden_size,)) for n in names]


LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def skeleton(d: ModelDims, layer: Callable[[str], Shapes]) -> Shapes:
    """The ``model.*`` skeleton: embeddings, final norm, head (unless tied), the layers."""
    out: Shapes = [
        ("model.embed_tokens.weight", (d.vocab_size, d.hidden_size)),
        ("model.norm.weight", (d.hidden_size,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (d.vocab_size, d.hidden_size)))
    for i in range(d.num_layers):
        out += layer(f"model.layers.{i}")
    return out


def _bias(config: Config, fixed: bool | None, key: str, where: str) -> bool:
    """A family's fixed bias (qwen2: always q/k/v, never o), else the config's ``key``."""
    return fixed if fixed is not None else get_bool(config, key, where, False)


# ---- forward -------------------------------------------------------------------------------


def decoder_local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """One rank's config: local heads / kv heads / intermediate, its stage's layers."""
    local: dict[str, Any] = {
        "num_attention_heads": local_div("num_attention_heads", d.num_heads, tp),
        "num_key_value_heads": max(1, d.num_kv_heads // tp),
        "head_dim": d.head_dim,
        "intermediate_size": local_div("intermediate_size", d.intermediate_size, tp),
        "num_hidden_layers": num_layers,
    }
    if d.num_experts:
        local_div("num_local_experts", d.num_experts, ep)
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)) and len(types) == d.num_layers:
        local["layer_types"] = types[first_layer : first_layer + num_layers]
    if "max_window_layers" in cfg:
        local["max_window_layers"] = max(0, int(cfg["max_window_layers"]) - first_layer)
    return local


def decoder_forward(
    *,
    row_parallel: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj"),
    experts: ExpertSpec | None = None,
    localize: Localize | None = None,
) -> ForwardSpec:
    return ForwardSpec(
        layer_prefix="model.layers",
        embeddings=("model.embed_tokens",),
        final_norm="model.norm",
        lm_head="lm_head",
        row_parallel=row_parallel,
        local_config=decoder_local_config,
        experts=experts,
        localize=localize,
    )


# ---- the family builder ----------------------------------------------------------------------


def decoder_family(
    name: str,
    *,
    model_types: tuple[str, ...] | None = None,
    tied_default: bool = False,
    qkv_bias: bool | None = None,
    o_bias: bool | None = None,
    mlp_bias: bool | None = False,
    extra_norms: tuple[str, ...] = (),
    qk_norm: bool = False,
    experts_key: str = "",
    layer: Callable[[str, ModelDims, Config, str], Shapes] | None = None,
    rules: tuple[RuleSpec, ...] = RULES,
    forward: ForwardSpec | None = None,
    follows: str = LLAMA_FOLLOWS,
    shape_keys: tuple[str, ...] = DECODER_SHAPES,
    config_keys: tuple[str, ...] = DECODER_OTHER,
    sliding_layers: str = "none",
    quantizable: tuple[str, ...] = LINEAR_PROJECTIONS,
    megatron: MegatronDecl | None = None,  # megatron-moe: how Megatron-Core holds it
) -> Family:
    """A Llama-like family. ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: ``None`` follows the
    config's ``attention_bias`` / ``mlp_bias``; a bool fixes it. ``layer`` replaces the whole
    per-layer tensor list (Mixtral's experts, Phi-3's fused projections). ``shape_keys`` /
    ``config_keys``: the manifest's inline ``model:`` keys (see :mod:`shardctl.archs._keys`)."""

    def dims(config: Config, tied: bool, where: str) -> ModelDims:
        return decoder_dims(config, tied, where, experts_key=experts_key)

    def default_layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
        out = attention(
            p,
            d,
            qkv_bias=_bias(config, qkv_bias, "attention_bias", where),
            o_bias=_bias(config, o_bias, "attention_bias", where),
        )
        if qk_norm:  # per-head RMSNorm on q and k
            out += [
                (f"{p}.self_attn.q_norm.weight", (d.head_dim,)),
                (f"{p}.self_attn.k_norm.weight", (d.head_dim,)),
            ]
        out += gated_mlp(p, d, bias=_bias(config, mlp_bias, "mlp_bias", where))
        return out + norms(p, d, LAYER_NORMS + extra_norms)

    make_layer = layer or default_layer

    def tensors(config: Config, d: ModelDims, where: str) -> Shapes:
        return skeleton(d, lambda p: make_layer(p, d, config, where))

    def memory(config: Config) -> MemoryFlags:
        return MemoryFlags(
            qkv_bias=_bias(config, qkv_bias, "attention_bias", "config"),
            o_bias=_bias(config, o_bias, "attention_bias", "config"),
            mlp_bias=_bias(config, mlp_bias, "mlp_bias", "config"),
        )

    return Family(
        name=name,
        model_types=model_types or (name,),
        tied_default=tied_default,
        dims=dims,
        tensors=tensors,
        rules=rules,
        memory=memory,
        forward=forward or decoder_forward(),
        follows=follows,
        shape_keys=shape_keys,
        config_keys=config_keys,
        sliding_layers=sliding_layers,
        quantizable=quantizable,
        megatron=megatron,
    )
