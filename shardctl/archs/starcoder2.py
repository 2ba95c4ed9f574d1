"""StarCoder2: Llama-style attention (GQA, rotary), a plain GeLU MLP ``c_fc`` → ``c_proj``,
LayerNorm with bias, and biases on every linear (``use_bias``, default true).

On disk (``save_pretrained``, ``nn.Linear`` ``[out, in]`` — not GPT-2's Conv1D)::

    self_attn.{q,k,v,o}_proj.weight/.bias       mlp.c_fc.weight [I, H] / .bias [I]
    mlp.c_proj.weight [H, I] / .bias [H]        input_layernorm / post_attention_layernorm /
                                                model.norm: weight and bias [H]

Placement follows vLLM ``starcoder2.py`` (``QKVParallelLinear`` with bias, ``c_fc``
``ColumnParallelLinear``, ``c_proj`` and ``o_proj`` ``RowParallelLinear``: bias added once
after the all-reduce). ``tie_word_embeddings`` defaults to true in transformers' config.
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
    decoder_forward,
    norms,
)
from shardctl.archs._family import Config, MemoryFlags, Shapes, get_bool
from shardctl.archs._keys import DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    *ATTENTION_RULES,
    RuleSpec("model.layers.*.mlp.c_fc.*", tp="colwise"),
    RuleSpec("model.layers.*.mlp.c_proj.*", tp="rowwise"),
    *NORM_RULES,
)


def _bias(config: Config, where: str) -> bool:
    return get_bool(config, "use_bias", where, True)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return dataclasses.replace(decoder_dims(config, tied, where), gated_mlp=False)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i, bias = d.hidden_size, d.intermediate_size, _bias(config, where)
    out = attention(p, d, qkv_bias=bias, o_bias=bias)
    out += [(f"{p}.mlp.c_fc.weight", (i, h)), (f"{p}.mlp.c_proj.weight", (h, i))]
    if bias:
        out += [(f"{p}.mlp.c_fc.bias", (i,)), (f"{p}.mlp.c_proj.bias", (h,))]
    names = ("input_layernorm", "post_attention_layernorm")
    return out + norms(p, d, names) + [(f"{p}.{n}.bias", (h,)) for n in names]


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    base = _FAMILY.tensors(config, d, where)
    return [*base, ("model.norm.bias", (d.hidden_size,))]


def _memory(config: Config) -> MemoryFlags:
    bias = _bias(config, "config")
    return MemoryFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias, norm_bias=True)


_FAMILY = decoder_family(
    "starcoder2",
    tied_default=True,
    layer=_layer,
    rules=RULES,
    follows="vLLM starcoder2.py (Starcoder2ForCausalLM)",
    quantizable=("model.layers.*_proj.weight", "model.layers.*.mlp.c_fc.weight"),
    sliding_layers="all",  # HF Starcoder2Attention: sliding_window on every layer when set
    shape_keys=(*DECODER_SHAPES, "use_bias"),
    config_keys=(
        *DECODER_OTHER,
        *SLIDING,
        "norm_epsilon",
        "residual_dropout",
        "embedding_dropout",
    ),
)
FAMILY = dataclasses.replace(
    _FAMILY,
    dims=_dims,
    tensors=_tensors,
    memory=_memory,
    forward=decoder_forward(row_parallel=("self_attn.o_proj", "mlp.c_proj")),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import TRANSFORMERS_BACKEND, declare  # noqa: E402

FAMILY = declare(FAMILY, TRANSFORMERS_BACKEND)
