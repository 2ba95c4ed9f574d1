"""StableLM (StableLM-2, StableLM-3B-4E1T): Llama's projections with LayerNorm (with bias),
partial rotary, optional q/k/v biases (``use_qkv_bias``), optional per-head q/k LayerNorms
(``qk_layernorm``, StableLM-2-12B) and an optional parallel residual (``use_parallel_residual``:
no ``post_attention_layernorm``).

On disk (``save_pretrained``)::

    self_attn.{q,k,v}_proj.weight (+ .bias when use_qkv_bias)   self_attn.o_proj.weight (no bias)
    mlp.{gate,up,down}_proj.weight                               input_layernorm.weight/.bias [H]
    post_attention_layernorm.weight/.bias [H]   (absent with use_parallel_residual)
    self_attn.q_layernorm.norms.{h}.weight [head_dim]   h < heads      (qk_layernorm)
    self_attn.k_layernorm.norms.{h}.weight [head_dim]   h < kv_heads
    model.norm.weight/.bias [H]

Placement follows vLLM ``stablelm.py`` (``StablelmForCausalLM``: ``QKVParallelLinear`` with
``use_qkv_bias``, Llama's MLP). The per-head q/k norms are one small tensor per head; they are
replicated (every rank holds all of them, as for Qwen3's per-head norms) and verify's forward
level keeps only the rank's own heads' norms (``shard_layer``). Partial rotary acts inside a head
and survives tp unchanged. ``StableLmAttention`` derives head_dim as hidden / heads, so verify
builds each rank with the global head counts and shrinks the projections (``localize``), as for
GPT-2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._decoder import (
    ATTENTION_RULES,
    END_RULES,
    MLP_RULES,
    NORM_RULES,
    R,
    attention,
    decoder_family,
    decoder_forward,
    decoder_local_config,
    gated_mlp,
    norms,
)
from shardctl.archs._family import Config, MemoryFlags, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.self_attn.[qk]_layernorm.norms.*", tp=R),
    *END_RULES,
    *ATTENTION_RULES,
    *MLP_RULES,
    *NORM_RULES,
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h = d.hidden_size
    out = attention(p, d, qkv_bias=get_bool(config, "use_qkv_bias", where, False), o_bias=False)
    if get_bool(config, "qk_layernorm", where, False):
        out += [
            (f"{p}.self_attn.{which}_layernorm.norms.{n}.weight", (d.head_dim,))
            for which, heads in (("q", d.num_heads), ("k", d.num_kv_heads))
            for n in range(heads)
        ]
    out += gated_mlp(p, d, bias=False)
    names: tuple[str, ...] = ("input_layernorm",)
    if not get_bool(config, "use_parallel_residual", where, False):
        names += ("post_attention_layernorm",)
    return out + norms(p, d, names) + [(f"{p}.{n}.bias", (h,)) for n in names]


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    return [*_FAMILY.tensors(config, d, where), ("model.norm.bias", (d.hidden_size,))]


def _memory(config: Config) -> MemoryFlags:
    return MemoryFlags(qkv_bias=get_bool(config, "use_qkv_bias", "config", False), norm_bias=True)


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """Global head counts: ``StableLmAttention`` derives head_dim as hidden / heads (like GPT-2),
    so the rank's model is built whole-headed and ``_localize`` shrinks its projections."""
    local = decoder_local_config(cfg, d, tp, ep, first_layer, num_layers)
    local["num_attention_heads"] = d.num_heads
    local["num_key_value_heads"] = d.num_kv_heads
    return local


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each attention at its local heads: q/k/v/o at ``heads/tp`` (kv: ``max(1, kv/tp)``)."""
    from torch import nn

    q, kv = d.num_heads // tp, max(1, d.num_kv_heads // tp)
    h, hd = d.hidden_size, d.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        bias = attn.q_proj.bias is not None
        attn.num_heads, attn.num_key_value_heads, attn.num_key_value_groups = q, kv, q // kv
        attn.q_proj = nn.Linear(h, q * hd, bias=bias).to(dtype)
        attn.k_proj = nn.Linear(h, kv * hd, bias=bias).to(dtype)
        attn.v_proj = nn.Linear(h, kv * hd, bias=bias).to(dtype)
        attn.o_proj = nn.Linear(q * hd, h, bias=False).to(dtype)


def _shard_layer(layer: Any, comm: Any, rank: int, tp: int, d: ModelDims) -> None:
    """Keep this rank's heads' norms: q heads ``[r·h/tp, (r+1)·h/tp)``; kv likewise, or head
    ``r // (tp / kv)`` when ``tp > kv`` (replicated kv heads)."""
    attn = layer.self_attn
    if not getattr(attn, "qk_layernorm", False) or tp == 1:
        return
    q_local = d.num_heads // tp
    if tp <= d.num_kv_heads:
        kv_local, kv_first = d.num_kv_heads // tp, rank * (d.num_kv_heads // tp)
    else:
        kv_local, kv_first = 1, rank // (tp // d.num_kv_heads)
    for which, first, count in (("q", rank * q_local, q_local), ("k", kv_first, kv_local)):
        norm = getattr(attn, f"{which}_layernorm")
        norm.norms = type(norm.norms)(list(norm.norms)[first : first + count])
        norm.num_heads = count


_FAMILY = decoder_family(
    "stablelm",
    layer=_layer,
    rules=RULES,
    follows="vLLM stablelm.py (StablelmForCausalLM)",
    shape_keys=(*DECODER_SHAPES, "use_qkv_bias", "qk_layernorm", "use_parallel_residual"),
    config_keys=(*DECODER_OTHER, "layer_norm_eps", "hidden_dropout"),
)
FAMILY = dataclasses.replace(
    _FAMILY,
    tensors=_tensors,
    memory=_memory,
    forward=dataclasses.replace(
        decoder_forward(localize=_localize), local_config=_local_config, shard_layer=_shard_layer
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import STABLELM, declare  # noqa: E402

FAMILY = declare(FAMILY, STABLELM)
