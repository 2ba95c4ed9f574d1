"""Phi-1 / Phi-1.5 / Phi-2 (``phi``): biases everywhere, one LayerNorm per layer, a biased head.

On disk (transformers 5.23 ``save_pretrained``)::

    model.embed_tokens.weight [V, H]
    model.layers.{i}.self_attn.q_proj/k_proj/v_proj: weight [heads·d | kv·d, H], bias
    model.layers.{i}.self_attn.dense: weight [H, heads·d], bias [H]
    model.layers.{i}.self_attn.q_layernorm / k_layernorm: weight, bias [d] (qk_layernorm only)
    model.layers.{i}.mlp.fc1: weight [I, H], bias [I];  mlp.fc2: weight [H, I], bias [H]
    model.layers.{i}.input_layernorm: weight, bias [H]  (attention and MLP run in parallel on it)
    model.final_layernorm: weight, bias [H]
    lm_head.weight [V, H], lm_head.bias [V]

The head's bias is vocab-parallel with its weight (each rank adds its slice of the bias to its
slice of the logits; vocab padding pads the bias with zeros). Partial rotary changes no tensor.
Placement follows vLLM ``phi.py`` (q/k/v merged into a ``QKVParallelLinear``, ``dense`` and
``fc2`` row-parallel, ``fc1`` column-parallel, ``ParallelLMHead(bias=True)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._decoder import R, decoder_dims, decoder_local_config
from shardctl.archs._family import Config, Family, ForwardSpec, MemoryFlags, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_L = "model.layers.*"
RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.embed_tokens.weight", tp="vocab", stage="embedding"),
    RuleSpec("model.final_layernorm.*", tp=R, stage="last"),
    RuleSpec("lm_head.*", tp="vocab", stage="last"),  # weight [V, H] and bias [V]
    RuleSpec(f"{_L}.self_attn.q_proj.*", tp="colwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.k_proj.*", tp="colwise", heads="kv"),
    RuleSpec(f"{_L}.self_attn.v_proj.*", tp="colwise", heads="kv"),
    RuleSpec(f"{_L}.self_attn.dense.*", tp="rowwise", heads="q"),
    RuleSpec(f"{_L}.self_attn.[qk]_layernorm.*", tp=R),
    RuleSpec(f"{_L}.mlp.fc1.*", tp="colwise"),
    RuleSpec(f"{_L}.mlp.fc2.*", tp="rowwise"),
    RuleSpec(f"{_L}.input_layernorm.*", tp=R),
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return dataclasses.replace(decoder_dims(config, tied, where), gated_mlp=False)


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    h, i, v = d.hidden_size, d.intermediate_size, d.vocab_size
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    out: Shapes = [
        ("model.embed_tokens.weight", (v, h)),
        ("model.final_layernorm.weight", (h,)),
        ("model.final_layernorm.bias", (h,)),
    ]
    if not d.tie_word_embeddings:
        out += [("lm_head.weight", (v, h)), ("lm_head.bias", (v,))]
    qk_norm = get_bool(config, "qk_layernorm", where, False)
    for n in range(d.num_layers):
        p = f"model.layers.{n}"
        for name, rows, cols in (
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.dense", h, q),
            ("mlp.fc1", i, h),
            ("mlp.fc2", h, i),
        ):
            out += [(f"{p}.{name}.weight", (rows, cols)), (f"{p}.{name}.bias", (rows,))]
        norms = [("input_layernorm", h)]
        if qk_norm:  # per-head LayerNorm of hidden / heads
            norms += [("self_attn.q_layernorm", d.head_dim), ("self_attn.k_layernorm", d.head_dim)]
        for name, size in norms:
            out += [(f"{p}.{name}.weight", (size,)), (f"{p}.{name}.bias", (size,))]
    return out


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """qk_layernorm's LayerNorms are sized hidden / heads: with the local head count that is
    no longer the head size, so they are rebuilt at ``head_dim`` (their on-disk shape)."""
    if not getattr(config, "qk_layernorm", False):
        return
    from torch import nn

    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_layernorm", "k_layernorm"):
            eps = getattr(attn, name).eps
            setattr(attn, name, nn.LayerNorm(d.head_dim, eps=eps).to(dtype))


def _memory(config: Config) -> MemoryFlags:
    return MemoryFlags(qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True)


FAMILY = Family(
    name="phi",
    model_types=("phi",),
    tied_default=False,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=_memory,
    forward=ForwardSpec(
        layer_prefix="model.layers",
        embeddings=("model.embed_tokens",),
        final_norm="model.final_layernorm",
        lm_head="lm_head",
        row_parallel=("self_attn.dense", "mlp.fc2"),
        local_config=decoder_local_config,
        localize=_localize,
    ),
    follows="vLLM phi.py (PhiForCausalLM)",
    shape_keys=(*DECODER_SHAPES, "qk_layernorm"),
    config_keys=(
        *DECODER_OTHER,
        "layer_norm_eps",
        "embd_pdrop",
        "resid_pdrop",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import TRANSFORMERS_BACKEND, declare  # noqa: E402

FAMILY = declare(FAMILY, TRANSFORMERS_BACKEND)
