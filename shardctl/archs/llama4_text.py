"""Llama-4 text (``llama4_text``, ``Llama4ForCausalLM``): Llama attention (no biases, weightless
L2 q/k norm, chunked-attention / no-rope layers are config only); MoE in the layers of
``moe_layers`` (default: every ``interleave_moe_layer_step``-th), dense MLP elsewhere.

On disk, as transformers 5.23 ``save_pretrained`` writes ``Llama4ForCausalLM`` (experts PACKED,
the same names and shapes in memory)::

    feed_forward.router.weight                   [E, H]       replicated
    feed_forward.experts.gate_up_proj            [E, H, 2I]   S(2), parts [gate I | up I]
    feed_forward.experts.down_proj               [E, I, H]    S(1) (stored [in, out])
    feed_forward.shared_expert.gate/up_proj.weight [I, H]     column-parallel
    feed_forward.shared_expert.down_proj.weight  [H, I]       row-parallel
    feed_forward.gate/up_proj.weight             [I_mlp, H]   dense layers: column-parallel
    feed_forward.down_proj.weight                [H, I_mlp]   row-parallel

``I`` is ``intermediate_size`` (experts and shared expert), ``I_mlp`` ``intermediate_size_mlp``
(dense layers). Expert tensors split dim 0 over ``ep``. Placement follows vLLM ``llama4.py``
(``Llama4MoE``: ``FusedMoE`` experts, the shared expert a tensor-parallel ``LlamaMLP``, router
``ReplicatedLinear``; dense layers ``LlamaMLP`` of ``intermediate_size_mlp``).

The published Llama-4-Scout/Maverick repositories are the multimodal
``Llama4ForConditionalGeneration`` (``model_type: llama4``): the same text tensors under
``language_model.model.*`` / ``language_model.lm_head.weight`` plus ``vision_model.*`` and
``multi_modal_projector.*``: family ``llama4`` (:mod:`shardctl.archs.llama4`), which places these
text tensors with this file's rules under ``language_model.``.
"""

from __future__ import annotations

import copy
import dataclasses
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
    decoder_local_config,
    norms,
)
from shardctl.archs._family import Config, ExpertSpec, Shapes, get_bool, get_int, local_div
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_FF = "model.layers.*.feed_forward"
RULES: tuple[RuleSpec, ...] = (
    END_RULES
    + ATTENTION_RULES
    + (
        RuleSpec(
            f"{_FF}.experts.gate_up_proj",
            tp="S(2)",
            parts=("intermediate", "intermediate"),
            expert=True,
        ),
        RuleSpec(f"{_FF}.experts.down_proj", tp="S(1)", expert=True),
        RuleSpec(f"{_FF}.router.*", tp=R),
        RuleSpec(f"{_FF}.shared_expert.gate_proj.*", tp="colwise"),
        RuleSpec(f"{_FF}.shared_expert.up_proj.*", tp="colwise"),
        RuleSpec(f"{_FF}.shared_expert.down_proj.*", tp="rowwise"),
        RuleSpec(f"{_FF}.gate_proj.*", tp="colwise"),
        RuleSpec(f"{_FF}.up_proj.*", tp="colwise"),
        RuleSpec(f"{_FF}.down_proj.*", tp="rowwise"),
    )
    + NORM_RULES
)

EXPERTS = ExpertSpec(
    router="feed_forward.router.weight",
    router_param="feed_forward.router.weight",
    module="feed_forward.experts",
    call="stacked",
)


def moe_layers(config: Config, num_layers: int, where: str) -> list[int]:
    """``moe_layers`` if given, else every ``interleave_moe_layer_step``-th layer (from
    ``step - 1``), as ``Llama4TextConfig`` derives it."""
    given = config.get("moe_layers")
    if given is None:
        step = get_int(config, "interleave_moe_layer_step", where, default=1)
        return list(range(step - 1, num_layers, step))
    if not isinstance(given, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in given
    ):
        raise InvalidInputError(
            f"'moe_layers': expected a list of layer indices, got {given!r}", where=where
        )
    return sorted(given)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i, e = d.hidden_size, d.intermediate_size, d.num_experts
    bias = get_bool(config, "attention_bias", where, False)
    out = attention(p, d, qkv_bias=bias, o_bias=bias)
    ff = f"{p}.feed_forward"
    if int(p.rsplit(".", 1)[1]) in moe_layers(config, d.num_layers, where):
        out += [
            (f"{ff}.router.weight", (e, h)),
            (f"{ff}.experts.gate_up_proj", (e, h, 2 * i)),
            (f"{ff}.experts.down_proj", (e, i, h)),
            (f"{ff}.shared_expert.gate_proj.weight", (i, h)),
            (f"{ff}.shared_expert.up_proj.weight", (i, h)),
            (f"{ff}.shared_expert.down_proj.weight", (h, i)),
        ]
    else:
        mlp = get_int(config, "intermediate_size_mlp", where)
        out += [
            (f"{ff}.gate_proj.weight", (mlp, h)),
            (f"{ff}.up_proj.weight", (mlp, h)),
            (f"{ff}.down_proj.weight", (h, mlp)),
        ]
    return out + norms(p, d, LAYER_NORMS)


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """The decoder's local config, plus the dense width over tp and the stage's MoE / no-rope
    layers renumbered from 0."""
    local = decoder_local_config(cfg, d, tp, ep, first_layer, num_layers)
    local["intermediate_size_mlp"] = local_div(
        "intermediate_size_mlp", get_int(cfg, "intermediate_size_mlp", "config"), tp
    )
    local_div("num_local_experts", d.num_experts, ep)
    stage = range(first_layer, first_layer + num_layers)
    local["moe_layers"] = [
        i - first_layer for i in moe_layers(cfg, d.num_layers, "config") if i in stage
    ]
    rope = cfg.get("no_rope_layers")
    if isinstance(rope, (list, tuple)) and len(rope) == d.num_layers:
        local["no_rope_layers"] = rope[first_layer : first_layer + num_layers]
    return local


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each MoE layer's experts module rebuilt with this ep rank's ``E / ep`` experts."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    sub = copy.copy(config)
    sub.num_local_experts = d.num_experts // ep
    for layer in model.model.layers:
        if getattr(layer.feed_forward, "experts", None) is not None:
            layer.feed_forward.experts = Llama4TextExperts(sub).to(dtype)


_FORWARD = decoder_forward(
    # the routed experts' down_proj lives in the experts: StackedLocalExperts sums them
    row_parallel=(
        "self_attn.o_proj",
        "feed_forward.down_proj",
        "feed_forward.shared_expert.down_proj",
    ),
    experts=EXPERTS,
    localize=_localize,
)

FAMILY = decoder_family(
    "llama4_text",
    experts_key="num_local_experts",
    layer=_layer,
    rules=RULES,
    forward=dataclasses.replace(_FORWARD, local_config=_local_config),
    follows="vLLM llama4.py (Llama4ForCausalLM, Llama4MoE / FusedMoE)",
    shape_keys=(
        *DECODER_SHAPES,
        "num_local_experts",
        "num_experts_per_tok",
        "intermediate_size_mlp",
        "interleave_moe_layer_step",
        "moe_layers",
        "attention_bias",
    ),
    config_keys=(
        *DECODER_OTHER,
        "layer_types",
        "attention_chunk_size",
        "no_rope_layers",
        "no_rope_layer_interval",
        "use_qk_norm",
        "attn_temperature_tuning",
        "attn_scale",
        "floor_scale",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "for_llm_compressor",
    ),
)
# flagships: shared expert, dense layers of intermediate_size_mlp: not the closed form's uniform
# MoE layer; plan counts by kind from the layout engine (exact).
FAMILY = dataclasses.replace(FAMILY, closed_form=False)
