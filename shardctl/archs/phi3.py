"""Phi-3: fused ``qkv_proj`` = ``[Q; K; V]`` and ``gate_up_proj`` = ``[gate; up]`` (dim 0).

On disk::

    self_attn.qkv_proj.weight   [(heads + 2·kv_heads)·head_dim, H]
    mlp.gate_up_proj.weight     [2·I, H]

A plain chunk of a fused tensor is wrong: each part is split on its own and each rank's pieces
concatenated (``parts``). Placement follows vLLM ``phi3.py`` (``QKVParallelLinear``,
``MergedColumnParallelLinear``).
"""

from __future__ import annotations

from shardctl.archs._decoder import END_RULES, LAYER_NORMS, NORM_RULES, decoder_family, norms
from shardctl.archs._family import Config, Shapes
from shardctl.archs._keys import DECODER_OTHER, SLIDING
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

RULES: tuple[RuleSpec, ...] = (
    *END_RULES,
    RuleSpec("model.layers.*.self_attn.qkv_proj.*", tp="colwise", parts=("q", "kv", "kv")),
    RuleSpec("model.layers.*.self_attn.o_proj.*", tp="rowwise", heads="q"),
    RuleSpec(
        "model.layers.*.mlp.gate_up_proj.*", tp="colwise", parts=("intermediate", "intermediate")
    ),
    RuleSpec("model.layers.*.mlp.down_proj.*", tp="rowwise"),
    *NORM_RULES,
)


def _layer(p: str, d: ModelDims, config: Config, where: str) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    return [
        (f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
        (f"{p}.mlp.gate_up_proj.weight", (2 * i, h)),
        (f"{p}.mlp.down_proj.weight", (h, i)),
        *norms(p, d, LAYER_NORMS),
    ]


FAMILY = decoder_family(
    "phi3",
    qkv_bias=False,
    o_bias=False,
    layer=_layer,
    rules=RULES,
    follows="vLLM phi3.py",
    config_keys=(
        *DECODER_OTHER,
        *SLIDING,
        "embd_pdrop",
        "resid_pdrop",
        "original_max_position_embeddings",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DECODER, declare  # noqa: E402

FAMILY = declare(FAMILY, DECODER)
