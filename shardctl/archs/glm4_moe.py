"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``, ``Glm4MoeForCausalLM``: GLM-4.5-Air, GLM-4.5, GLM-4.6):
grouped-query attention (q/k/v biases with ``attention_bias``, per-head ``q_norm`` / ``k_norm``
with ``use_qk_norm``, rotary on ``partial_rotary_factor`` of each head) and DeepSeek-V3's MoE:
``first_k_dense_replace`` dense layers, then layers of ``n_routed_experts`` routed experts of
``moe_intermediate_size`` beside ``n_shared_experts`` shared ones, routed by a sigmoid router with
a per-expert ``e_score_correction_bias``. On disk (transformers 5.24 ``save_pretrained`` and the
published files alike)::

    model.layers.{i}.self_attn.{q,k,v}_proj.weight / .bias    colwise (kv heads replicated
                                                              when tp exceeds them)
    model.layers.{i}.self_attn.o_proj.weight                  rowwise
    model.layers.{i}.self_attn.{q,k}_norm.weight [head_dim]   replicated
    model.layers.{i}.mlp.{gate,up,down}_proj.weight           dense layers: col / col / row
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   experts over ep, then tp
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight    col / col / row
    model.layers.{i}.mlp.gate.weight [E, H], .e_score_correction_bias [E]    replicated, F32

Placement follows vLLM ``glm4_moe.py`` (``Glm4MoeAttention``: ``QKVParallelLinear`` /
``RowParallelLinear``; ``Glm4MoE``: ``FusedMoE`` experts, a ``ReplicatedLinear`` router kept in
float32 with its correction bias, the shared experts a ``Glm4MoeMLP``) and ``glm4_moe_mtp.py``:
the published checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction layers after
the stack (``model.layers.{L}.*``: a full MoE layer plus ``enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head``, DeepSeek-V3's), placed on the last pipeline stage and counted from a config
only with ``include_mtp_layers: true``, as for DeepSeek-V3 (transformers does not build or save
them). transformers 5.24 keeps the router and its bias in F32
(``_keep_in_fp32_modules_strict``), and so does ``save_pretrained``.

The forward level of ``verify`` runs transformers' ``Glm4MoeForCausalLM`` on each rank's local
sizes: heads, kv heads, dense, shared and expert widths over tp, its ep rank's experts, the
stage's layers (``first_k_dense_replace`` shifted with it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    LAYER_NORMS,
    MLP_RULES,
    NORM_RULES,
    attention,
    decoder_dims,
    decoder_local_config,
    norms,
)
from shardctl.archs._family import (
    Config,
    Family,
    ForwardSpec,
    MemoryFlags,
    Shapes,
    get_bool,
    get_int,
    local_div,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.archs.deepseek_v2 import (
    EXPERTS,
    MOE_RULES,
    MTP_KEY,
    MTP_RULES,
    first_dense,
    localize_experts,
    mlp_shapes,
    moe_shapes,
    mtp_layer_count,
    stack_with_mtp,
)
from shardctl.archs.deepseek_v3 import sigmoid_weights
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

# First match wins: MTP-only names, attention, experts, shared experts, router, MLP, norms.
RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *MTP_RULES,
    *ATTENTION_RULES,
    *MOE_RULES,
    *MLP_RULES,
    *NORM_RULES,  # input / post_attention layernorms, q_norm / k_norm
)

# transformers 5.24 Glm4MoeConfig defaults for the keys a config may leave out
DEFAULTS: Config = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
}

SHAPE_KEYS = (
    *DECODER_SHAPES,
    "attention_bias",
    "use_qk_norm",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    MTP_KEY,
)
CONFIG_KEYS = (
    *DECODER_OTHER,
    "partial_rotary_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "output_router_logits",
    "num_mtp_layers",
)


def _config(config: Config) -> Config:
    return {**DEFAULTS, **config}


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    """GLM-4.5-Air → ``ModelDims(4096, 46, 96, 8, 128, 10944, 151552, ...)``: the decoder's
    (``head_dim`` the config's, 128 for GLM-4.5, not hidden / heads; ``intermediate_size`` the
    dense layers') with the routed experts and the MTP layers."""
    c = _config(config)
    d = decoder_dims(c, tied, where, experts_key="n_routed_experts")
    return dataclasses.replace(d, mtp_layers=mtp_layer_count(c, where))


def _layer(i: int, d: ModelDims, config: Config, where: str) -> Shapes:
    p = f"model.layers.{i}"
    bias = get_bool(config, "attention_bias", where, False)
    out = attention(p, d, qkv_bias=bias, o_bias=False)
    if get_bool(config, "use_qk_norm", where, False):
        out += [
            (f"{p}.self_attn.q_norm.weight", (d.head_dim,)),
            (f"{p}.self_attn.k_norm.weight", (d.head_dim,)),
        ]
    if i < first_dense(config, where):
        out += mlp_shapes(f"{p}.mlp", d.hidden_size, d.intermediate_size, False)
    else:  # DeepSeek-V3's MoE block: router + correction bias, experts, shared experts
        out += moe_shapes(p, d, config, where, router_bias=True, mlp_bias=False)
    return out + norms(p, d, LAYER_NORMS)


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    c = _config(config)
    return stack_with_mtp(d, c, where, lambda i: _layer(i, d, c, where))


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """One rank: the decoder's local heads / kv heads, dense, expert and shared widths over tp,
    the stage's layers with ``first_k_dense_replace`` shifted to them."""
    c = _config(cfg)
    local = decoder_local_config(c, d, tp, ep, first_layer, num_layers)
    moe_i = get_int(c, "moe_intermediate_size", "config")
    local["moe_intermediate_size"] = local_div("moe_intermediate_size", moe_i, tp)
    local["first_k_dense_replace"] = max(0, first_dense(c, "config") - first_layer)
    local_div("n_routed_experts", d.num_experts, ep)
    local["num_nextn_predict_layers"] = 0  # transformers builds no MTP layer
    return local


def _memory(config: Config) -> MemoryFlags:
    return MemoryFlags(qkv_bias=get_bool(config, "attention_bias", "config", False))


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    tied_default=False,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=_memory,
    forward=ForwardSpec(
        layer_prefix="model.layers",
        embeddings=("model.embed_tokens",),
        final_norm="model.norm",
        lm_head="lm_head",
        # dense layers: mlp.down_proj; MoE layers: mlp.shared_experts.down_proj (the routed
        # experts' sum over tp and ep is LocalExperts')
        row_parallel=("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"),
        local_config=_local_config,
        experts=EXPERTS,
        localize=localize_experts,  # DeepSeek's: the packed experts per ep rank
        route_weights=sigmoid_weights,
    ),
    follows="vLLM glm4_moe.py (Glm4MoeForCausalLM, FusedMoE) and glm4_moe_mtp.py",
    shape_keys=SHAPE_KEYS,
    config_keys=CONFIG_KEYS,
    # the published FP8 releases quantize every projection but the router
    quantizable=(
        "model.layers.*.self_attn.*_proj.weight",
        "model.layers.*.mlp.*_proj.weight",  # dense, shared_experts.* and experts.{e}.*
    ),
    closed_form=False,
    # transformers 5.24 keeps the router and its bias in F32 (_keep_in_fp32_modules_strict)
    fp32_kept=(
        ("5.24", "model.layers.*.mlp.gate.weight"),
        ("5.24", "model.layers.*.mlp.gate.e_score_correction_bias"),
    ),
)
