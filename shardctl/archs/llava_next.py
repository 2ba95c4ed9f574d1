"""LLaVA (``llava``, ``LlavaForConditionalGeneration``: LLaVA-1.5) and LLaVA-NeXT
(``llava_next``, ``LlavaNextForConditionalGeneration``: LLaVA-1.6 and IBM's granite-vision):
a Llama-like language model under ``language_model.`` beside a CLIP or SigLIP vision tower and a
two-layer projector. Its ``text_config`` names the language model's ``model_type``: one of
:data:`TEXT_FAMILIES` (Vicuna / Nous-Hermes-Yi are ``llama``; LLaVA-1.6-Mistral ``mistral``;
granite-vision ``granite``), whose rules, shapes, memory flags and forward it takes. On disk
(transformers 5.24 ``save_pretrained``; the published files name the tower
``vision_tower.vision_model.*``, which the rules place too)::

    language_model.model.*  language_model.lm_head.weight     the text family's tensors
    vision_tower.embeddings.patch_embedding.weight [Hv, C, p, p] (SigLIP: .bias)   replicated
    vision_tower.embeddings.position_embedding.weight [(S/p)² (+1 CLIP), Hv]      replicated
    vision_tower.embeddings.class_embedding [Hv] (CLIP)                           replicated
    vision_tower.pre_layrnorm / post_layernorm .weight/.bias [Hv]                 replicated
    vision_tower.encoder.layers.{i}.self_attn.{q,k,v}_proj .weight/.bias          colwise
    vision_tower.encoder.layers.{i}.self_attn.out_proj.weight   rowwise, .bias   replicated
    vision_tower.encoder.layers.{i}.mlp.fc1 .weight/.bias                         colwise
    vision_tower.encoder.layers.{i}.mlp.fc2.weight              rowwise, .bias   replicated
    vision_tower.encoder.layers.{i}.layer_norm{1,2} .weight/.bias                 replicated
    vision_tower.head.*  (SigLIP with vision_use_head: its pooling head, unused)  replicated
    multi_modal_projector.linear_1 .weight [H, Hv·f] / .bias [H]                  colwise
    multi_modal_projector.linear_2.weight [H, H]                rowwise, .bias   replicated
    image_newline [H]  (llava_next)                                               replicated

(``Hv`` the vision ``hidden_size``, ``p`` ``patch_size``, ``S`` ``image_size``, ``f`` the number
of ``vision_feature_layer``\\ s, ``H`` the text hidden size; the projector's biases exist with
``multimodal_projector_bias``, true by default.)

Placement follows vLLM ``llava.py`` / ``llava_next.py`` with ``clip.py`` / ``siglip.py``: q/k/v
``QKVParallelLinear``, out_proj / fc2 ``RowParallelLinear`` (bias added once: whole), fc1 and
the projector's linear_1 ``ColumnParallelLinear``, linear_2 ``RowParallelLinear``; norms, the
patch convolution, CLIP's class embedding and ``image_newline`` whole. CLIP's position table is
an ``nn.Embedding`` (whole); SigLIP's is a ``VocabParallelEmbedding`` in vLLM, kept whole here
too (729 × 1,152 for granite-vision: 1.6 MB per rank) so one rule places both towers. The tower
and projector make the image embeddings merged into the first stage's input embeddings, so
they sit on the first pipeline stage. vLLM builds the tower only up to the deepest
``vision_feature_layer``; the checkpoint holds every layer, and shardctl counts the checkpoint.

Image size for the profile (vLLM ``LlavaNextProcessingInfo.get_image_size_with_most_features``):
the ``image_grid_pinpoints`` entry with the most embeddings — the base tile's (``(S/p)²``, plus
CLIP's class token, less one with ``vision_feature_select_strategy: default``) plus the grid's
unpadded features and one newline per row; granite-vision-3.3's tallest pinpoint
3,840 × 384 gives 270 × 27 + 270 + 729 = 8,289, the budget its vLLM log reports. LLaVA-1.5: the
base tile's alone (576 for CLIP-L/336).

The forward level of ``verify`` runs the text model (built from ``text_config`` with its own
family's local sizes), compared with the LLaVA model's logits on token input; the tower and
projector take no part in it (``recomputed``), the structure and bitwise levels check them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs import granite, llama, mistral, qwen2
from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Family, ForwardSpec, Shapes, get_bool, get_int
from shardctl.archs._keys import COMMON
from shardctl.archs._multimodal import (
    TEXT,
    TEXT_DEFAULTS,
    feature_layers,
    section,
    siglip_head,
    text_dims,
    text_forward,
    text_rules,
    text_tensors,
    vit_layer_rules,
    vit_layers,
)
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

# The language models a LLaVA config may name; their rules are llama's (checked below), so one
# rule list places any of them under ``language_model.``.
TEXT_FAMILIES: dict[str, Family] = {
    "llama": llama.FAMILY,
    "mistral": mistral.FAMILY,
    "granite": granite.FAMILY,
    "qwen2": qwen2.FAMILY,
}
assert all(f.rules == llama.FAMILY.rules for f in TEXT_FAMILIES.values())
CLIP, SIGLIP = "clip_vision_model", "siglip_vision_model"
# CLIPVisionConfig's / SiglipVisionConfig's defaults, and the CLIP-L/336 tower LlavaConfig and
# LlavaNextConfig build when a config has no vision_config
VISION_DEFAULTS: dict[str, Config] = {
    CLIP: {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
    },
    SIGLIP: {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "vision_use_head": True,
    },
}
VISION_ABSENT: Config = {
    "model_type": CLIP,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
# LlavaNextConfig's image_grid_pinpoints when the config gives none
PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

V = "vision_tower"
# ``vision_tower.`` (transformers 5 save_pretrained) or ``vision_tower.vision_model.`` (hub)
_VL = f"{V}.*encoder.layers.*"
P = "multi_modal_projector"
NEWLINE = "image_newline"

VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first")
    for match, tp in (
        *vit_layer_rules(_VL),
        (f"{V}.*", R),  # embeddings, pre/post layer norms, SigLIP's unused pooling head
        (f"{P}.linear_1.*", "colwise"),
        (f"{P}.linear_2.weight", "rowwise"),
        (f"{P}.*", R),  # linear_2's bias
        (NEWLINE, R),
    )
)

RULES: tuple[RuleSpec, ...] = text_rules(llama.FAMILY) + VISION_RULES


def _text_type(given: Config, where: str) -> str:
    kind = given.get("model_type") or "llama"  # LlavaConfig builds a LlamaConfig by default
    if kind not in TEXT_FAMILIES:
        raise InvalidInputError(
            f"text_config model_type {kind!r}: shardctl places a LLaVA language model of type "
            f"{', '.join(TEXT_FAMILIES)}",
            where=where,
            hint="plan the language model alone as its own model_type, or place every tensor "
            "with manifest rules",
        )
    return str(kind)


def text_config(config: Config, where: str = "config") -> Config:
    """The ``text_config`` with its family's transformers defaults filled in;
    ``tie_word_embeddings`` as transformers 5 ties (the top level's when given, else the
    section's, else untied)."""
    w = f"{where}: text_config"
    given = section(config, "text_config", w, "LLaVA", required=False)
    kind = _text_type(given, w)
    text = {**TEXT_DEFAULTS[kind], **given}
    if config.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    text["model_type"] = kind
    return text


def _family(config: Config, where: str = "config") -> Family:
    return TEXT_FAMILIES[text_config(config, where)["model_type"]]


def _vision(config: Config, where: str) -> dict[str, Any]:
    w = f"{where}: vision_config"
    given = section(config, "vision_config", w, "LLaVA", required=False)
    if not given:
        return {**VISION_DEFAULTS[CLIP], **VISION_ABSENT}
    kind = given.get("model_type") or CLIP
    if kind not in VISION_DEFAULTS:
        raise InvalidInputError(
            f"vision_config model_type {kind!r}: shardctl places a LLaVA tower of type "
            f"{CLIP} or {SIGLIP}",
            where=w,
            hint="place every tensor with manifest rules for another tower",
        )
    return {**VISION_DEFAULTS[kind], **given, "model_type": kind}


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's and the projector's tensors (and ``image_newline``), under the names
    save_pretrained writes."""
    v = _vision(config, where)
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    patch, image = get_int(v, "patch_size", w), get_int(v, "image_size", w)
    clip = v["model_type"] == CLIP
    e = f"{V}.embeddings"
    out: Shapes = [
        (f"{e}.patch_embedding.weight", (h, get_int(v, "num_channels", w), patch, patch))
    ]
    if clip:
        out += [
            (f"{e}.class_embedding", (h,)),
            (f"{e}.position_embedding.weight", ((image // patch) ** 2 + 1, h)),
            (f"{V}.pre_layrnorm.weight", (h,)),  # sic: CLIPVisionTransformer's name
            (f"{V}.pre_layrnorm.bias", (h,)),
        ]
    else:
        out += [
            (f"{e}.patch_embedding.bias", (h,)),
            (f"{e}.position_embedding.weight", ((image // patch) ** 2, h)),
        ]
    out += vit_layers(f"{V}.encoder.layers", get_int(v, "num_hidden_layers", w), h, i)
    out += [(f"{V}.post_layernorm.weight", (h,)), (f"{V}.post_layernorm.bias", (h,))]
    if not clip and v.get("vision_use_head"):
        out += siglip_head(f"{V}.head", h, i)
    out += [
        (f"{P}.linear_1.weight", (text_hidden, h * feature_layers(config, where, default=-2))),
        (f"{P}.linear_2.weight", (text_hidden, text_hidden)),
    ]
    if get_bool(config, "multimodal_projector_bias", where, True):
        out += [(f"{P}.linear_1.bias", (text_hidden,)), (f"{P}.linear_2.bias", (text_hidden,))]
    if config.get("model_type") != "llava":
        out.append((NEWLINE, (text_hidden,)))
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    family = _family(config, where)
    return text_tensors(family, text_config, config, d, where) + vision_shapes(
        config, d.hidden_size, where
    )


def _dims(config: Config, tied: bool, where: str) -> ModelDims:
    return text_dims(_family(config, where), text_config)(config, tied, where)


def _best_resolution(size: tuple[int, int], pinpoints: Any) -> tuple[int, int]:
    """LLaVA-NeXT's ``select_best_resolution``: the pinpoint ``(height, width)`` that keeps
    the most of an image of ``size`` after scaling it to fit, wasting the least."""
    height, width = size
    best, most, least = (0, 0), 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    return best


def _pinpoints(config: Config) -> tuple[tuple[int, int], ...]:
    value = config.get("image_grid_pinpoints")
    if value is None:
        return PINPOINTS
    seq = (list, tuple)  # tuples: an inline manifest's YAML lists
    ok = isinstance(value, seq) and bool(value)
    pairs = [p for p in value if isinstance(p, seq) and len(p) == 2] if ok else []
    if (
        not ok
        or len(pairs) != len(value)
        or not all(type(x) is int and x > 0 for p in pairs for x in p)
    ):
        raise InvalidInputError(
            f"'image_grid_pinpoints': expected a list of [height, width] pairs, got {value!r}",
            where="config",
        )
    return tuple((p[0], p[1]) for p in pairs)


def _image_tokens(config: Config) -> int:
    """Embeddings of the largest image as vLLM's profile counts them (module docstring)."""
    v = _vision(config, "config")
    image = get_int(v, "image_size", "config: vision_config")
    grid = image // get_int(v, "patch_size", "config: vision_config")
    encoder = grid * grid + (1 if v["model_type"] == CLIP else 0)
    strategy = config.get("vision_feature_select_strategy") or "default"
    if strategy not in ("default", "full"):
        raise InvalidInputError(
            f"'vision_feature_select_strategy': expected default or full, got {strategy!r}",
            where="config",
        )
    base = encoder - 1 if strategy == "default" else encoder
    if config.get("model_type") == "llava":
        return base
    pinpoints = _pinpoints(config)
    most = 0
    for height, width in pinpoints:
        best_h, best_w = _best_resolution((height, width), pinpoints)
        if best_h < image or best_w < image:
            raise InvalidInputError(
                f"'image_grid_pinpoints': [{best_h}, {best_w}] is smaller than one "
                f"{image}-pixel tile (vision_config image_size)",
                where="config",
                hint="give pinpoints in multiples of the tower's image_size",
            )
        rows, cols = grid * (best_h // image), grid * (best_w // image)
        if width / height > cols / rows:
            rows -= 2 * ((rows - height * cols // width) // 2)
        else:
            cols -= 2 * ((cols - width * rows // height) // 2)
        most = max(most, rows * cols + rows + base)
    return most


def _forward() -> ForwardSpec:
    """The text family's forward (every one of :data:`TEXT_FAMILIES` declares llama's), its
    local config made by the family the config names."""
    base = text_forward(
        llama.FAMILY,
        text_config,
        recomputed=(f"{V}.*", f"{P}.*", NEWLINE),
        reference_layers="model.language_model.layers",
        reference_auto="AutoModelForImageTextToText",
    )

    def local_config(
        cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
    ) -> dict[str, Any]:
        text = text_config(cfg)
        forward = TEXT_FAMILIES[text["model_type"]].forward
        assert forward is not None
        local = dict(text)
        local.update(forward.local_config(text, d, tp, ep, first_layer, num_layers))
        local["model_type"] = text["model_type"]
        local.update(text_config=None, vision_config=None)
        if text["model_type"] == "granite":
            # The LLaVA model applies its own lm_head to the text *base* model's output, so
            # GraniteForCausalLM's division by logits_scaling is not part of its logits.
            local["logits_scaling"] = 1.0
        return local

    return dataclasses.replace(base, local_config=local_config)


FAMILY = Family(
    name="llava_next",
    model_types=("llava_next", "llava"),
    tied_default=False,
    dims=_dims,
    tensors=_tensors,
    rules=RULES,
    memory=lambda config: _family(config).memory(text_config(config)),
    forward=_forward(),
    follows="vLLM llava.py / llava_next.py (towers: clip.py, siglip.py)",
    shape_keys=(
        "text_config",
        "vision_config",
        "tie_word_embeddings",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "image_grid_pinpoints",
        "multimodal_projector_bias",
    ),
    config_keys=(
        *COMMON,
        "image_token_index",
        "image_seq_length",
        "projector_hidden_act",
    ),
    text=text_config,
    towers=(f"{V}.*", f"{P}.*", NEWLINE),
    image_tokens=_image_tokens,
    # the published quantized releases quantize the language model's linears
    quantizable=tuple(TEXT + g for g in llama.FAMILY.quantizable),
    # the closed form's per-layer counts describe the text decoder only
    closed_form=False,
)
