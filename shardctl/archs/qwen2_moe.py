"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) and, in sparse
layers, ``E`` routed experts plus one shared expert gated by a sigmoid.

On disk, per sparse layer, beside the routed experts of :mod:`shardctl.archs._qwen_moe`::

    mlp.shared_expert.gate_proj/up_proj.weight  [I_shared, H]  column-parallel
    mlp.shared_expert.down_proj.weight          [H, I_shared]  row-parallel
    mlp.shared_expert_gate.weight               [1, H]         replicated

Placement follows vLLM ``qwen2_moe.py`` (``Qwen2MoeSparseMoeBlock``: ``FusedMoE`` experts, the
shared expert a tensor-parallel ``Qwen2MoeMLP``, ``shared_expert_gate`` a replicated
``ReplicatedLinear``); experts contiguous over ``ep``.
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
    R,
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
    get_int,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_SHARED = "model.layers.*.mlp.shared_expert"
RULES: tuple[RuleSpec, ...] = (
    END_RULES
    + ATTENTION_RULES
    + moe.EXPERT_RULES
    + (
        RuleSpec(f"{_SHARED}.gate_proj.*", tp="colwise"),
        RuleSpec(f"{_SHARED}.up_proj.*", tp="colwise"),
        RuleSpec(f"{_SHARED}.down_proj.*", tp="rowwise"),
        RuleSpec(f"{_SHARED}_gate.*", tp=R),  # [1, H]
    )
    + MLP_RULES
    + NORM_RULES
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    out = attention(p, d, qkv_bias=True, o_bias=False)
    if int(p.rsplit(".", 1)[1]) in moe.sparse_layers(config, d.num_layers, where):
        shared = get_int(config, "shared_expert_intermediate_size", where)
        out.append((f"{p}.mlp.gate.weight", (d.num_experts, h)))
        for e in range(d.num_experts):
            out += [
                (f"{p}.mlp.experts.{e}.gate_proj.weight", (i, h)),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (i, h)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (h, i)),
            ]
        out += [
            (f"{p}.mlp.shared_expert.gate_proj.weight", (shared, h)),
            (f"{p}.mlp.shared_expert.up_proj.weight", (shared, h)),
            (f"{p}.mlp.shared_expert.down_proj.weight", (h, shared)),
            (f"{p}.mlp.shared_expert_gate.weight", (1, h)),
        ]
    else:  # a dense layer: the decoder's MLP at intermediate_size
        dense = get_int(config, "intermediate_size", where)
        out += gated_mlp(p, dataclasses.replace(d, intermediate_size=dense), bias=False)
    return out + norms(p, d, LAYER_NORMS)


_BASE = decoder_family(
    "qwen2_moe",
    qkv_bias=True,
    o_bias=False,
    layer=_layer,
    rules=RULES,
    forward=decoder_forward(
        # routed experts' down_proj lives in the experts: LocalExperts sums over tp and ep
        row_parallel=("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj"),
        experts=moe.EXPERTS,
        localize=moe.localize,
    ),
    follows="vLLM qwen2_moe.py (Qwen2MoeForCausalLM, FusedMoE) / Megatron-Core MoE",
    shape_keys=(*DECODER_SHAPES, *moe.MOE_SHAPES, "shared_expert_intermediate_size"),
    config_keys=(*DECODER_OTHER, *SLIDING, *moe.MOE_OTHER, "qkv_bias"),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(moe="mlp", shared="shared_expert", shared_gate="shared_expert_gate"),
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return moe.moe_dims(decoder_dims(config, tied, where), config, where)


FAMILY = moe.with_moe(_BASE, _dims)
# flagships: shared expert + its gate, dense layers off decoder_sparse_step: not the closed
# form's uniform MoE layer; plan counts by kind from the layout engine (exact).
FAMILY = dataclasses.replace(FAMILY, closed_form=False)
