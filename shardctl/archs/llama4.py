"""Llama-4 multimodal (``llama4``, ``Llama4ForConditionalGeneration``): the published
Llama-4-Scout / Maverick repositories. Its ``text_config`` is a :mod:`llama4_text` model under
``language_model.``; beside it a ViT vision tower and a one-matrix projector. On disk, as
transformers 5.23 ``save_pretrained`` writes it (the published names)::

    language_model.model.*  language_model.lm_head.weight   llama4_text's tensors, prefixed
    vision_model.patch_embedding.linear.weight   [Hv, C·p·p]   colwise (vLLM: gather_output)
    vision_model.class_embedding                 [Hv]          replicated
    vision_model.positional_embedding_vlm        [(S/p)²+1, Hv] replicated
    vision_model.layernorm_pre / _post .weight/.bias [Hv]       replicated
    vision_model.model.layers.{i}.self_attn.{q,k,v}_proj .weight [Hv, Hv] / .bias  colwise
    vision_model.model.layers.{i}.self_attn.o_proj.weight [Hv, Hv] rowwise, .bias replicated
    vision_model.model.layers.{i}.mlp.fc1 .weight [Iv, Hv] / .bias   colwise
    vision_model.model.layers.{i}.mlp.fc2.weight [Hv, Iv] rowwise, .bias replicated
    vision_model.model.layers.{i}.{input,post_attention}_layernorm .weight/.bias  replicated
    vision_model.vision_adapter.mlp.fc1.weight   [Pin, Iv]     colwise
    vision_model.vision_adapter.mlp.fc2.weight   [Pout, Pout]  rowwise
    multi_modal_projector.linear_1.weight        [H, Vout]     colwise (vLLM: gather_output)

(``Hv`` / ``Iv`` the vision ``hidden_size`` / ``intermediate_size``, ``p`` ``patch_size``, ``S``
``image_size``, ``Pin`` / ``Pout`` ``projector_input_dim`` / ``projector_output_dim``, ``Vout``
``vision_output_dim``, ``H`` the text hidden size; transformers builds the adapter and the
projector without biases whatever ``multi_modal_projector_bias`` says.)

Placement follows vLLM ``mllama4.py`` in its default (tensor-parallel) encoder mode: q/k/v
``QKVParallelLinear`` (a plain even split of ``Hv`` rows is whole vision heads when tp divides
their count), o_proj / fc2 ``RowParallelLinear`` (bias added once: whole on every rank),
fc1 / patch embedding / projector ``ColumnParallelLinear``. The vision tower and the projector
make the image embeddings merged into the first stage's input embeddings, so every vision and
projector tensor sits on the first pipeline stage (their ``layers.{i}`` are not decoder layers).
The forward level of ``verify`` runs the text model (``AutoModelForCausalLM`` builds
``Llama4ForCausalLM`` from this config, as transformers does for token input): the ranks' text
shards under their in-memory names (``language_model.`` dropped), logits compared with the
unsharded model's. The vision tower and projector take no part in a token-only forward: that
level does not read them (``recomputed`` below); the structure and bitwise levels check them.
"""

from __future__ import annotations

from typing import Any

from shardctl.archs import llama4_text
from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Family, ForwardSpec, Shapes, get_int
from shardctl.archs._keys import COMMON
from shardctl.archs._multimodal import (
    section,
    text_forward,
    text_memory,
    text_rules,
    text_tensors,
)
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

V = "vision_model"
_VL = f"{V}.model.layers.*"

VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first")
    for match, tp in (
        (f"{_VL}.self_attn.[qkv]_proj.*", "colwise"),
        (f"{_VL}.self_attn.o_proj.weight", "rowwise"),
        (f"{_VL}.self_attn.o_proj.bias", R),
        (f"{_VL}.mlp.fc1.*", "colwise"),
        (f"{_VL}.mlp.fc2.weight", "rowwise"),
        (f"{_VL}.mlp.fc2.bias", R),
        (f"{_VL}.*layernorm.*", R),
        (f"{V}.patch_embedding.linear.weight", "colwise"),
        (f"{V}.vision_adapter.mlp.fc1.weight", "colwise"),
        (f"{V}.vision_adapter.mlp.fc2.weight", "rowwise"),
        (f"{V}.*", R),  # class / positional embeddings, layernorm_pre / _post
        ("multi_modal_projector.linear_1.weight", "colwise"),
    )
)

RULES: tuple[RuleSpec, ...] = text_rules(llama4_text.FAMILY) + VISION_RULES

# transformers 5.23 Llama4VisionConfig defaults for the keys a config may leave out
VISION_DEFAULTS: Config = {
    "hidden_size": 768,
    "num_hidden_layers": 34,
    "num_attention_heads": 16,
    "num_channels": 3,
    "intermediate_size": 5632,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "projector_input_dim": 4096,
    "projector_output_dim": 4096,
}


def _sub(config: Config, key: str, where: str) -> dict[str, Any]:
    return section(config, key, where, "Llama-4", required=True)


def text_config(config: Config, where: str = "config") -> Config:
    """The ``text_config`` as a ``llama4_text`` config."""
    return {**_sub(config, "text_config", f"{where}: text_config"), "model_type": "llama4_text"}


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return llama4_text.FAMILY.dims(text_config(config, where), tied, f"{where}: text_config")


def _vision(config: Config, text_hidden: int, where: str) -> Shapes:
    v = {**VISION_DEFAULTS, **_sub(config, "vision_config", f"{where}: vision_config")}
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    patch, image = get_int(v, "patch_size", w), get_int(v, "image_size", w)
    channels = get_int(v, "num_channels", w)
    out: Shapes = [
        (f"{V}.patch_embedding.linear.weight", (h, channels * patch * patch)),
        (f"{V}.class_embedding", (h,)),
        (f"{V}.positional_embedding_vlm", ((image // patch) ** 2 + 1, h)),
    ]
    out += [(f"{V}.layernorm_{s}.{k}", (h,)) for s in ("pre", "post") for k in ("weight", "bias")]
    for n in range(get_int(v, "num_hidden_layers", w)):
        p = f"{V}.model.layers.{n}"
        for proj in ("q", "k", "v", "o"):
            out += [(f"{p}.self_attn.{proj}_proj.weight", (h, h))]
            out += [(f"{p}.self_attn.{proj}_proj.bias", (h,))]
        out += [
            (f"{p}.mlp.fc1.weight", (i, h)),
            (f"{p}.mlp.fc1.bias", (i,)),
            (f"{p}.mlp.fc2.weight", (h, i)),
            (f"{p}.mlp.fc2.bias", (h,)),
        ]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out += [(f"{p}.{norm}.weight", (h,)), (f"{p}.{norm}.bias", (h,))]
    pin, pout = get_int(v, "projector_input_dim", w), get_int(v, "projector_output_dim", w)
    out += [
        (f"{V}.vision_adapter.mlp.fc1.weight", (pin, i)),
        (f"{V}.vision_adapter.mlp.fc2.weight", (pout, pout)),
        (
            "multi_modal_projector.linear_1.weight",
            (text_hidden, get_int(v, "vision_output_dim", w)),
        ),
    ]
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    return text_tensors(llama4_text.FAMILY, text_config, config, d, where) + _vision(
        config, d.hidden_size, where
    )


def _forward() -> ForwardSpec:
    return text_forward(
        llama4_text.FAMILY, text_config, recomputed=(f"{V}.*", "multi_modal_projector.*")
    )


FAMILY = Family(
    name="llama4",
    model_types=("llama4",),
    tied_default=False,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=text_memory(llama4_text.FAMILY, text_config),
    forward=_forward(),
    follows="vLLM mllama4.py (Llama4ForConditionalGeneration; text: llama4.py)",
    shape_keys=("text_config", "vision_config", "tie_word_embeddings"),
    config_keys=(*COMMON, "boi_token_index", "eoi_token_index", "image_token_index"),
    text=text_config,
    towers=(f"{V}.*", "multi_modal_projector.*"),
    # the closed form's per-layer counts describe the text decoder only
    closed_form=False,
)
