"""OLMo-2: Llama's projections, norms *after* attention and MLP, and a q/k RMSNorm over the
whole projection (not per head).

On disk (``save_pretrained``)::

    self_attn.q_norm.weight  [heads·head_dim]      (Qwen3's is per head: [head_dim])
    self_attn.k_norm.weight  [kv_heads·head_dim]
    post_attention_layernorm / post_feedforward_layernorm  [H]   (no input_layernorm)

Placement follows vLLM ``olmo2.py`` (``Olmo2Attention``): q/k/v/o and the MLP as Llama; the q/k
norms are *replicated* whole — vLLM all-gathers q and k over tp, normalizes the full vector and
keeps its own slice. The forward level computes the same thing without the gather: each rank
sums the squares of its slice, one all-reduce over tp gives the full sum, and the rank scales by
its slice of the (replicated) norm weight. With ``tp > kv_heads`` each kv head sits on
``tp / kv`` ranks, so the all-reduced sum counts every head ``tp / kv`` times and the mean divides
by ``tp · local`` elements: the same mean either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._decoder import attention, decoder_family, decoder_forward, gated_mlp, norms
from shardctl.archs._family import Config, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES
from shardctl.model.types import ModelDims


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Build q/k norms at their global width, so the replicated weights load whole."""
    for layer in model.model.layers:
        attn = layer.self_attn
        norm_cls = type(attn.q_norm)
        eps = attn.q_norm.variance_epsilon
        attn.q_norm = norm_cls(d.num_heads * d.head_dim, eps=eps).to(dtype)
        attn.k_norm = norm_cls(d.num_kv_heads * d.head_dim, eps=eps).to(dtype)


def _shard_layer(layer: Any, comm: Any, rank: int, tp: int, d: ModelDims) -> None:
    """q/k norms over the whole projection, computed from this rank's heads (module doc)."""
    from shardctl.archs._tp_norm import TPRMSNorm

    if tp == 1:
        return
    attn = layer.self_attn
    eps = float(attn.q_norm.variance_epsilon)
    q_local = d.num_heads // tp
    if tp <= d.num_kv_heads:
        kv_local, kv_first = d.num_kv_heads // tp, rank * (d.num_kv_heads // tp)
    else:  # one replicated kv head per rank: head rank // (tp / kv)
        kv_local, kv_first = 1, rank // (tp // d.num_kv_heads)
    hd = d.head_dim
    attn.q_norm = TPRMSNorm(
        attn.q_norm, comm, tp=tp, start=rank * q_local * hd, size=q_local * hd, eps=eps
    )
    attn.k_norm = TPRMSNorm(
        attn.k_norm, comm, tp=tp, start=kv_first * hd, size=kv_local * hd, eps=eps
    )


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    bias = get_bool(config, "attention_bias", where, False)
    return [
        *attention(p, d, qkv_bias=bias, o_bias=bias),
        (f"{p}.self_attn.q_norm.weight", (d.num_heads * d.head_dim,)),
        (f"{p}.self_attn.k_norm.weight", (d.num_kv_heads * d.head_dim,)),
        *gated_mlp(p, d, bias=False),
        *norms(p, d, ("post_attention_layernorm", "post_feedforward_layernorm")),
    ]


_FAMILY = decoder_family(
    "olmo2",
    qkv_bias=None,
    o_bias=None,
    layer=_layer,
    follows="vLLM olmo2.py (Olmo2ForCausalLM)",
    shape_keys=(*DECODER_SHAPES, "attention_bias"),
    config_keys=DECODER_OTHER,
)
FAMILY = dataclasses.replace(
    _FAMILY,
    forward=dataclasses.replace(decoder_forward(localize=_localize), shard_layer=_shard_layer),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import TRANSFORMERS_BACKEND, declare  # noqa: E402

FAMILY = declare(FAMILY, TRANSFORMERS_BACKEND)
