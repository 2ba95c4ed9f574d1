"""gpt-oss (gpt-oss-20b / gpt-oss-120b), the bf16 layout transformers 5.23 ``save_pretrained``
writes: Llama-like attention with q/k/v/o biases and per-head attention sinks; every layer MoE,
experts PACKED on disk (as in memory)::

    self_attn.sinks                 [heads]        split by q head (a rank's heads' sinks)
    mlp.router.weight / .bias       [E, H] / [E]   replicated
    mlp.experts.gate_up_proj        [E, H, 2I]     S(2): gate/up INTERLEAVED (col 2j gate j,
                                                   2j+1 up j), so a contiguous chunk of the last
                                                   dim is matching gate and up columns
    mlp.experts.gate_up_proj_bias   [E, 2I]        S(1), interleaved the same way
    mlp.experts.down_proj           [E, I, H]      S(1) (stored [in, out]: row-parallel)
    mlp.experts.down_proj_bias      [E, H]         replicated over tp, added once after the sum

Every expert tensor splits dim 0 over ``ep`` (experts contiguous). Placement follows vLLM
``gpt_oss.py`` (``_load_weights_other``: ``w13`` narrowed to columns ``2·start .. 2·end`` of the
interleaved dim, ``w2`` rows ``start .. end``, the ``w2`` bias only on tp rank 0; sinks narrowed
by head). Layers alternate sliding-window / full attention (``layer_types``).

Quantized checkpoints: the published gpt-oss files store the experts in MXFP4
(``gate_up_proj_blocks [E, 2I, H/32, 16]`` U8, ``gate_up_proj_scales [E, 2I, H/32]`` U8, and the
same for ``down_proj``; attention, router, embeddings and head BF16). A config with the published
``quantization_config`` (``quant_method: mxfp4``) inventories exactly those
(shardctl/quant/expand.py): gpt-oss-120b's 65,248,815,744 bytes, its index's ``total_size``
(tests/test_flagships.py). Tensor parallelism splits the blocks' in-features by whole 32-value
blocks only (tp 1 or 2 for gpt-oss' 2880).
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
    norms,
)
from shardctl.archs._family import Config, ExpertSpec, Shapes
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_EX = "model.layers.*.mlp.experts"
RULES: tuple[RuleSpec, ...] = (
    END_RULES
    + ATTENTION_RULES
    + (
        RuleSpec("model.layers.*.self_attn.sinks", tp="S(0)", heads="q"),
        RuleSpec(f"{_EX}.gate_up_proj", tp="S(2)", expert=True),
        RuleSpec(f"{_EX}.gate_up_proj_bias", tp="S(1)", expert=True),
        RuleSpec(f"{_EX}.down_proj", tp="S(1)", expert=True),
        RuleSpec(f"{_EX}.down_proj_bias", tp=R, expert=True),
        RuleSpec("model.layers.*.mlp.router.*", tp=R),
    )
    + NORM_RULES
)

EXPERTS = ExpertSpec(
    router="mlp.router.weight",
    router_param="mlp.router.weight",
    module="mlp.experts",
    once=("down_proj_bias",),
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i, e = d.hidden_size, d.intermediate_size, d.num_experts
    out = attention(p, d, qkv_bias=True, o_bias=True)
    out += [
        (f"{p}.self_attn.sinks", (d.num_heads,)),
        (f"{p}.mlp.router.weight", (e, h)),
        (f"{p}.mlp.router.bias", (e,)),
        (f"{p}.mlp.experts.gate_up_proj", (e, h, 2 * i)),
        (f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * i)),
        (f"{p}.mlp.experts.down_proj", (e, i, h)),
        (f"{p}.mlp.experts.down_proj_bias", (e, h)),
    ]
    return out + norms(p, d, LAYER_NORMS)


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each layer's experts module rebuilt with this ep rank's ``E / ep`` experts."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    sub = copy.copy(config)
    sub.num_local_experts = d.num_experts // ep
    for layer in model.model.layers:
        layer.mlp.experts = GptOssExperts(sub).to(dtype)


FAMILY = decoder_family(
    "gpt_oss",
    qkv_bias=True,
    o_bias=True,
    experts_key="num_local_experts",
    layer=_layer,
    rules=RULES,
    forward=decoder_forward(
        row_parallel=("self_attn.o_proj",), experts=EXPERTS, localize=_localize
    ),
    follows="vLLM gpt_oss.py (GptOssForCausalLM, FusedMoE; bf16 weight loading)",
    shape_keys=(*DECODER_SHAPES, "num_local_experts", "num_experts_per_tok", "attention_bias"),
    config_keys=(
        *DECODER_OTHER,
        *SLIDING,
        "output_router_logits",
        "router_aux_loss_coef",
        "swiglu_alpha",
        "swiglu_limit",
        "experts_per_token",
        "num_experts",
        "quantization_config",
    ),
    sliding_layers="even",
)
# flagships: sinks, router and expert biases are not the closed form's uniform MoE layer; plan
# counts by kind from the layout engine (exact).
FAMILY = dataclasses.replace(FAMILY, closed_form=False)
