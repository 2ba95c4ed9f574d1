"""DeepSeek-V2 (and the shared builder of DeepSeek-V3): multi-head latent attention + MoE.

On disk (transformers 5.23 ``save_pretrained`` = the published hub files; ``nn.Linear``
``[out, in]``; ``qk = qk_nope_head_dim + qk_rope_head_dim``, ``a`` heads)::

    self_attn.q_proj.weight            [a·qk, H]               (q_lora_rank null: V2-Lite)
    self_attn.q_a_proj.weight          [q_lora_rank, H]        (else: low-rank query)
    self_attn.q_a_layernorm.weight     [q_lora_rank]
    self_attn.q_b_proj.weight          [a·qk, q_lora_rank]
    self_attn.kv_a_proj_with_mqa.weight [kv_lora_rank + qk_rope_head_dim, H]
    self_attn.kv_a_layernorm.weight    [kv_lora_rank]
    self_attn.kv_b_proj.weight         [a·(qk_nope_head_dim + v_head_dim), kv_lora_rank]
    self_attn.o_proj.weight            [H, a·v_head_dim]
    layers < first_k_dense_replace:  mlp.gate_proj/up_proj [I, H], down_proj [H, I]
    other layers:  mlp.gate.weight [E, H] (router; V3 also mlp.gate.e_score_correction_bias [E])
                   mlp.experts.{e}.gate_proj/up_proj [moe_I, H], down_proj [H, moe_I]
                   mlp.shared_experts.gate_proj/up_proj [n_shared·moe_I, H], down_proj [.., ..]

transformers 5 packs the experts in memory (``mlp.experts.gate_up_proj [E, 2·moe_I, H]``,
``down_proj [E, H, moe_I]``); the inventory and the rules follow the on-disk per-expert names,
and verify's forward level maps them onto the packed parameters (:class:`ExpertSpec`).

Placement follows vLLM ``deepseek_v2.py`` (``DeepseekV2MLAAttention``): the low-rank
projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their layernorms are ``ReplicatedLinear``
/ replicated; ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` are ``ColumnParallelLinear`` split by
whole heads; ``o_proj`` ``RowParallelLinear``. Routed experts: ``FusedMoE`` (contiguous over
``ep``, tensor-parallel inside); shared experts: a tensor-parallel gated MLP
(``DeepseekV2MLP``); the router ``ReplicatedLinear``. Each tp rank thus holds ``a / tp`` heads
with the full compressed projections.

Multi-token prediction (DeepSeek-V3, vLLM ``deepseek_mtp.py``): the published checkpoint
carries ``num_nextn_predict_layers`` extra layers after the decoder stack,
``model.layers.{L + k}.*`` = a full decoder layer plus ``embed_tokens`` [V, H] (vocab-parallel),
``enorm`` / ``hnorm`` [H], ``eh_proj`` [H, 2H] (a plain replicated ``nn.Linear`` in vLLM),
``shared_head.norm`` [H] and ``shared_head.head`` [V, H] (``ParallelLMHead``). transformers
neither builds nor writes them, so the inventory from a config counts them only when the
config (or manifest) sets shardctl's ``include_mtp_layers: true``; a checkpoint that has them
(headers) is placed like vLLM does: on the last pipeline stage (``ModelDims.mtp_layers``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from shardctl.archs._decoder import END_RULES, LAYER_NORMS, MLP_RULES, NORM_RULES, R, norms
from shardctl.archs._family import (
    Config,
    ExpertSpec,
    Family,
    ForwardSpec,
    MegatronDecl,  # megatron-moe
    MemoryFlags,
    Shapes,
    get_bool,
    get_int,
    local_div,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

FOLLOWS = "vLLM deepseek_v2.py (DeepseekV2MLAAttention, FusedMoE) and deepseek_mtp.py"
MTP_KEY = "include_mtp_layers"  # shardctl's own key: count the MTP layers in the inventory

_L = "model.layers.*"
# First match wins: MTP-only names, then MLA, experts, shared experts, router, dense MLP, norms.
# The MTP layer's own names (DeepSeek-V3's, GLM-4.5's): copies of the main table and head
# vocab-parallel, its norms and projection whole.
MTP_RULES: tuple[RuleSpec, ...] = (
    RuleSpec(f"{_L}.embed_tokens.weight", tp="vocab"),  # MTP: the main table's copy
    RuleSpec(f"{_L}.shared_head.head.weight", tp="vocab"),  # MTP: the main head's copy
    RuleSpec(f"{_L}.shared_head.norm.*", tp=R),
    RuleSpec(f"{_L}.[eh]norm.*", tp=R),
    RuleSpec(f"{_L}.eh_proj.*", tp=R),
)
# DeepSeek's MoE block (GLM-4.5's too): routed experts over ep then tp, shared experts like a
# dense MLP, the router (and V3's e_score_correction_bias) whole.
MOE_RULES: tuple[RuleSpec, ...] = (
    RuleSpec(f"{_L}.mlp.experts.*.gate_proj.*", tp="colwise", expert=True),
    RuleSpec(f"{_L}.mlp.experts.*.up_proj.*", tp="colwise", expert=True),
    RuleSpec(f"{_L}.mlp.experts.*.down_proj.*", tp="rowwise", expert=True),
    RuleSpec(f"{_L}.mlp.shared_experts.gate_proj.*", tp="colwise"),
    RuleSpec(f"{_L}.mlp.shared_experts.up_proj.*", tp="colwise"),
    RuleSpec(f"{_L}.mlp.shared_experts.down_proj.*", tp="rowwise"),
    RuleSpec(f"{_L}.mlp.gate.*", tp=R),  # router weight [E, H], V3's e_score_correction_bias
)
# First match wins: MTP-only names, then MLA, experts, shared experts, router, dense MLP, norms.
RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *MTP_RULES,
    RuleSpec(f"{_L}.self_attn.q_proj.*", tp="colwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.q_b_proj.*", tp="colwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.kv_b_proj.*", tp="colwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.o_proj.*", tp="rowwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.q_a_proj.*", tp=R),
    RuleSpec(f"{_L}.self_attn.kv_a_proj_with_mqa.*", tp=R),
    *MOE_RULES,
    *MLP_RULES,
    *NORM_RULES,  # input/post_attention_layernorm, q_a_layernorm, kv_a_layernorm
)

EXPERTS = ExpertSpec(
    router="mlp.gate.weight",
    router_param="mlp.gate.weight",
    pattern=r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    module="mlp.experts",
)

SHAPE_KEYS = (
    *DECODER_SHAPES,
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "attention_bias",
    "mlp_bias",
    "num_nextn_predict_layers",
    MTP_KEY,
)
CONFIG_KEYS = (
    *DECODER_OTHER,
    "qk_head_dim",
    "n_group",
    "topk_group",
    "topk_method",
    "norm_topk_prob",
    "routed_scaling_factor",
    "scoring_func",
    "moe_layer_freq",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "pretraining_tp",
    "output_router_logits",
    "rope_interleave",
    "num_mtp_layers",
)


# ---- config -> dims -> tensors -------------------------------------------------------------


def _mla(config: Config, where: str) -> tuple[int | None, int, int, int, int]:
    """``(q_lora_rank or None, kv_lora_rank, qk_nope, qk_rope, v_head_dim)``."""
    q_lora = None if config.get("q_lora_rank") is None else get_int(config, "q_lora_rank", where)
    return (
        q_lora,
        get_int(config, "kv_lora_rank", where),
        get_int(config, "qk_nope_head_dim", where),
        get_int(config, "qk_rope_head_dim", where),
        get_int(config, "v_head_dim", where),
    )


def first_dense(config: Config, where: str) -> int:
    value = config.get("first_k_dense_replace")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(
            f"'first_k_dense_replace': expected an integer >= 0, got {value!r}", where=where
        )
    return value


def mtp_layer_count(config: Config, where: str) -> int:
    value = config.get("num_nextn_predict_layers")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(
            f"'num_nextn_predict_layers': expected an integer >= 0, got {value!r}", where=where
        )
    return value


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    """DeepSeek-V3 -> ``ModelDims(7168, 61, 128, 128, 192, 18432, 129280, ...)``.

    ``head_dim`` is the query/key head (``qk_nope + qk_rope``); MLA has no K/V heads of its own
    (the KV cache is one latent per token: shardctl/plan/memory/kv_layers.py), so
    ``num_kv_heads`` = heads. ``intermediate_size`` is the dense layers'.
    """
    _, _, nope, rope, _ = _mla(config, where)
    heads = get_int(config, "num_attention_heads", where)
    return ModelDims(
        hidden_size=get_int(config, "hidden_size", where),
        num_layers=get_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope,
        intermediate_size=get_int(config, "intermediate_size", where),
        vocab_size=get_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        num_experts=get_int(config, "n_routed_experts", where),
        experts_per_token=get_int(config, "num_experts_per_tok", where),
        max_position_embeddings=get_int(config, "max_position_embeddings", where, default=0),
        gated_mlp=True,
        mtp_layers=mtp_layer_count(config, where),
    )


def _attention(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    q_lora, kv_lora, nope, rope, v = _mla(config, where)
    h, a = d.hidden_size, d.num_heads
    bias = get_bool(config, "attention_bias", where, False)
    out: Shapes = []
    if q_lora is None:
        out.append((f"{p}.self_attn.q_proj.weight", (a * (nope + rope), h)))
    else:
        out += [
            (f"{p}.self_attn.q_a_proj.weight", (q_lora, h)),
            (f"{p}.self_attn.q_a_layernorm.weight", (q_lora,)),
            (f"{p}.self_attn.q_b_proj.weight", (a * (nope + rope), q_lora)),
        ]
        if bias:
            out.append((f"{p}.self_attn.q_a_proj.bias", (q_lora,)))
    out += [
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
        (f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,)),
        (f"{p}.self_attn.kv_b_proj.weight", (a * (nope + v), kv_lora)),
        (f"{p}.self_attn.o_proj.weight", (h, a * v)),
    ]
    if bias:
        out += [
            (f"{p}.self_attn.kv_a_proj_with_mqa.bias", (kv_lora + rope,)),
            (f"{p}.self_attn.o_proj.bias", (h,)),
        ]
    return out


def mlp_shapes(p: str, h: int, i: int, bias: bool) -> Shapes:
    out: Shapes = [
        (f"{p}.gate_proj.weight", (i, h)),
        (f"{p}.up_proj.weight", (i, h)),
        (f"{p}.down_proj.weight", (h, i)),
    ]
    if bias:
        out += [(f"{p}.gate_proj.bias", (i,)), (f"{p}.up_proj.bias", (i,))]
        out.append((f"{p}.down_proj.bias", (h,)))
    return out


def moe_shapes(
    p: str, d: ModelDims, config: Config, where: str, *, router_bias: bool, mlp_bias: bool
) -> Shapes:
    h, e = d.hidden_size, d.num_experts
    moe_i = get_int(config, "moe_intermediate_size", where)
    shared = (
        0 if config.get("n_shared_experts") == 0 else get_int(config, "n_shared_experts", where)
    )
    out: Shapes = [(f"{p}.mlp.gate.weight", (e, h))]
    if router_bias:
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (e,)))
    for x in range(e):
        out += mlp_shapes(f"{p}.mlp.experts.{x}", h, moe_i, False)
    if shared:
        bias = mlp_bias and get_bool(config, "mlp_bias", where, False)
        out += mlp_shapes(f"{p}.mlp.shared_experts", h, shared * moe_i, bias)
    return out


def _layer(
    i: int, d: ModelDims, config: Config, where: str, *, router_bias: bool, mlp_bias: bool
) -> Shapes:
    p = f"model.layers.{i}"
    out = _attention(p, d, config, where)
    if i < first_dense(config, where):
        bias = mlp_bias and get_bool(config, "mlp_bias", where, False)
        out += mlp_shapes(f"{p}.mlp", d.hidden_size, d.intermediate_size, bias)
    else:
        out += moe_shapes(p, d, config, where, router_bias=router_bias, mlp_bias=mlp_bias)
    return out + norms(p, d, LAYER_NORMS)


def mtp_extras(p: str, d: ModelDims) -> Shapes:
    """What an MTP layer adds to a decoder layer (DeepSeek-V3 README_WEIGHTS.md)."""
    h, v = d.hidden_size, d.vocab_size
    return [
        (f"{p}.embed_tokens.weight", (v, h)),
        (f"{p}.enorm.weight", (h,)),
        (f"{p}.hnorm.weight", (h,)),
        (f"{p}.eh_proj.weight", (h, 2 * h)),
        (f"{p}.shared_head.norm.weight", (h,)),
        (f"{p}.shared_head.head.weight", (v, h)),
    ]


def stack_with_mtp(
    d: ModelDims, config: Config, where: str, layer: Callable[[int], Shapes]
) -> Shapes:
    """Embeddings, final norm, head (untied) and every decoder ``layer(i)``; with
    ``include_mtp_layers`` the ``num_nextn_predict_layers`` MTP layers after the stack too
    (each a decoder layer plus :func:`mtp_extras`). DeepSeek-V3's and GLM-4.5's layout."""
    out: Shapes = [
        ("model.embed_tokens.weight", (d.vocab_size, d.hidden_size)),
        ("model.norm.weight", (d.hidden_size,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (d.vocab_size, d.hidden_size)))
    extra = d.mtp_layers if get_bool(config, MTP_KEY, where, False) else 0
    for i in range(d.num_layers + extra):
        out += layer(i)
        if i >= d.num_layers:
            out += mtp_extras(f"model.layers.{i}", d)
    return out


# ---- forward -------------------------------------------------------------------------------


def local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """One rank: ``a / tp`` heads (with the full low-rank projections), dense and expert
    intermediates over tp, its stage's layers (which of them are dense shifts with the stage)."""
    local: dict[str, Any] = {
        "num_attention_heads": local_div("num_attention_heads", d.num_heads, tp),
        "num_key_value_heads": local_div("num_attention_heads", d.num_heads, tp),
        "intermediate_size": local_div("intermediate_size", d.intermediate_size, tp),
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": max(0, first_dense(cfg, "config") - first_layer),
    }
    moe_i = get_int(cfg, "moe_intermediate_size", "config")
    local["moe_intermediate_size"] = local_div("moe_intermediate_size", moe_i, tp)
    local_div("n_routed_experts", d.num_experts, ep)
    return local


def localize_experts(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each MoE layer's packed experts module rebuilt with this ep rank's ``E / ep`` experts."""
    sub = copy.copy(config)
    sub.n_routed_experts = d.num_experts // ep
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            layer.mlp.experts = type(experts)(sub).to(dtype)


def _softmax_weights(logits: Any, indices: Any, config: Config) -> Any:
    """V2's router (transformers ``DeepseekV2TopkRouter``): softmax scores at the chosen
    experts, times ``routed_scaling_factor``; never renormalized."""
    import torch

    scores = torch.softmax(logits.float(), dim=-1)
    return scores.gather(-1, indices) * float(config.get("routed_scaling_factor") or 1.0)


def mla_forward(route_weights: Any) -> ForwardSpec:
    return ForwardSpec(
        layer_prefix="model.layers",
        embeddings=("model.embed_tokens",),
        final_norm="model.norm",
        lm_head="lm_head",
        # Dense layers have mlp.down_proj, MoE layers mlp.shared_experts.down_proj; the routed
        # experts' down_proj lives in LocalExperts, which sums over tp and ep.
        row_parallel=("self_attn.o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj"),
        local_config=local_config,
        experts=EXPERTS,
        localize=localize_experts,
        route_weights=route_weights,
    )


# ---- the family builder --------------------------------------------------------------------


def mla_family(
    name: str,
    *,
    router_bias: bool,
    mlp_bias: bool,
    route_weights: Any,
    defaults: Config,
    follows: str = FOLLOWS,
    megatron: MegatronDecl | None = None,  # megatron-moe: how Megatron-Core holds it
    fp32_kept: tuple[tuple[str, str], ...] = (),
) -> Family:
    """A DeepSeek MLA + MoE family. ``router_bias``: V3's ``e_score_correction_bias``;
    ``mlp_bias``: the MLPs follow the config's ``mlp_bias`` (V2) or never have one (V3);
    ``defaults``: transformers' values for keys whose absence is not an error (an absent
    ``q_lora_rank`` is 1536, a null one means no low-rank query)."""

    def dims(config: Config, tied: bool, where: str) -> ModelDims:
        return _dims({**defaults, **config}, tied, where)

    def tensors(config: Config, d: ModelDims, where: str) -> Shapes:
        config = {**defaults, **config}

        def layer(i: int) -> Shapes:
            return _layer(i, d, config, where, router_bias=router_bias, mlp_bias=mlp_bias)

        return stack_with_mtp(d, config, where, layer)

    def memory(config: Config) -> MemoryFlags:
        bias = get_bool(config, "attention_bias", "config", False)
        return MemoryFlags(qkv_bias=bias, o_bias=bias)

    return Family(
        name=name,
        model_types=(name,),
        tied_default=False,
        dims=dims,
        tensors=tensors,
        rules=RULES,
        memory=memory,
        forward=mla_forward(route_weights),
        follows=follows,
        shape_keys=SHAPE_KEYS,
        config_keys=CONFIG_KEYS,
        closed_form=False,
        megatron=megatron,
        fp32_kept=fp32_kept,
    )


# transformers 5.23 DeepseekV2Config defaults for the keys a hub config may leave out
V2_DEFAULTS: Config = {"q_lora_rank": 1536, "first_k_dense_replace": 0, "n_shared_experts": 2}

FAMILY = mla_family(
    "deepseek_v2",
    router_bias=False,
    mlp_bias=True,
    route_weights=_softmax_weights,
    defaults=V2_DEFAULTS,
    # transformers 5.24 keeps the router in F32 (DeepseekV2PreTrainedModel's
    # _keep_in_fp32_modules_strict = ["gate.weight"]); 5.23 saved it in the model's dtype
    fp32_kept=(("5.24", "model.layers.*.mlp.gate.weight"),),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DEEPSEEK, declare  # noqa: E402

FAMILY = declare(FAMILY, DEEPSEEK)
