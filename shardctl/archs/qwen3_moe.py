"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head ``q_norm``/``k_norm``,
no biases) and routed experts without a shared expert (:mod:`shardctl.archs._qwen_moe`).

Placement follows vLLM ``qwen3_moe.py`` (``Qwen3MoeSparseMoeBlock``: ``FusedMoE`` experts, the
router ``gate`` a ``ReplicatedLinear``); experts contiguous over ``ep``. Note that
transformers 5 writes ``num_local_experts`` into a Qwen3-MoE ``config.json`` where the hub's
files say ``num_experts``: both are read.
"""

from __future__ import annotations

import dataclasses

from shardctl.archs import _qwen_moe as moe
from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    LAYER_NORMS,
    MLP_RULES,
    NORM_RULES,
    attention,
    decoder_dims,
    decoder_family,
    decoder_forward,
    gated_mlp,
    norms,
)
from shardctl.archs._family import (
    Config,
    MegatronDecl,  # megatron-moe
    Shapes,
    get_bool,
    get_int,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

RULES: tuple[RuleSpec, ...] = (
    END_RULES + ATTENTION_RULES + moe.EXPERT_RULES + MLP_RULES + NORM_RULES
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    bias = get_bool(config, "attention_bias", where, False)
    out = attention(p, d, qkv_bias=bias, o_bias=bias)
    out += [
        (f"{p}.self_attn.q_norm.weight", (d.head_dim,)),
        (f"{p}.self_attn.k_norm.weight", (d.head_dim,)),
    ]
    if int(p.rsplit(".", 1)[1]) in moe.sparse_layers(config, d.num_layers, where):
        out.append((f"{p}.mlp.gate.weight", (d.num_experts, h)))
        for e in range(d.num_experts):
            out += [
                (f"{p}.mlp.experts.{e}.gate_proj.weight", (i, h)),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (i, h)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (h, i)),
            ]
    else:  # a dense layer: the decoder's MLP at intermediate_size
        dense = get_int(config, "intermediate_size", where)
        out += gated_mlp(p, dataclasses.replace(d, intermediate_size=dense), bias=False)
    return out + norms(p, d, LAYER_NORMS)


_BASE = decoder_family(
    "qwen3_moe",
    layer=_layer,
    rules=RULES,
    forward=decoder_forward(
        row_parallel=("self_attn.o_proj", "mlp.down_proj"),
        experts=moe.EXPERTS,
        localize=moe.localize,
    ),
    follows="vLLM qwen3_moe.py (Qwen3MoeForCausalLM, FusedMoE) / Megatron-Core MoE",
    shape_keys=(*DECODER_SHAPES, *moe.MOE_SHAPES, "attention_bias"),
    config_keys=(*DECODER_OTHER, *SLIDING, *moe.MOE_OTHER),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(moe="mlp"),
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return moe.moe_dims(decoder_dims(config, tied, where), config, where)


FAMILY = moe.with_moe(_BASE, _dims)
