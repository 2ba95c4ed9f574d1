"""Mistral-3 multimodal (``mistral3``, ``Mistral3ForConditionalGeneration``): the published
Mistral-Small-3.1 / 3.2 ``-2503`` / ``-2506`` repositories in Hugging Face format and their
quantized releases. Its ``text_config`` is a :mod:`mistral` model under ``language_model.``;
beside it a Pixtral vision tower and a projector that merges 2 × 2 patches and maps them to the
text width. On disk (transformers 5.24 ``save_pretrained`` and the published files alike)::

    language_model.model.*  language_model.lm_head.weight   mistral's tensors, prefixed
    vision_tower.patch_conv.weight                [Hv, C, p, p]  replicated
    vision_tower.ln_pre.weight                    [Hv]           replicated
    vision_tower.transformer.layers.{i}.attention.{q,k,v}_proj.weight [Hv, Hv]   colwise
    vision_tower.transformer.layers.{i}.attention.o_proj.weight       [Hv, Hv]   rowwise
    vision_tower.transformer.layers.{i}.feed_forward.{gate,up}_proj.weight [Iv, Hv] colwise
    vision_tower.transformer.layers.{i}.feed_forward.down_proj.weight [Hv, Iv]   rowwise
    vision_tower.transformer.layers.{i}.{attention,ffn}_norm.weight   [Hv]       replicated
    multi_modal_projector.norm.weight             [Hv]           replicated
    multi_modal_projector.patch_merger.merging_layer.weight [Hv, Hv·m²]   replicated
    multi_modal_projector.linear_1.weight         [H, Hv·f]      colwise (.bias colwise)
    multi_modal_projector.linear_2.weight         [H, H]         rowwise (.bias replicated)

(``Hv`` / ``Iv`` the vision ``hidden_size`` / ``intermediate_size``, ``p`` ``patch_size``, ``C``
``num_channels``, ``m`` ``spatial_merge_size``, ``f`` the number of ``vision_feature_layer``\\ s,
``H`` the text hidden size; the projector's biases exist with ``multimodal_projector_bias``.)

Placement follows vLLM ``mistral3.py`` / ``pixtral.py`` (``PixtralHFVisionModel``) in the
default tensor-parallel encoder mode: q/k/v ``QKVParallelLinear`` (a plain even split of ``Hv``
rows is whole vision heads when tp divides their count), o_proj / down_proj
``RowParallelLinear``, gate/up ``MergedColumnParallelLinear``, the projector's linear_1
``ColumnParallelLinear`` and linear_2 ``RowParallelLinear`` (bias added once: whole); the patch
convolution, the RMS norms and the patch merger (``nn.Linear``) whole. The tower and projector
make the image embeddings merged into the first stage's input embeddings, so they sit on the
first pipeline stage.

Tied embeddings: the top level's ``tie_word_embeddings`` when the config gives one (what
transformers 5 ties by: a new Mistral3Config writes ``true`` there beside the section's
``false``, and saves no ``language_model.lm_head.weight``), else the section's, else
MistralConfig's ``False`` — the published configs name neither and ship their own head, which
is what vLLM builds (``MistralForCausalLM`` from ``text_config``).

The forward level of ``verify`` runs the text model (``mistral`` built from ``text_config``),
compared with Mistral3ForConditionalGeneration's logits on token input; the tower and
projector take no part in it (``recomputed``), the structure and bitwise levels check them.
"""

from __future__ import annotations

from typing import Any

from shardctl.archs import mistral
from shardctl.archs._decoder import R
from shardctl.archs._family import (
    Config,
    Family,
    ForwardSpec,
    Shapes,
    get_bool,
    get_int,
)
from shardctl.archs._keys import COMMON
from shardctl.archs._multimodal import (
    TEXT,
    TEXT_DEFAULTS,
    feature_layers,
    section,
    text_dims,
    text_forward,
    text_memory,
    text_rules,
    text_tensors,
)
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

TEXT_TYPE = "mistral"
V = "vision_tower"
_VL = f"{V}.transformer.layers.*"
P = "multi_modal_projector"

VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first")
    for match, tp in (
        (f"{_VL}.attention.[qkv]_proj.weight", "colwise"),
        (f"{_VL}.attention.o_proj.weight", "rowwise"),
        (f"{_VL}.feed_forward.gate_proj.weight", "colwise"),
        (f"{_VL}.feed_forward.up_proj.weight", "colwise"),
        (f"{_VL}.feed_forward.down_proj.weight", "rowwise"),
        (f"{V}.*", R),  # patch convolution, ln_pre, the layers' RMS norms
        (f"{P}.linear_1.*", "colwise"),
        (f"{P}.linear_2.weight", "rowwise"),
        (f"{P}.*", R),  # norm, patch_merger.merging_layer, linear_2's bias
    )
)

RULES: tuple[RuleSpec, ...] = text_rules(mistral.FAMILY) + VISION_RULES

# transformers 5.24 Mistral3Config: the text_config it builds when a config has none (the
# Mistral-Small-3.1-24B shapes); a given section gets MistralConfig's defaults
# (_multimodal.TEXT_DEFAULTS["mistral"]) for the keys it leaves out
TEXT_ABSENT: Config = {
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "max_position_embeddings": 131_072,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rope_theta": 1_000_000_000.0,
    "sliding_window": None,
    "vocab_size": 131_072,
}
# Mistral3Config's vision_config when absent, and PixtralVisionConfig's defaults
VISION_ABSENT: Config = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 1540,
}
VISION_DEFAULTS: Config = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 1024,
    "patch_size": 16,
}
# Mistral3Config's own defaults
SPATIAL_MERGE = 2


def _sub(config: Config, key: str, where: str) -> dict[str, Any] | None:
    """The section, or None when the config has none (Mistral3Config then builds its own)."""
    if config.get(key) is None:
        return None
    return section(config, key, where, "Mistral-3", required=True)


def text_config(config: Config, where: str = "config") -> Config:
    """The ``text_config`` as a ``mistral`` config, transformers' defaults filled in;
    ``tie_word_embeddings`` as vLLM's text model reads it (module docstring)."""
    given = _sub(config, "text_config", f"{where}: text_config")
    text = {**TEXT_DEFAULTS[TEXT_TYPE], **(TEXT_ABSENT if given is None else given)}
    if config.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    text["model_type"] = TEXT_TYPE
    return text


def _vision(config: Config, where: str) -> dict[str, Any]:
    given = _sub(config, "vision_config", f"{where}: vision_config")
    return {**VISION_DEFAULTS, **(VISION_ABSENT if given is None else given)}


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's and the projector's tensors, under the names save_pretrained writes."""
    v = _vision(config, where)
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    patch = get_int(v, "patch_size", w)
    merge = get_int(config, "spatial_merge_size", where, default=SPATIAL_MERGE)
    out: Shapes = [
        (f"{V}.patch_conv.weight", (h, get_int(v, "num_channels", w), patch, patch)),
        (f"{V}.ln_pre.weight", (h,)),
    ]
    for n in range(get_int(v, "num_hidden_layers", w)):
        p = f"{V}.transformer.layers.{n}"
        out += [(f"{p}.attention.{x}_proj.weight", (h, h)) for x in ("q", "k", "v", "o")]
        out += [
            (f"{p}.feed_forward.gate_proj.weight", (i, h)),
            (f"{p}.feed_forward.up_proj.weight", (i, h)),
            (f"{p}.feed_forward.down_proj.weight", (h, i)),
            (f"{p}.attention_norm.weight", (h,)),
            (f"{p}.ffn_norm.weight", (h,)),
        ]
    out += [
        (f"{P}.norm.weight", (h,)),
        (f"{P}.patch_merger.merging_layer.weight", (h, h * merge * merge)),
        (f"{P}.linear_1.weight", (text_hidden, h * feature_layers(config, where, default=-1))),
        (f"{P}.linear_2.weight", (text_hidden, text_hidden)),
    ]
    if get_bool(config, "multimodal_projector_bias", where, False):
        out += [(f"{P}.linear_1.bias", (text_hidden,)), (f"{P}.linear_2.bias", (text_hidden,))]
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    return text_tensors(mistral.FAMILY, text_config, config, d, where) + vision_shapes(
        config, d.hidden_size, where
    )


def _image_tokens(config: Config) -> int:
    """Embeddings of the largest image, as vLLM's profile counts them
    (``PixtralHFEncoderInfo.get_num_image_tokens`` at ``image_size`` square): one per
    ``patch_size × spatial_merge_size`` cell, (1540 // 28)² = 3,025 for Mistral-Small-3.1."""
    v = _vision(config, "config")
    patch = get_int(v, "patch_size", "config: vision_config")
    merge = get_int(config, "spatial_merge_size", "config", default=SPATIAL_MERGE)
    cells = get_int(v, "image_size", "config: vision_config") // (patch * merge)
    return cells * cells


def _forward() -> ForwardSpec:
    return text_forward(
        mistral.FAMILY,
        text_config,
        recomputed=(f"{V}.*", f"{P}.*"),
        # the reference: Mistral3ForConditionalGeneration, which transformers maps from
        # AutoModelForImageTextToText only
        reference_layers="model.language_model.layers",
        reference_auto="AutoModelForImageTextToText",
    )


FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    tied_default=False,
    dims=text_dims(mistral.FAMILY, text_config),
    tensors=_tensors,
    rules=RULES,
    memory=text_memory(mistral.FAMILY, text_config),
    forward=_forward(),
    follows="vLLM mistral3.py (Mistral3ForConditionalGeneration; tower: pixtral.py)",
    shape_keys=(
        "text_config",
        "vision_config",
        "tie_word_embeddings",
        "spatial_merge_size",
        "vision_feature_layer",
        "multimodal_projector_bias",
    ),
    config_keys=(*COMMON, "image_token_index", "projector_hidden_act"),
    text=text_config,
    towers=(f"{V}.*", f"{P}.*"),
    modalities=("image",),  # vLLM builds the tower under _mark_tower_model(..., "image")
    image_tokens=_image_tokens,
    # compressed-tensors releases quantize the text model's linears; the tower, projector and
    # head stay 16-bit (their recipes' ignore lists)
    quantizable=tuple(TEXT + g for g in mistral.FAMILY.quantizable),
    # the closed form's per-layer counts describe the text decoder only
    closed_form=False,
)
