"""Cohere Command-R / Command-R+: one LayerNorm (no bias) feeding attention and MLP in
parallel, ``logit_scale`` on the logits, tied embeddings; optional per-head q/k LayerNorm.

On disk (``save_pretrained``)::

    self_attn.{q,k,v,o}_proj.weight (biases when attention_bias)   mlp.{gate,up,down}_proj.weight
    input_layernorm.weight [H]          (the only norm of a layer; model.norm.weight [H])
    self_attn.q_norm.weight [heads, head_dim]   k_norm [kv_heads, head_dim]   (use_qk_norm)

The q/k norms have one row of weights *per head*, so they split with their heads: ``S(0)`` by
whole q / kv heads (kv rows replicated when ``tp > kv_heads``), as vLLM's ``cohere.py`` loads
them (``LayerNorm(param_shape=(num_heads, head_dim))`` at the rank's local heads, weight loader
sharding dim 0 by tp rank). Everything else follows vLLM ``cohere.py`` (``CohereForCausalLM``):
Llama's parallel linears; ``logit_scale`` acts on activations and survives tp unchanged. The
parallel residual sums two row-parallel outputs, each all-reduced on its own.
"""

from __future__ import annotations

import dataclasses

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    MLP_RULES,
    attention,
    decoder_family,
    gated_mlp,
    norms,
)
from shardctl.archs._family import Config, MemoryFlags, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

R = "R"
RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *ATTENTION_RULES,
    RuleSpec("model.layers.*.self_attn.q_norm.*", tp="S(0)", heads="q"),
    RuleSpec("model.layers.*.self_attn.k_norm.*", tp="S(0)", heads="kv"),
    *MLP_RULES,
    RuleSpec("model.layers.*.input_layernorm.*", tp=R),
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    bias = get_bool(config, "attention_bias", where, False)
    out = attention(p, d, qkv_bias=bias, o_bias=bias)
    if get_bool(config, "use_qk_norm", where, False):
        out += [
            (f"{p}.self_attn.q_norm.weight", (d.num_heads, d.head_dim)),
            (f"{p}.self_attn.k_norm.weight", (d.num_kv_heads, d.head_dim)),
        ]
    return out + gated_mlp(p, d, bias=False) + norms(p, d, ("input_layernorm",))


def _memory(config: Config) -> MemoryFlags:
    bias = get_bool(config, "attention_bias", "config", False)
    return MemoryFlags(qkv_bias=bias, o_bias=bias)


FAMILY = dataclasses.replace(
    decoder_family(
        "cohere",
        tied_default=True,
        layer=_layer,
        rules=RULES,
        follows="vLLM cohere.py (CohereForCausalLM)",
        shape_keys=(*DECODER_SHAPES, "attention_bias", "use_qk_norm"),
        config_keys=(*DECODER_OTHER, "layer_norm_eps", "logit_scale"),
    ),
    memory=_memory,
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import COHERE, declare  # noqa: E402

FAMILY = declare(FAMILY, COHERE)
