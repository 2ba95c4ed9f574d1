"""Mixtral (sparse MoE): Llama attention; per layer a router and ``E`` experts, as on the hub.

On disk (the published checkpoints, not transformers 5's packed in-memory form)::

    block_sparse_moe.gate.weight            [E, H]   router, replicated
    block_sparse_moe.experts.{e}.w1.weight  [I, H]   gate, column-parallel
    block_sparse_moe.experts.{e}.w3.weight  [I, H]   up, column-parallel
    block_sparse_moe.experts.{e}.w2.weight  [H, I]   down, row-parallel

Experts are contiguous over ``ep`` (expert ``e`` on ep rank ``e // (E / ep)``) and tensor-
parallel inside. Placement follows vLLM ``mixtral.py`` (``FusedMoE``) and Megatron-Core MoE.
"""

from __future__ import annotations

from typing import Any

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    LAYER_NORMS,
    NORM_RULES,
    R,
    attention,
    decoder_family,
    decoder_forward,
    norms,
)
from shardctl.archs._family import (
    Config,
    ExpertSpec,
    MegatronDecl,  # megatron-moe
    Shapes,
)
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_MOE = "model.layers.*.block_sparse_moe"
RULES: tuple[RuleSpec, ...] = (
    END_RULES
    + ATTENTION_RULES
    + (
        RuleSpec(f"{_MOE}.experts.*.w1.*", tp="colwise", expert=True),
        RuleSpec(f"{_MOE}.experts.*.w3.*", tp="colwise", expert=True),
        RuleSpec(f"{_MOE}.experts.*.w2.*", tp="rowwise", expert=True),
        RuleSpec(f"{_MOE}.gate.*", tp=R),  # router [E, H]
    )
    + NORM_RULES
)

EXPERTS = ExpertSpec(
    router="block_sparse_moe.gate.weight",
    router_param="mlp.gate.weight",
    pattern=r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$",
    gate="w1",
    up="w3",
    down="w2",
    module="mlp.experts",
)


def expert_shapes(moe: str, d: ModelDims) -> Shapes:
    """The hub's per-expert ``{moe}.experts.{e}.w1/w2/w3.weight`` of ``d.num_experts`` experts
    of width ``d.intermediate_size`` (MiniMax-M2 names its experts the same)."""
    h, i = d.hidden_size, d.intermediate_size
    out: Shapes = []
    for e in range(d.num_experts):
        out += [
            (f"{moe}.experts.{e}.w1.weight", (i, h)),
            (f"{moe}.experts.{e}.w2.weight", (h, i)),
            (f"{moe}.experts.{e}.w3.weight", (i, h)),
        ]
    return out


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    moe = f"{p}.block_sparse_moe"
    out = attention(p, d, qkv_bias=False, o_bias=False)
    out.append((f"{moe}.gate.weight", (d.num_experts, d.hidden_size)))
    return out + expert_shapes(moe, d) + norms(p, d, LAYER_NORMS)


def localize_experts(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each layer's experts module rebuilt (its own class: Mixtral's, MiniMax-M2's) with this
    ep rank's ``E / ep`` experts."""
    import copy

    sub = copy.copy(config)
    sub.num_local_experts = d.num_experts // ep
    for layer in model.model.layers:
        layer.mlp.experts = type(layer.mlp.experts)(sub).to(dtype)


FAMILY = decoder_family(
    "mixtral",
    qkv_bias=False,
    o_bias=False,
    experts_key="num_local_experts",
    layer=_layer,
    rules=RULES,
    # down_proj lives in the experts: LocalExperts sums them over tp and ep.
    forward=decoder_forward(
        row_parallel=("self_attn.o_proj",), experts=EXPERTS, localize=localize_experts
    ),
    follows="vLLM mixtral.py / Megatron-Core MoE",
    quantizable=("model.layers.*_proj.weight", f"{_MOE}.experts.*.w[123].weight"),
    shape_keys=(*DECODER_SHAPES, "num_local_experts", "num_experts_per_tok"),
    config_keys=(
        *DECODER_OTHER,
        *SLIDING,
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    ),
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(moe="block_sparse_moe", expert=("w1", "w3", "w2"), router="softmax_topk"),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import MIXTRAL, declare  # noqa: E402

FAMILY = declare(FAMILY, MIXTRAL)
