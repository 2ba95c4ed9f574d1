"""Qwen3-VL (``qwen3_vl``, ``Qwen3VLForConditionalGeneration``): Qwen3's language model beside
a ViT with learned position embeddings and DeepStack mergers. On disk (the published files and
transformers 5.24 ``save_pretrained`` alike) the language model sits under
``model.language_model.`` and the tower under ``model.visual.``, the head at the top::

    model.language_model.*  lm_head.weight                     qwen3's tensors and placement
    model.visual.patch_embed.proj .weight [Hv, C, T, p, p] / .bias   replicated (3-D conv)
    model.visual.pos_embed.weight [P, Hv]                      replicated
    model.visual.blocks.{i}.norm1 / norm2 .weight / .bias [Hv] replicated (LayerNorm)
    model.visual.blocks.{i}.attn.qkv .weight [3·Hv, Hv] / .bias      colwise, three equal parts
    model.visual.blocks.{i}.attn.proj.weight [Hv, Hv]          rowwise, .bias replicated
    model.visual.blocks.{i}.mlp.linear_fc1 .weight [I, Hv] / .bias   colwise
    model.visual.blocks.{i}.mlp.linear_fc2.weight [Hv, I]      rowwise, .bias replicated
    model.visual.merger.norm .weight / .bias [Hv]              replicated
    model.visual.merger.linear_fc1 .weight [Hv·m², Hv·m²] / .bias    colwise
    model.visual.merger.linear_fc2.weight [H, Hv·m²]           rowwise, .bias replicated
    model.visual.deepstack_merger_list.{k}.*                   as the merger; its norm is over
                                                               the merged width [Hv·m²]

(``Hv`` the vision ``hidden_size``, ``I`` its ``intermediate_size``, ``P``
``num_position_embeddings``, ``C`` ``in_channels``, ``T`` ``temporal_patch_size``, ``p``
``patch_size``, ``m`` ``spatial_merge_size``, ``k`` over ``deepstack_visual_indexes``, ``H``
the text hidden size = ``out_hidden_size``.)

Placement follows vLLM ``qwen3_vl.py``: ``Qwen2_5_VisionAttention`` (``QKVParallelLinear``
over the heads, ``RowParallelLinear`` proj), ``Qwen3_VisionMLP`` and
``Qwen3_VisionPatchMerger`` (column then row parallel, row biases added once), the patch
convolution, position table and norms whole, the tower on the first pipeline stage; the text
model is vLLM's ``Qwen3ForCausalLM`` (``Qwen3LLMForCausalLM``), qwen3's rules under
``model.language_model.``. vLLM asserts that a later pipeline stage starts at or after layer
``len(deepstack_visual_indexes)`` (the DeepStack features join the first layers' outputs);
every convention puts at least that many layers on the first stage of a published config.

Image size for the profile (vLLM ``Qwen3VLProcessingInfo`` → ``Qwen2VLProcessingInfo.
get_image_size_with_most_features``): ``smart_resize`` of a huge square under the image
processor's ``size.longest_edge``, which every published Qwen3-VL ``preprocessor_config.json``
sets to 16,777,216 (4,096²), at a multiple of ``patch_size · spatial_merge_size`` = 32:
128 × 128 = 16,384 merged embeddings.

The forward level runs the text model as ``qwen3`` on each rank (token input: the interleaved
multimodal rotary's three position streams are equal, so plain rotary; no image, so no DeepStack
feature is added), compared with ``Qwen3VLForConditionalGeneration``'s logits; the tower takes
no part (``recomputed``), the structure and bitwise levels check it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shardctl.archs import qwen2_5_vl, qwen3
from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Family, ForwardSpec, Shapes, get_int
from shardctl.archs._keys import COMMON
from shardctl.archs._multimodal import section, text_dims, text_forward, text_memory
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

LM = "model.language_model."
V = "model.visual"
_B = f"{V}.blocks.*"
_M = (f"{V}.merger", f"{V}.deepstack_merger_list.*")
VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first", parts=parts)
    for match, tp, parts in (
        (f"{_B}.attn.qkv.*", "colwise", ("equal", "equal", "equal")),
        (f"{_B}.attn.proj.weight", "rowwise", None),
        (f"{_B}.mlp.linear_fc1.*", "colwise", None),
        (f"{_B}.mlp.linear_fc2.weight", "rowwise", None),
        (f"{_B}.*", R, None),  # norms, proj / linear_fc2 biases
        *((f"{m}.linear_fc1.*", "colwise", None) for m in _M),
        *((f"{m}.linear_fc2.weight", "rowwise", None) for m in _M),
        (f"{V}.*", R, None),  # patch_embed, pos_embed, merger norms and linear_fc2 biases
    )
)


def text_rule(rule: RuleSpec) -> RuleSpec:
    """qwen3's rule for the same tensor under ``model.language_model.`` (the head stays)."""
    if rule.match.startswith("model."):
        return dataclasses.replace(rule, match=LM + rule.match[len("model.") :])
    return rule


RULES: tuple[RuleSpec, ...] = tuple(text_rule(r) for r in qwen3.FAMILY.rules) + VISION_RULES

# Qwen3VLTextConfig's and Qwen3VLVisionConfig's defaults (transformers 5.24) for keys a section
# leaves out (a transformers-4 config wrote nested sections as differences from them)
TEXT_DEFAULTS: Config = {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 128000,
}
VISION_DEFAULTS: Config = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
MAX_PIXELS = 16_777_216  # the published preprocessor_config.json's size.longest_edge (4096²)


def text_config(config: Config, where: str = "config") -> Config:
    """The language model's config as ``qwen3``'s: the ``text_config`` section over the config
    class's defaults (``qwen2_5_vl.text_section``: the top-level tie, mrope stripped)."""
    nested = section(config, "text_config", f"{where}: text_config", "Qwen3-VL", required=True)
    merged = {**config, "text_config": {**TEXT_DEFAULTS, **nested}}
    return qwen2_5_vl.text_section(merged, where, "qwen3", "Qwen3-VL", ())


def vision(config: Config, where: str) -> dict[str, Any]:
    given = section(config, "vision_config", f"{where}: vision_config", "Qwen3-VL", required=True)
    return {**VISION_DEFAULTS, **given}


def _deepstack(v: Config, depth: int, where: str) -> list[int] | tuple[int, ...]:
    layers = v.get("deepstack_visual_indexes")
    if not isinstance(layers, list | tuple) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < depth for x in layers
    ):
        raise InvalidInputError(
            f"'deepstack_visual_indexes': expected a list of block indexes in [0, {depth}), "
            f"got {layers!r}",
            where=where,
        )
    return layers


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's, the merger's and the DeepStack mergers' tensors, as save_pretrained names
    them."""
    v = vision(config, where)
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    p, t = get_int(v, "patch_size", w), get_int(v, "temporal_patch_size", w)
    m = get_int(v, "spatial_merge_size", w)
    heads, depth = get_int(v, "num_heads", w), get_int(v, "depth", w)
    out_hidden = get_int(v, "out_hidden_size", w)
    qwen2_5_vl.check_tower(
        ("hidden_size", h), heads, ("out_hidden_size", out_hidden), text_hidden, w
    )
    out: Shapes = [
        (f"{V}.patch_embed.proj.weight", (h, get_int(v, "in_channels", w), t, p, p)),
        (f"{V}.patch_embed.proj.bias", (h,)),
        (f"{V}.pos_embed.weight", (get_int(v, "num_position_embeddings", w), h)),
    ]
    for k in range(depth):
        b = f"{V}.blocks.{k}"
        out += [
            (f"{b}.norm1.weight", (h,)),
            (f"{b}.norm1.bias", (h,)),
            (f"{b}.norm2.weight", (h,)),
            (f"{b}.norm2.bias", (h,)),
            *qwen2_5_vl.attention_shapes(b, h),
            (f"{b}.mlp.linear_fc1.weight", (i, h)),
            (f"{b}.mlp.linear_fc1.bias", (i,)),
            (f"{b}.mlp.linear_fc2.weight", (h, i)),
            (f"{b}.mlp.linear_fc2.bias", (h,)),
        ]
    merged = h * m * m

    def merger(prefix: str, norm: int) -> Shapes:
        return [
            (f"{prefix}.norm.weight", (norm,)),
            (f"{prefix}.norm.bias", (norm,)),
            (f"{prefix}.linear_fc1.weight", (merged, merged)),
            (f"{prefix}.linear_fc1.bias", (merged,)),
            (f"{prefix}.linear_fc2.weight", (text_hidden, merged)),
            (f"{prefix}.linear_fc2.bias", (text_hidden,)),
        ]

    out += merger(f"{V}.merger", h)  # its norm before the 2 x 2 shuffle
    for k in range(len(_deepstack(v, depth, w))):  # theirs after it (use_postshuffle_norm)
        out += merger(f"{V}.deepstack_merger_list.{k}", merged)
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    text = qwen3.FAMILY.tensors(text_config(config, where), d, f"{where}: text_config")
    moved = [(LM + n[len("model.") :] if n.startswith("model.") else n, s) for n, s in text]
    return moved + vision_shapes(config, d.hidden_size, where)


def image_tokens_of(config: Config) -> int:
    """Merged embeddings of the largest image vLLM profiles (module docstring)."""
    return qwen2_5_vl.largest_image_tokens(vision(config, "config"), MAX_PIXELS)


def levels(config: Config) -> int:
    v = vision(config, "config")
    return len(_deepstack(v, get_int(v, "depth", "config: vision_config"), "config"))


def image_width_of(config: Config) -> int:
    """One image embedding as vLLM's encoder returns and caches it: the merger's output and
    each DeepStack merger's side by side (``visual_dim + multiscale_dim``), split only when the
    embeddings are merged into the text."""
    v = vision(config, "config")
    return get_int(v, "out_hidden_size", "config: vision_config") * (1 + levels(config))


def deepstack_buffers(
    text: Callable[[Config], Config],
) -> Callable[[Config, int, int], int]:
    """vLLM's DeepStack input buffers of a config whose language model ``text`` reads: one
    ``[max_num_batched_tokens, hidden]`` zeros tensor per level, made with the model
    (``Qwen3VLForConditionalGeneration.__init__``, and Qwen3-VL-MoE's), on every rank (tp does
    not split them; each pipeline stage builds the tower and them)."""

    def buffers(config: Config, batched_tokens: int, act_bytes: int) -> int:
        hidden = get_int(text(config), "hidden_size", "config: text_config")
        return levels(config) * batched_tokens * hidden * act_bytes

    return buffers


def vl_forward(text: Family, text_config: Callable[..., Config]) -> ForwardSpec:
    """The forward level of a Qwen3-VL family: ``text``'s model on each rank's text config,
    ``model.language_model.X`` read as its ``model.X``, the tower skipped, compared with the
    ``*ForConditionalGeneration`` logits (module docstring)."""
    return dataclasses.replace(
        text_forward(
            text,
            text_config,
            recomputed=(f"{V}.*",),
            reference_layers="model.language_model.layers",
            reference_auto="AutoModelForImageTextToText",
        ),
        renames=((LM, "model."),),  # model.language_model.X is the text family's model.X
    )


def vl_family(
    name: str,
    text: Family,
    text_config: Callable[..., Config],  # (config, where="config")
    **fields: Any,
) -> Family:
    """A Qwen3-VL family: ``text``'s language model under ``model.language_model.`` beside this
    file's tower, with its DeepStack profile terms; dims and memory flags are the text
    section's; ``fields`` are the family's own (tensors, rules, forward, follows, ...)."""
    return Family(
        name=name,
        model_types=(name,),
        tied_default=False,
        dims=text_dims(text, text_config),
        memory=text_memory(text, text_config),
        shape_keys=("text_config", "vision_config", "tie_word_embeddings"),
        config_keys=(*COMMON, *qwen2_5_vl.MEDIA_KEYS),
        text=text_config,
        towers=(f"{V}.*",),
        modalities=qwen2_5_vl.MODALITIES,
        image_tokens=image_tokens_of,
        image_width=image_width_of,
        vllm_buffers=deepstack_buffers(text_config),
        # a quantization_config quantizes the language model's linears (the tower: ``towers``)
        quantizable=tuple(LM + g[len("model.") :] for g in text.quantizable),
        closed_form=False,  # the closed form's per-layer counts describe the text decoder only
        **fields,
    )


FAMILY = vl_family(
    "qwen3_vl",
    qwen3.FAMILY,
    text_config,
    tensors=_tensors,
    rules=RULES,
    forward=vl_forward(qwen3.FAMILY, text_config),
    follows="vLLM qwen3_vl.py (Qwen3VLForConditionalGeneration)",
)
