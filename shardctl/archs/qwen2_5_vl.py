"""Qwen2.5-VL (``qwen2_5_vl``, ``Qwen2_5_VLForConditionalGeneration``): Qwen2's language model
beside a windowed ViT with a 2 × 2 patch merger. Unlike LLaVA's, the language model keeps the
plain text names, so on disk (transformers 5.24 ``save_pretrained`` and the published files
alike) it is a Qwen2 checkpoint plus ``visual.*``::

    model.*  lm_head.weight                                   qwen2's tensors and placement
    visual.patch_embed.proj.weight [Hv, C, T, p, p]           replicated (a 3-D convolution)
    visual.blocks.{i}.norm1 / norm2 .weight [Hv]              replicated (RMSNorm)
    visual.blocks.{i}.attn.qkv .weight [3·Hv, Hv] / .bias     colwise, as three equal parts
    visual.blocks.{i}.attn.proj.weight [Hv, Hv]               rowwise, .bias replicated
    visual.blocks.{i}.mlp.{gate,up}_proj .weight [I, Hv] / .bias      colwise
    visual.blocks.{i}.mlp.down_proj.weight [Hv, I]            rowwise, .bias replicated
    visual.merger.ln_q.weight [Hv]                            replicated
    visual.merger.mlp.0 .weight [Hv·m², Hv·m²] / .bias        colwise
    visual.merger.mlp.2.weight [H, Hv·m²]                     rowwise, .bias replicated

(``Hv`` the vision ``hidden_size``, ``I`` its ``intermediate_size``, ``C`` ``in_channels`` (the
published configs: ``in_chans``), ``T`` ``temporal_patch_size``, ``p`` ``patch_size``, ``m``
``spatial_merge_size``, ``H`` the text hidden size = ``out_hidden_size``.)

Placement follows vLLM ``qwen2_5_vl.py`` (``Qwen2_5_VisionAttention``: ``QKVParallelLinear``
over the heads, ``RowParallelLinear`` proj; ``Qwen2_5_VisionMLP``: merged column-parallel
gate/up, row-parallel down; ``Qwen2_5_VisionPatchMerger``: column then row; the row-parallel
biases added once, so whole), with the tower on the first pipeline stage, where its embeddings
join the text. The config nests the text keys in ``text_config`` (transformers 5) or keeps them
at the top level (the published configs, transformers 4.49); both are read.

Image size for the profile (vLLM ``Qwen2VLProcessingInfo.get_image_size_with_most_features``):
the largest square ``smart_resize`` allows under the image processor's ``max_pixels``
(12,845,056 by default, Qwen2.5-VL's preprocessor_config.json too), at a multiple of
``patch_size · spatial_merge_size`` = 28: 3,584 × 3,584 pixels, 16,384 merged embeddings.

The forward level runs the text model as ``qwen2`` on each rank (for token input the
multimodal rotary's three position streams are equal: plain rotary), compared with
``Qwen2_5_VLForConditionalGeneration``'s logits; the tower takes no part (``recomputed``), the
structure and bitwise levels check it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from shardctl.archs import qwen2
from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Family, Shapes, get_bool, get_int
from shardctl.archs._keys import COMMON, DECODER_OTHER, DECODER_SHAPES, SLIDING
from shardctl.archs._multimodal import section, text_forward, text_memory
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

V = "visual"
_B = f"{V}.blocks.*"
VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first", parts=parts)
    for match, tp, parts in (
        (f"{_B}.attn.qkv.*", "colwise", ("equal", "equal", "equal")),
        (f"{_B}.attn.proj.weight", "rowwise", None),
        (f"{_B}.mlp.gate_proj.*", "colwise", None),
        (f"{_B}.mlp.up_proj.*", "colwise", None),
        (f"{_B}.mlp.down_proj.weight", "rowwise", None),
        (f"{_B}.*", R, None),  # norms, proj / down_proj biases
        (f"{V}.merger.mlp.0.*", "colwise", None),
        (f"{V}.merger.mlp.2.weight", "rowwise", None),
        (f"{V}.*", R, None),  # patch_embed, merger.ln_q, merger.mlp.2.bias
    )
)

# Qwen2_5_VLVisionConfig's defaults (transformers 5.24) for keys a vision_config leaves out
VISION_DEFAULTS: Config = {
    "depth": 32,
    "hidden_size": 3584,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
}
MAX_PIXELS = 12_845_056  # Qwen2VLImageProcessor's max_pixels (and the releases' preprocessor)
# The text keys a published (transformers 4) config keeps at its top level
TEXT_KEYS = (*DECODER_SHAPES, *DECODER_OTHER, *SLIDING)
# What every Qwen-VL generation's config adds for its media: the placeholder token ids, and the
# inputs its tower serves (vLLM builds no tower when both are limited to 0 items)
MEDIA_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
MODALITIES = ("image", "video")


def text_section(
    config: Config, where: str, model_type: str, model: str, top_keys: tuple[str, ...]
) -> Config:
    """A Qwen-VL config's language model as ``model_type``'s config: ``text_config`` when the
    config nests it, else its ``top_keys`` at the top level; ``tie_word_embeddings`` the top
    level's when given (what transformers builds the head from). ``model`` names the config in
    errors ("Qwen2.5-VL")."""
    nested = section(config, "text_config", f"{where}: text_config", model, required=False)
    text = nested or {k: v for k, v in config.items() if k in top_keys}
    text = dict(text)
    if config.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    # the multimodal rotary's sections are one rotary for token input (the module docstring)
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and (
            rope.get("type") == "mrope" or "mrope_section" in rope or "mrope_interleaved" in rope
        ):
            drop = ("type", "mrope_section", "mrope_interleaved")
            rope = {k: v for k, v in rope.items() if k not in drop}
            rope.setdefault("rope_type", "default")
            if key == "rope_scaling" and rope.get("rope_type") == "default":
                text.pop(key)  # a bare default rope_scaling is no scaling
                continue
            text[key] = rope
    text["model_type"] = model_type
    return text


def text_config(config: Config, where: str = "config") -> Config:
    """The language model's config as ``qwen2``'s (:func:`text_section`)."""
    return text_section(config, where, "qwen2", "Qwen2.5-VL", TEXT_KEYS)


def largest_image_tokens(vision: Config, max_pixels: int) -> int:
    """Merged embeddings of the largest image vLLM profiles for a Qwen-VL tower's config
    ``vision``: ``smart_resize`` of a huge square under ``max_pixels`` at a multiple of
    ``patch_size · spatial_merge_size`` per side."""
    w = "config: vision_config"
    factor = get_int(vision, "patch_size", w) * get_int(vision, "spatial_merge_size", w)
    side = math.floor(math.sqrt(max_pixels) / factor)
    return side * side


def attention_shapes(block: str, width: int) -> Shapes:
    """A Qwen-VL ViT block's attention: the fused, biased ``qkv`` and the biased ``proj``."""
    return [
        (f"{block}.attn.qkv.weight", (3 * width, width)),
        (f"{block}.attn.qkv.bias", (3 * width,)),
        (f"{block}.attn.proj.weight", (width, width)),
        (f"{block}.attn.proj.bias", (width,)),
    ]


def check_tower(
    width: tuple[str, int], heads: int, out: tuple[str, int], text_hidden: int, where: str
) -> None:
    """A Qwen-VL tower's sizes: ``width`` (key, value) whole heads, and the merger's output
    ``out`` (key, value) the text hidden size; else one line (exit 3)."""
    if width[1] % heads:
        raise InvalidInputError(
            f"vision {width[0]} {width[1]} is not a whole number of its num_heads={heads} heads",
            where=where,
        )
    if out[1] != text_hidden:
        raise InvalidInputError(
            f"vision {out[0]} {out[1]} is not the text hidden_size {text_hidden} "
            "(the merger's output joins the text embeddings)",
            where=where,
        )


def _vision(config: Config, where: str) -> dict[str, Any]:
    w = f"{where}: vision_config"
    given = section(config, "vision_config", w, "Qwen2.5-VL", required=True)
    v = {**VISION_DEFAULTS, **given}
    if "in_chans" in given and "in_channels" not in given:
        v["in_channels"] = given["in_chans"]  # the published configs' spelling
    return v


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's and the merger's tensors, under the names save_pretrained writes."""
    v = _vision(config, where)
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    p, t = get_int(v, "patch_size", w), get_int(v, "temporal_patch_size", w)
    m = get_int(v, "spatial_merge_size", w)
    out_hidden = get_int(v, "out_hidden_size", w)
    heads = get_int(v, "num_heads", w)
    check_tower(("hidden_size", h), heads, ("out_hidden_size", out_hidden), text_hidden, w)
    out: Shapes = [(f"{V}.patch_embed.proj.weight", (h, get_int(v, "in_channels", w), t, p, p))]
    for k in range(get_int(v, "depth", w)):
        b = f"{V}.blocks.{k}"
        out += [
            (f"{b}.norm1.weight", (h,)),
            (f"{b}.norm2.weight", (h,)),
            *attention_shapes(b, h),
            (f"{b}.mlp.gate_proj.weight", (i, h)),
            (f"{b}.mlp.gate_proj.bias", (i,)),
            (f"{b}.mlp.up_proj.weight", (i, h)),
            (f"{b}.mlp.up_proj.bias", (i,)),
            (f"{b}.mlp.down_proj.weight", (h, i)),
            (f"{b}.mlp.down_proj.bias", (h,)),
        ]
    return out + merger_shapes(h, m, text_hidden, norm_bias=False)


def merger_shapes(width: int, merge: int, text_hidden: int, *, norm_bias: bool) -> Shapes:
    """A Qwen2-VL / Qwen2.5-VL patch merger: the norm ``ln_q`` over the tower's ``width`` (an
    RMSNorm, or a LayerNorm with bias), then ``mlp.0`` over the ``merge × merge`` merged width and
    ``mlp.2`` into the text hidden size."""
    merged = width * merge * merge
    return [
        (f"{V}.merger.ln_q.weight", (width,)),
        *([(f"{V}.merger.ln_q.bias", (width,))] if norm_bias else []),
        (f"{V}.merger.mlp.0.weight", (merged, merged)),
        (f"{V}.merger.mlp.0.bias", (merged,)),
        (f"{V}.merger.mlp.2.weight", (text_hidden, merged)),
        (f"{V}.merger.mlp.2.bias", (text_hidden,)),
    ]


def _image_tokens(config: Config) -> int:
    """Merged embeddings of the largest image vLLM profiles (module docstring)."""
    return largest_image_tokens(_vision(config, "config"), MAX_PIXELS)


def qwen2_text_family(
    name: str,
    text_config: Callable[..., Config],  # (config, where="config")
    vision_shapes: Callable[[Config, int, str], Shapes],
    vision_rules: tuple[RuleSpec, ...],
    image_tokens: Callable[[Config], int],
    follows: str,
) -> Family:
    """A Qwen-VL family whose language model is ``qwen2``'s under its own names (``model.*``,
    ``lm_head``) beside a tower under ``visual.*``: Qwen2-VL and Qwen2.5-VL."""

    def dims(config: Config, tied: bool, where: str) -> ModelDims:
        text = text_config(config, where)
        return qwen2.FAMILY.dims(text, get_bool(text, "tie_word_embeddings", where, tied), where)

    def tensors(config: Config, d: ModelDims, where: str) -> Shapes:
        text = qwen2.FAMILY.tensors(text_config(config, where), d, where)
        return text + vision_shapes(config, d.hidden_size, where)

    return Family(
        name=name,
        model_types=(name,),
        tied_default=False,
        dims=dims,
        tensors=tensors,
        rules=qwen2.FAMILY.rules + vision_rules,
        memory=text_memory(qwen2.FAMILY, text_config),
        forward=dataclasses.replace(
            text_forward(
                qwen2.FAMILY,
                text_config,
                recomputed=(f"{V}.*",),
                reference_layers="model.language_model.layers",
                reference_auto="AutoModelForImageTextToText",
            ),
            renames=(),  # the text tensors are stored under qwen2's own names
        ),
        follows=follows,
        shape_keys=(*TEXT_KEYS, "text_config", "vision_config"),
        config_keys=(*COMMON, *MEDIA_KEYS, "vision_token_id"),
        text=text_config,
        towers=(f"{V}.*",),
        modalities=MODALITIES,
        image_tokens=image_tokens,
        closed_form=False,  # the closed form's per-layer counts describe the text decoder only
    )


FAMILY = qwen2_text_family(
    "qwen2_5_vl",
    text_config,
    vision_shapes,
    VISION_RULES,
    _image_tokens,
    "vLLM qwen2_5_vl.py (Qwen2_5_VLForConditionalGeneration)",
)
