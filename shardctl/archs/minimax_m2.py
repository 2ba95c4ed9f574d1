"""MiniMax-M2 / M2.1 / M2.5 (``minimax_m2``, ``MiniMaxM2ForCausalLM``): grouped-query attention
with an RMSNorm over the *whole* q and k projections (OLMo-2's, not Qwen-3's per-head one) and
rotary on ``rotary_dim`` of each head, then in every layer a Mixtral-named MoE block of
``num_local_experts`` experts routed by a sigmoid router with a per-expert correction bias
(DeepSeek-V3's rule without groups: the bias picks the experts, the sigmoid scores at them,
renormalized, weigh them). On disk (transformers 5.24 ``save_pretrained`` and the published
files alike)::

    model.layers.{i}.self_attn.{q,k,v}_proj.weight           colwise by heads (kv heads
                                                              replicated when tp exceeds them)
    model.layers.{i}.self_attn.o_proj.weight                  rowwise
    model.layers.{i}.self_attn.q_norm.weight [heads·head_dim]     colwise with q's heads
    model.layers.{i}.self_attn.k_norm.weight [kv_heads·head_dim]  colwise with k's heads
    model.layers.{i}.block_sparse_moe.gate.weight [E, H]          router, replicated
    model.layers.{i}.block_sparse_moe.e_score_correction_bias [E] replicated
    model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3.weight [I, H]  experts over ep, colwise
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight [H, I]     rowwise

Placement follows vLLM ``minimax_m2.py``: ``QKVParallelLinear`` / ``RowParallelLinear``;
``MiniMaxText01RMSNormTP`` q/k norms whose weights load *split* over tp (each rank its heads'
slice; the mean square is all-reduced); ``FusedMoE`` experts; a float32 ``ReplicatedLinear``
router beside the replicated correction bias. The published checkpoints are FP8 with 128 × 128
block scales (``quant_method: fp8``, ``modules_to_not_convert: [gate, e_score_correction_bias,
lm_head]``): a config carrying that ``quantization_config`` is priced as stored. Their config
names ``num_mtp_modules``, whose weights were not published (MiniMax-AI/MiniMax-M2 issue #47)
and which vLLM skips (``get_spec_layer_idx_from_weight_name``): the inventory has none.

The forward level runs transformers' ``MiniMaxM2ForCausalLM`` on each rank's local sizes: its
heads, kv heads and expert widths over tp, its ep rank's experts, and the q/k norms as
:class:`~shardctl.archs._tp_norm.TPRMSNorm` over the rank's own slice of the weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    LAYER_NORMS,
    NORM_RULES,
    R,
    attention,
    decoder_dims,
    decoder_family,
    decoder_forward,
    norms,
)
from shardctl.archs._family import Config, Family, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.archs.deepseek_v3 import sigmoid_weights
from shardctl.archs.mixtral import EXPERTS as MIXTRAL_EXPERTS
from shardctl.archs.mixtral import expert_shapes, localize_experts
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_MOE = "model.layers.*.block_sparse_moe"
RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *ATTENTION_RULES,
    # vLLM MiniMaxText01RMSNormTP: each rank loads its heads' slice of the whole-projection norm
    RuleSpec("model.layers.*.self_attn.q_norm.*", tp="colwise", heads="q"),
    RuleSpec("model.layers.*.self_attn.k_norm.*", tp="colwise", heads="kv"),
    RuleSpec(f"{_MOE}.experts.*.w1.*", tp="colwise", expert=True),
    RuleSpec(f"{_MOE}.experts.*.w3.*", tp="colwise", expert=True),
    RuleSpec(f"{_MOE}.experts.*.w2.*", tp="rowwise", expert=True),
    RuleSpec(f"{_MOE}.gate.*", tp=R),  # router [E, H]
    RuleSpec(f"{_MOE}.e_score_correction_bias", tp=R),
    *NORM_RULES,
)

# Mixtral's on-disk expert names; transformers 5.24 renames the block's correction bias on load
# (conversion_mapping.py: ``.block_sparse_moe.e_score_correction_bias`` -> ``.mlp.…``).
EXPERTS = dataclasses.replace(
    MIXTRAL_EXPERTS,
    aliases=(("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),),
)

# transformers 5.24 MiniMaxM2Config defaults for the keys a config may leave out
DEFAULTS: Config = {
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 196608,
    "num_experts_per_tok": 8,
    "num_local_experts": 256,
}
SHAPE_KEYS = (*DECODER_SHAPES, "num_local_experts", "num_experts_per_tok", "attention_bias")
# The published config.json's other keys: routing and rotary settings, and the MTP and
# lightning-attention switches this family checks (``_check``) but no tensor follows.
CONFIG_KEYS = (
    *DECODER_OTHER,
    "rotary_dim",
    "scoring_func",
    "use_routing_bias",
    "use_qk_norm",
    "qk_norm_type",
    "shared_intermediate_size",
    "attn_type_list",
    "num_mtp_modules",
    "mtp_transformer_layers",
    "use_mtp",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "quantization_config",
)


def _config(config: Config) -> Config:
    return {**DEFAULTS, **config}


def _check(config: Config, where: str) -> None:
    """What this family (like vLLM's ``MiniMaxM2ForCausalLM``) does not build: lightning
    attention layers (MiniMax-Text-01's ``attn_type_list`` 0s: the ``minimax`` family), a
    shared expert, a router without its bias or another router, or per-head q/k norms. One
    line each, exit 3."""
    types = config.get("attn_type_list")
    if isinstance(types, (list, tuple)) and any(t != 1 for t in types):
        raise InvalidInputError(
            "attn_type_list has linear-attention layers (0): MiniMax-M2 has full attention only",
            where=where,
            hint="MiniMax-Text-01 / M1 (model_type minimax) are not supported",
        )
    shared = config.get("shared_intermediate_size")
    if shared not in (None, 0):
        raise InvalidInputError(
            f"shared_intermediate_size {shared!r}: MiniMax-M2 has no shared expert",
            where=where,
            hint="set it to 0 or leave it out",
        )
    if not get_bool(config, "use_routing_bias", where, True):
        raise InvalidInputError(
            "use_routing_bias false: MiniMax-M2's router has a correction bias (transformers "
            "and vLLM build it)",
            where=where,
            hint="set use_routing_bias to true or leave it out",
        )
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise InvalidInputError(
            f"scoring_func {config.get('scoring_func')!r}: expected 'sigmoid'", where=where
        )
    if config.get("qk_norm_type", "per_layer") != "per_layer" or not get_bool(
        config, "use_qk_norm", where, True
    ):
        raise InvalidInputError(
            "MiniMax-M2 normalizes the whole q and k projections "
            f"(qk_norm_type per_layer, use_qk_norm true); got qk_norm_type "
            f"{config.get('qk_norm_type')!r}, use_qk_norm {config.get('use_qk_norm')!r}",
            where=where,
        )


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    """MiniMax-M2 → ``ModelDims(3072, 62, 48, 8, 128, 1536, 200064, …)``, ``intermediate_size``
    the experts' width (there is no dense MLP)."""
    c = _config(config)
    _check(c, where)
    return decoder_dims(c, tied, where, experts_key="num_local_experts")


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    moe = f"{p}.block_sparse_moe"
    bias = get_bool(config, "attention_bias", where, False)
    out = attention(p, d, qkv_bias=bias, o_bias=False)
    out += [
        (f"{p}.self_attn.q_norm.weight", (d.num_heads * d.head_dim,)),
        (f"{p}.self_attn.k_norm.weight", (d.num_kv_heads * d.head_dim,)),
        (f"{moe}.gate.weight", (d.num_experts, d.hidden_size)),
        (f"{moe}.e_score_correction_bias", (d.num_experts,)),
    ]
    return out + expert_shapes(moe, d) + norms(p, d, LAYER_NORMS)


def _shard_layer(layer: Any, comm: Any, rank: int, tp: int, d: ModelDims) -> None:
    """The q/k norms over the whole projection from this rank's slice: the local model built
    them at the local width and loaded the rank's slice of each weight."""
    from shardctl.archs._tp_norm import TPRMSNorm

    if tp == 1:
        return
    attn = layer.self_attn
    eps = float(attn.q_norm.variance_epsilon)
    for name in ("q_norm", "k_norm"):
        inner = getattr(attn, name)
        size = int(inner.get_parameter("weight").shape[0])
        setattr(attn, name, TPRMSNorm(inner, comm, tp=tp, start=0, size=size, eps=eps))


_BASE = decoder_family(
    "minimax_m2",
    qkv_bias=None,
    o_bias=False,
    experts_key="num_local_experts",
    layer=_layer,
    rules=RULES,
    follows="vLLM minimax_m2.py (MiniMaxM2ForCausalLM, FusedMoE, MiniMaxText01RMSNormTP)",
    # the published FP8 release quantizes every projection but the router (its
    # modules_to_not_convert: gate, e_score_correction_bias, lm_head)
    quantizable=("model.layers.*.self_attn.*_proj.weight", f"{_MOE}.experts.*.w[123].weight"),
    shape_keys=SHAPE_KEYS,
    config_keys=CONFIG_KEYS,
)
_FORWARD = decoder_forward(
    row_parallel=("self_attn.o_proj",), experts=EXPERTS, localize=localize_experts
)
FAMILY: Family = dataclasses.replace(
    _BASE,
    dims=_dims,
    tensors=lambda config, d, where: _BASE.tensors(_config(config), d, where),
    forward=dataclasses.replace(_FORWARD, shard_layer=_shard_layer, route_weights=sigmoid_weights),
    # whole-projection q/k norms and the correction bias: not the Mixtral closed form
    closed_form=False,
    # vLLM MiniMaxM2MoE: ``gate = ReplicatedLinear(..., params_dtype=torch.float32)`` and
    # ``e_score_correction_bias`` made float32, whatever the checkpoint stores (BF16)
    vllm_float32=(f"{_MOE}.gate.weight", f"{_MOE}.e_score_correction_bias"),
)
