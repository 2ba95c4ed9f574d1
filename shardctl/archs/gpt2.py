"""GPT-2: ``Conv1D`` linears store weights ``[in, out]``, so colwise/rowwise dims are swapped.

On disk (``save_pretrained``; old hub files drop the ``transformer.`` prefix)::

    transformer.wte.weight [V, H]   transformer.wpe.weight [n_positions, H]
    transformer.h.{i}.attn.c_attn.weight  [H, 3H] = [Q | K | V] along dim 1 (fused parts)
    transformer.h.{i}.attn.c_proj.weight  [H, H]     mlp.c_fc.weight [H, n_inner]
    transformer.h.{i}.mlp.c_proj.weight   [n_inner, H]
    ln_1 / ln_2 / ln_f: LayerNorm weight and bias; every linear has a bias

The ``attn.bias`` / ``attn.masked_bias`` buffers are not written by transformers 5 (old files
carry them: replicated). Placement follows vLLM ``gpt2.py`` (``c_attn`` as
``QKVParallelLinear``, ``c_proj`` row-parallel) and Megatron-LM's GPT.
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
    get_int,
    local_div,
)
from shardctl.archs._keys import COMMON
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

# The leading ``*`` takes both ``h.0...`` (old hub files) and ``transformer.h.0...``.
RULES: tuple[RuleSpec, ...] = (
    RuleSpec("*wte.weight", tp="vocab", stage="embedding"),
    RuleSpec("*wpe.weight", tp=R, stage="first"),
    RuleSpec("*h.*.attn.c_attn.*", tp="colwise", parts=("q", "kv", "kv")),
    RuleSpec("*h.*.attn.c_proj.*", tp="rowwise", heads="q"),
    RuleSpec("*h.*.mlp.c_fc.*", tp="colwise"),
    RuleSpec("*h.*.mlp.c_proj.*", tp="rowwise"),
    RuleSpec("*h.*.ln_[12].*", tp=R),
    RuleSpec("*h.*.attn.bias", tp=R),  # causal-mask buffer in old checkpoints
    RuleSpec("*h.*.attn.masked_bias", tp=R),
    RuleSpec("*ln_f.*", tp=R, stage="last"),
    RuleSpec("lm_head.weight", tp="vocab", stage="last"),
)


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    hidden = get_int(config, "n_embd", where)
    heads = get_int(config, "n_head", where)
    return ModelDims(
        hidden_size=hidden,
        num_layers=get_int(config, "n_layer", where),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=divide(hidden, heads, "n_embd / n_head", where),
        intermediate_size=get_int(config, "n_inner", where, default=4 * hidden),
        vocab_size=get_int(config, "vocab_size", where),
        tie_word_embeddings=tied,
        max_position_embeddings=get_int(config, "n_positions", where),
        gated_mlp=False,
    )


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    h, i = d.hidden_size, d.intermediate_size
    out: Shapes = [
        ("transformer.wte.weight", (d.vocab_size, h)),
        ("transformer.wpe.weight", (d.max_position_embeddings, h)),
        ("transformer.ln_f.weight", (h,)),
        ("transformer.ln_f.bias", (h,)),
    ]
    if not d.tie_word_embeddings:
        out.append(("lm_head.weight", (d.vocab_size, h)))
    for n in range(d.num_layers):
        p = f"transformer.h.{n}"
        out += [
            (f"{p}.ln_1.weight", (h,)),
            (f"{p}.ln_1.bias", (h,)),
            (f"{p}.attn.c_attn.weight", (h, 3 * h)),
            (f"{p}.attn.c_attn.bias", (3 * h,)),
            (f"{p}.attn.c_proj.weight", (h, h)),
            (f"{p}.attn.c_proj.bias", (h,)),
            (f"{p}.ln_2.weight", (h,)),
            (f"{p}.ln_2.bias", (h,)),
            (f"{p}.mlp.c_fc.weight", (h, i)),
            (f"{p}.mlp.c_fc.bias", (i,)),
            (f"{p}.mlp.c_proj.weight", (i, h)),
            (f"{p}.mlp.c_proj.bias", (h,)),
        ]
    return out


def _memory(config: Config) -> MemoryFlags:
    return MemoryFlags(
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        norm_bias=True,
        positions=int(config.get("n_positions", 0)),
    )


def _local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    # Built with the global n_head (GPT-2 derives head_dim from it); _localize then swaps the
    # attention projections for local ones and sets num_heads / split_size.
    local = {"n_inner": local_div("n_inner", d.intermediate_size, tp), "n_layer": num_layers}
    local_div("n_head", d.num_heads, tp)
    return local


def _localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each attention at its local heads, with ``[in, out]`` Conv1D projections."""
    from transformers.pytorch_utils import Conv1D

    for block in model.transformer.h:
        attn = block.attn
        attn.num_heads = d.num_heads // tp
        attn.split_size = d.hidden_size // tp
        attn.c_attn = Conv1D(3 * d.hidden_size // tp, d.hidden_size).to(dtype)
        attn.c_proj = Conv1D(d.hidden_size, d.hidden_size // tp).to(dtype)


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    tied_default=True,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=_memory,
    forward=ForwardSpec(
        layer_prefix="transformer.h",
        embeddings=("transformer.wte", "transformer.wpe"),
        final_norm="transformer.ln_f",
        lm_head="lm_head",
        row_parallel=("attn.c_proj", "mlp.c_proj"),
        local_config=_local_config,
        conv1d=True,
        localize=_localize,
    ),
    conv1d=True,
    follows="vLLM gpt2.py / Megatron-LM GPT",
    shape_keys=(
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "n_positions",
        "vocab_size",
        "tie_word_embeddings",
    ),
    config_keys=(
        *COMMON,
        "n_ctx",  # older configs' copy of n_positions; shapes use n_positions
        "activation_function",
        "add_cross_attention",
        "attn_pdrop",
        "embd_pdrop",
        "resid_pdrop",
        "layer_norm_epsilon",
        "reorder_and_upcast_attn",
        "scale_attn_by_inverse_layer_idx",
        "scale_attn_weights",
        "summary_activation",
        "summary_first_dropout",
        "summary_proj_to_labels",
        "summary_type",
        "summary_use_proj",
        "task_specific_params",
    ),
)
