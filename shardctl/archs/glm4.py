"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414): biased q/k/v, a fused ``gate_up_proj`` = ``[gate; up]``
and two extra norms per layer (``post_self_attn_layernorm``, ``post_mlp_layernorm``).

On disk (``save_pretrained``)::

    self_attn.{q,k,v}_proj.weight/.bias (attention_bias, default true)   o_proj.weight (no bias)
    mlp.gate_up_proj.weight [2·I, H]   mlp.down_proj.weight [H, I]
    input_layernorm / post_self_attn_layernorm / post_attention_layernorm / post_mlp_layernorm [H]

A plain chunk of ``gate_up_proj`` is wrong: gate and up are split on their own and each rank's
pieces concatenated (``parts``). Placement follows vLLM ``glm4.py`` (``Glm4ForCausalLM``:
``QKVParallelLinear(bias=attention_bias)``, ``o_proj`` ``RowParallelLinear(bias=False)``,
``MergedColumnParallelLinear`` gate_up). Partial rotary acts inside a head. ``head_dim``
defaults to 128 in transformers' config (not hidden / heads): the published configs state it.
"""

from __future__ import annotations

import dataclasses

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    NORM_RULES,
    attention,
    decoder_dims,
    decoder_family,
    norms,
)
from shardctl.archs._family import Config, MemoryFlags, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *ATTENTION_RULES,
    RuleSpec(
        "model.layers.*.mlp.gate_up_proj.*", tp="colwise", parts=("intermediate", "intermediate")
    ),
    RuleSpec("model.layers.*.mlp.down_proj.*", tp="rowwise"),
    *NORM_RULES,
)
NORMS = (
    "input_layernorm",
    "post_self_attn_layernorm",
    "post_attention_layernorm",
    "post_mlp_layernorm",
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    if config.get("head_dim") is None:  # transformers' Glm4Config default, not hidden / heads
        config = {**config, "head_dim": 128}
    return decoder_dims(config, tied, where)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    out = attention(p, d, qkv_bias=get_bool(config, "attention_bias", where, True), o_bias=False)
    out += [(f"{p}.mlp.gate_up_proj.weight", (2 * i, h)), (f"{p}.mlp.down_proj.weight", (h, i))]
    return out + norms(p, d, NORMS)


def _memory(config: Config) -> MemoryFlags:
    return MemoryFlags(qkv_bias=get_bool(config, "attention_bias", "config", True))


FAMILY = dataclasses.replace(
    decoder_family(
        "glm4",
        layer=_layer,
        rules=RULES,
        follows="vLLM glm4.py (Glm4ForCausalLM)",
        shape_keys=(*DECODER_SHAPES, "attention_bias"),
        config_keys=(*DECODER_OTHER, "pad_token_id"),
    ),
    dims=_dims,
    memory=_memory,
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
