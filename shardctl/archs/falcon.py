"""Falcon: fused ``query_key_value`` grouped per KV head, in all three of its layouts.

On disk (transformers 5.23 ``save_pretrained``; ``bias`` adds a bias to every linear)::

    transformer.word_embeddings.weight [V, H]     transformer.ln_f: weight, bias [H]
    transformer.h.{i}.self_attention.query_key_value.weight [(heads + 2·kv)·d, H]
    transformer.h.{i}.self_attention.dense.weight [H, H]
    transformer.h.{i}.mlp.dense_h_to_4h.weight [F, H];  mlp.dense_4h_to_h.weight [H, F]
    norms (LayerNorm, weight + bias): ln_attn + ln_mlp (new decoder architecture, 2 norms),
        input_layernorm (parallel_attn, 1 norm), or input_layernorm + post_attention_layernorm
    lm_head.weight [V, H] only when untied (tied by default)

``query_key_value`` is one group per KV head of ``[its heads / kv q heads; k; v]`` rows:

- new decoder architecture (Falcon-40B/180B): ``kv = num_kv_heads`` groups;
- ``multi_query`` (Falcon-7B): MQA, ``kv = 1``: one group ``[all q; k; v]``;
- neither (classic MHA): ``kv = heads``: one group per head ``[q; k; v]``, like GPT-NeoX.

So one rule (``parts=[q, kv, kv]``, ``groups="kv"``) places all three: ``tp <= kv`` gives each
rank whole groups; ``tp > kv`` splits a group's q heads and replicates its k/v head on the
``tp / kv`` ranks that share it (vLLM's ``num_kv_head_replicas``; for MQA every rank holds the
one k/v head). Placement follows vLLM ``falcon.py`` (``query_key_value`` as a
``QKVParallelLinear`` with the per-group regrouping of its weight loader, ``dense`` and
``dense_4h_to_h`` row-parallel, ``dense_h_to_4h`` column-parallel, vocab-parallel embedding and
head). ALiBi models (Falcon-RW) plan and reshard; the forward level runs them at tp = 1 only
(the ALiBi slopes belong to global head indices).
"""

from __future__ import annotations

from typing import Any

from shardctl.archs._decoder import R
from shardctl.archs._family import (
    Config,
    Family,
    ForwardSpec,
    MemoryFlags,
    Shapes,
    divide,
    get_bool,
    get_int,
    local_div,
)
from shardctl.archs._keys import COMMON, ROPE
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

_L = "transformer.h.*"
RULES: tuple[RuleSpec, ...] = (
    RuleSpec("transformer.word_embeddings.weight", tp="vocab", stage="embedding"),
    RuleSpec("transformer.ln_f.*", tp=R, stage="last"),
    RuleSpec("lm_head.weight", tp="vocab", stage="last"),
    RuleSpec(
        f"{_L}.self_attention.query_key_value.*",
        tp="colwise",
        parts=("q", "kv", "kv"),
        groups="kv",
    ),
    RuleSpec(f"{_L}.self_attention.dense.*", tp="rowwise", heads="q"),
    RuleSpec(f"{_L}.mlp.dense_h_to_4h.*", tp="colwise"),
    RuleSpec(f"{_L}.mlp.dense_4h_to_h.*", tp="rowwise"),
    RuleSpec(f"{_L}.ln_*", tp=R),
    RuleSpec(f"{_L}.*layernorm.*", tp=R),
)


def _hidden(config: Config, where: str) -> int:
    if config.get("hidden_size") is None and config.get("n_embed") is not None:
        return get_int(config, "n_embed", where)  # the older spelling transformers still reads
    return get_int(config, "hidden_size", where)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    hidden = _hidden(config, where)
    heads = get_int(config, "num_attention_heads", where)
    if get_bool(config, "new_decoder_architecture", where, False):
        kv = get_int(config, "num_kv_heads", where, default=heads)
    elif get_bool(config, "multi_query", where, True):
        kv = 1
    else:
        kv = heads
    return ModelDims(
        hidden_size=hidden,
        num_layers=get_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=divide(hidden, heads, "hidden_size / num_attention_heads", where),
        intermediate_size=get_int(config, "ffn_hidden_size", where, default=4 * hidden),
        vocab_size=get_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        max_position_embeddings=get_int(config, "max_position_embeddings", where, default=0),
        gated_mlp=False,
    )


def _norms(config: Config, where: str) -> tuple[str, ...]:
    """Which LayerNorms a layer has (FalconDecoderLayer.__init__)."""
    if not get_bool(config, "parallel_attn", where, True):
        return ("input_layernorm", "post_attention_layernorm")
    count = config.get("num_ln_in_parallel_attn")
    if count is None and get_bool(config, "new_decoder_architecture", where, False):
        count = 2
    return ("ln_attn", "ln_mlp") if count == 2 else ("input_layernorm",)


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    h, f, v = d.hidden_size, d.intermediate_size, d.vocab_size
    qkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
    bias = get_bool(config, "bias", where, False)
    out: Shapes = [
        ("transformer.word_embeddings.weight", (v, h)),
        ("transformer.ln_f.weight", (h,)),
        ("transformer.ln_f.bias", (h,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (v, h)))
    norms = _norms(config, where)
    for n in range(d.num_layers):
        p = f"transformer.h.{n}"
        for name, rows, cols in (
            ("self_attention.query_key_value", qkv, h),
            ("self_attention.dense", h, h),
            ("mlp.dense_h_to_4h", f, h),
            ("mlp.dense_4h_to_h", h, f),
        ):
            out.append((f"{p}.{name}.weight", (rows, cols)))
            if bias:
                out.append((f"{p}.{name}.bias", (rows,)))
        for norm in norms:
            out += [(f"{p}.{norm}.weight", (h,)), (f"{p}.{norm}.bias", (h,))]
    return out


def _memory(config: Config) -> MemoryFlags:
    bias = get_bool(config, "bias", "config", False)
    return MemoryFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias, norm_bias=True)


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    # Global heads stay in the config (head_dim and the rotary dims derive from them);
    # _localize sets each attention's local head counts and projections.
    local_div("num_attention_heads", d.num_heads, tp)
    if tp > 1 and get_bool(cfg, "alibi", "config", False):
        raise InvalidInputError(
            f"forward level does not run an ALiBi Falcon at tp={tp} (its slopes are per "
            "global head)",
            hint="check this layout with --level bitwise; the forward level runs ALiBi at tp=1",
        )
    return {
        "ffn_hidden_size": local_div("ffn_hidden_size", d.intermediate_size, tp),
        "num_hidden_layers": num_layers,
    }


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    from transformers.models.falcon.modeling_falcon import FalconLinear

    heads = d.num_heads // tp
    kv = max(1, d.num_kv_heads // tp)
    h = d.hidden_size
    bias = bool(getattr(config, "bias", False))
    for layer in model.transformer.h:
        attn = layer.self_attention
        attn.num_heads = heads
        attn.num_kv_heads = kv  # MQA: 1 on every rank (replicated)
        attn.query_key_value = FalconLinear(h, (heads + 2 * kv) * d.head_dim, bias=bias).to(dtype)
        attn.dense = FalconLinear(h // tp, h, bias=bias).to(dtype)


FAMILY = Family(
    name="falcon",
    model_types=("falcon",),
    tied_default=True,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=_memory,
    forward=ForwardSpec(
        layer_prefix="transformer.h",
        embeddings=("transformer.word_embeddings",),
        final_norm="transformer.ln_f",
        lm_head="lm_head",
        row_parallel=("self_attention.dense", "mlp.dense_4h_to_h"),
        local_config=_local_config,
        localize=_localize,
    ),
    follows="vLLM falcon.py (FalconForCausalLM)",
    shape_keys=(
        "hidden_size",
        "n_embed",
        "num_hidden_layers",
        "num_attention_heads",
        "num_kv_heads",
        "new_decoder_architecture",
        "multi_query",
        "parallel_attn",
        "num_ln_in_parallel_attn",
        "bias",
        "ffn_hidden_size",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ),
    config_keys=(
        *COMMON,
        *ROPE,
        "alibi",
        "activation",
        "layer_norm_epsilon",
        "hidden_dropout",
        "attention_dropout",
    ),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import FALCON, declare  # noqa: E402

FAMILY = declare(FAMILY, FALCON)
