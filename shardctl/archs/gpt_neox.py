"""GPT-NeoX / Pythia: fused ``query_key_value`` interleaved per head, LayerNorms with bias.

On disk (transformers 5.23 ``save_pretrained``, ``nn.Linear`` ``[out, in]``)::

    gpt_neox.embed_in.weight                               [V, H]
    gpt_neox.layers.{i}.attention.query_key_value.weight   [3H, H]  per head h: rows
        [h·3d, h·3d + d) = q_h, then k_h, then v_h   (d = head_dim; bias [3H] the same)
    gpt_neox.layers.{i}.attention.dense.weight             [H, H]   (+ bias)
    gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight [I, H];  mlp.dense_4h_to_h.weight [H, I] (+ bias)
    gpt_neox.layers.{i}.input_layernorm / post_attention_layernorm: weight, bias [H]
    gpt_neox.final_layer_norm: weight, bias [H]
    embed_out.weight [V, H]   (the head; transformers 5 renames it ``lm_head`` in memory)

``query_key_value`` is NOT ``[Q; K; V]``: each head's q, k, v rows sit together, so TP splits it
by whole heads (``groups="kv"``: one group per head, as GPT-NeoX has kv heads = heads), and a
rank holding heads ``[a, b)`` holds rows ``[a·3d, b·3d)`` — the local model reads them as its
own per-head ``[q; k; v]``. Older Pythia files also carry ``attention.bias`` /
``attention.masked_bias`` / ``attention.rotary_emb.inv_freq`` buffers: replicated.
``use_parallel_residual`` and partial rotary change no tensor.

Placement follows vLLM ``gpt_neox.py`` (``query_key_value`` a ``QKVParallelLinear`` whose
weight loader regroups the per-head rows, ``dense`` / ``dense_4h_to_h`` row-parallel,
``dense_h_to_4h`` column-parallel, ``embed_in`` / ``embed_out`` vocab-parallel).
"""

from __future__ import annotations

from typing import Any

from shardctl.archs._decoder import R
from shardctl.archs._family import (
    Config,
    Family,
    ForwardSpec,
    MemoryFlags,
    Shapes,
    divide,
    get_bool,
    get_int,
    local_div,
)
from shardctl.archs._keys import COMMON, ROPE
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_L = "gpt_neox.layers.*"
RULES: tuple[RuleSpec, ...] = (
    RuleSpec("gpt_neox.embed_in.weight", tp="vocab", stage="embedding"),
    RuleSpec("gpt_neox.final_layer_norm.*", tp=R, stage="last"),
    RuleSpec("embed_out.weight", tp="vocab", stage="last"),
    RuleSpec(
        f"{_L}.attention.query_key_value.*", tp="colwise", parts=("q", "kv", "kv"), groups="kv"
    ),
    RuleSpec(f"{_L}.attention.dense.*", tp="rowwise", heads="q"),
    RuleSpec(f"{_L}.mlp.dense_h_to_4h.*", tp="colwise"),
    RuleSpec(f"{_L}.mlp.dense_4h_to_h.*", tp="rowwise"),
    RuleSpec(f"{_L}.*layernorm.*", tp=R),
    RuleSpec(f"{_L}.attention.bias", tp=R),  # causal-mask buffers of older hub files
    RuleSpec(f"{_L}.attention.masked_bias", tp=R),
    RuleSpec(f"{_L}.attention.rotary_emb.inv_freq", tp=R),
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    hidden = get_int(config, "hidden_size", where)
    heads = get_int(config, "num_attention_heads", where)
    return ModelDims(
        hidden_size=hidden,
        num_layers=get_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=divide(hidden, heads, "hidden_size / num_attention_heads", where),
        intermediate_size=get_int(config, "intermediate_size", where),
        vocab_size=get_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        max_position_embeddings=get_int(config, "max_position_embeddings", where, default=0),
        gated_mlp=False,
    )


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    h, i, v = d.hidden_size, d.intermediate_size, d.vocab_size
    attn_bias = get_bool(config, "attention_bias", where, True)
    out: Shapes = [
        ("gpt_neox.embed_in.weight", (v, h)),
        ("gpt_neox.final_layer_norm.weight", (h,)),
        ("gpt_neox.final_layer_norm.bias", (h,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("embed_out.weight", (v, h)))
    for n in range(d.num_layers):
        p = f"gpt_neox.layers.{n}"
        out += [
            (f"{p}.attention.query_key_value.weight", (3 * h, h)),
            (f"{p}.attention.dense.weight", (h, h)),
            (f"{p}.mlp.dense_h_to_4h.weight", (i, h)),
            (f"{p}.mlp.dense_h_to_4h.bias", (i,)),
            (f"{p}.mlp.dense_4h_to_h.weight", (h, i)),
            (f"{p}.mlp.dense_4h_to_h.bias", (h,)),
        ]
        if attn_bias:
            out += [
                (f"{p}.attention.query_key_value.bias", (3 * h,)),
                (f"{p}.attention.dense.bias", (h,)),
            ]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out += [(f"{p}.{norm}.weight", (h,)), (f"{p}.{norm}.bias", (h,))]
    return out


def _memory(config: Config) -> MemoryFlags:
    bias = get_bool(config, "attention_bias", "config", True)
    return MemoryFlags(qkv_bias=bias, o_bias=bias, mlp_bias=True, norm_bias=True)


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    # Global heads stay (head_size = hidden / heads and the rotary dims derive from them);
    # _localize swaps the attention projections for local ones. The attention reshapes its
    # qkv as (-1 heads, 3·head_size), so local heads follow from the local projection.
    local_div("num_attention_heads", d.num_heads, tp)
    return {
        "intermediate_size": local_div("intermediate_size", d.intermediate_size, tp),
        "num_hidden_layers": num_layers,
    }


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    from torch import nn

    h = d.hidden_size
    bias = bool(getattr(config, "attention_bias", True))
    for layer in model.gpt_neox.layers:
        attn = layer.attention
        attn.query_key_value = nn.Linear(h, 3 * h // tp, bias=bias).to(dtype)
        attn.dense = nn.Linear(h // tp, h, bias=bias).to(dtype)


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    tied_default=False,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=_memory,
    forward=ForwardSpec(
        layer_prefix="gpt_neox.layers",
        embeddings=("gpt_neox.embed_in",),
        final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head",
        row_parallel=("attention.dense", "mlp.dense_4h_to_h"),
        local_config=_local_config,
        localize=_localize,
        renames=(("embed_out.", "lm_head."),),
        recomputed=(
            f"{_L}.attention.bias",
            f"{_L}.attention.masked_bias",
            f"{_L}.attention.rotary_emb.inv_freq",
        ),
    ),
    follows="vLLM gpt_neox.py (GPTNeoXForCausalLM)",
    shape_keys=(
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
        "attention_bias",
    ),
    config_keys=(
        *COMMON,
        *ROPE,
        "rotary_pct",
        "rotary_emb_base",
        "use_parallel_residual",
        "hidden_act",
        "layer_norm_eps",
        "attention_dropout",
        "hidden_dropout",
        "classifier_dropout",
        "is_decoder",
        "use_cache",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import TRANSFORMERS_BACKEND, declare  # noqa: E402

FAMILY = declare(FAMILY, TRANSFORMERS_BACKEND)
