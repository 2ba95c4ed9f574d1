"""Qwen2-VL (``qwen2_vl``, ``Qwen2VLForConditionalGeneration``): Qwen2's language model beside
a ViT with LayerNorms and a QuickGELU fc1/fc2 MLP, and a 2 × 2 patch merger. As for Qwen2.5-VL
the language model keeps the plain text names on disk (transformers 5.24 ``save_pretrained``
and the published files alike)::

    model.*  lm_head.weight                                   qwen2's tensors and placement
    visual.patch_embed.proj.weight [E, C, T, p, p]            replicated (a 3-D convolution)
    visual.blocks.{i}.norm1 / norm2 .weight / .bias [E]       replicated (LayerNorm)
    visual.blocks.{i}.attn.qkv .weight [3·E, E] / .bias       colwise, one contiguous slice
    visual.blocks.{i}.attn.proj.weight [E, E]                 rowwise, .bias replicated
    visual.blocks.{i}.mlp.fc1 .weight [E·r, E] / .bias        colwise
    visual.blocks.{i}.mlp.fc2.weight [E, E·r]                 rowwise, .bias replicated
    visual.merger.ln_q .weight / .bias [E]                    replicated
    visual.merger.mlp.0 .weight [E·m², E·m²] / .bias          colwise
    visual.merger.mlp.2.weight [H, E·m²]                      rowwise, .bias replicated

(``E`` the vision ``embed_dim``, ``r`` its ``mlp_ratio``, ``C`` ``in_channels`` (the published
configs: ``in_chans``), ``T`` ``temporal_patch_size``, ``p`` ``patch_size``, ``m``
``spatial_merge_size``, ``H`` the vision config's ``hidden_size``: the merger's output, which
must be the text hidden size.)

Placement follows vLLM ``qwen2_vl.py``. Unlike Qwen2.5-VL's ``QKVParallelLinear``, its
``Qwen2VisionAttention.qkv`` is a plain ``ColumnParallelLinear`` over the fused ``3·E`` rows:
each rank loads one contiguous slice of them (part of q, k or v, not a third of each) and
``split_qkv`` all-gathers the output before taking its heads. So the rule is ``colwise``
without parts, as the engine loads it. ``fc1`` / ``mlp.0`` column-parallel, ``proj`` / ``fc2``
/ ``mlp.2`` row-parallel with whole biases (added once); the tower sits on the first pipeline
stage. The config is read as Qwen2.5-VL's (``text_config`` nested, or the text keys at the top
level as the published configs keep them).

Image size for the profile: as Qwen2.5-VL's (vLLM ``Qwen2VLProcessingInfo``): ``smart_resize``
of a huge square under the image processor's ``max_pixels`` 12,845,056 at a multiple of
``patch_size · spatial_merge_size`` = 28: 16,384 merged embeddings.

The forward level runs the text model as ``qwen2`` on each rank (token input: the multimodal
rotary is plain rotary), compared with ``Qwen2VLForConditionalGeneration``'s logits; the tower
takes no part (``recomputed``), the structure and bitwise levels check it.
"""

from __future__ import annotations

from typing import Any

from shardctl.archs import qwen2_5_vl
from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Shapes, get_int
from shardctl.archs._multimodal import section
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec

V = "visual"
_B = f"{V}.blocks.*"
VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first")
    for match, tp in (
        (f"{_B}.attn.qkv.*", "colwise"),  # ColumnParallelLinear: one contiguous slice
        (f"{_B}.attn.proj.weight", "rowwise"),
        (f"{_B}.mlp.fc1.*", "colwise"),
        (f"{_B}.mlp.fc2.weight", "rowwise"),
        (f"{_B}.*", R),  # norms, proj / fc2 biases
        (f"{V}.merger.mlp.0.*", "colwise"),
        (f"{V}.merger.mlp.2.weight", "rowwise"),
        (f"{V}.*", R),  # patch_embed, merger.ln_q, merger.mlp.2.bias
    )
)

# Qwen2VLVisionConfig's defaults (transformers 5.24) for keys a vision_config leaves out
VISION_DEFAULTS: Config = {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_size": 3584,
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def text_config(config: Config, where: str = "config") -> Config:
    """The language model's config as ``qwen2``'s (``qwen2_5_vl.text_section``)."""
    return qwen2_5_vl.text_section(config, where, "qwen2", "Qwen2-VL", qwen2_5_vl.TEXT_KEYS)


def _vision(config: Config, where: str) -> dict[str, Any]:
    given = section(config, "vision_config", f"{where}: vision_config", "Qwen2-VL", required=True)
    v = {**VISION_DEFAULTS, **given}
    if "in_chans" in given and "in_channels" not in given:
        v["in_channels"] = given["in_chans"]  # the published configs' spelling
    return v


def _mlp_hidden(v: Config, e: int, where: str) -> int:
    """``int(embed_dim · mlp_ratio)`` as vLLM and transformers size fc1 (a float ratio too)."""
    ratio = v.get("mlp_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio <= 0:
        raise InvalidInputError(
            f"'mlp_ratio': expected a positive number, got {ratio!r}", where=where
        )
    return int(e * ratio)


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's and the merger's tensors, under the names save_pretrained writes."""
    v = _vision(config, where)
    w = f"{where}: vision_config"
    e, heads = get_int(v, "embed_dim", w), get_int(v, "num_heads", w)
    p, t = get_int(v, "patch_size", w), get_int(v, "temporal_patch_size", w)
    m = get_int(v, "spatial_merge_size", w)
    out_hidden = get_int(v, "hidden_size", w)
    i = _mlp_hidden(v, e, w)
    qwen2_5_vl.check_tower(("embed_dim", e), heads, ("hidden_size", out_hidden), text_hidden, w)
    out: Shapes = [(f"{V}.patch_embed.proj.weight", (e, get_int(v, "in_channels", w), t, p, p))]
    for k in range(get_int(v, "depth", w)):
        b = f"{V}.blocks.{k}"
        out += [
            (f"{b}.norm1.weight", (e,)),
            (f"{b}.norm1.bias", (e,)),
            (f"{b}.norm2.weight", (e,)),
            (f"{b}.norm2.bias", (e,)),
            *qwen2_5_vl.attention_shapes(b, e),
            (f"{b}.mlp.fc1.weight", (i, e)),
            (f"{b}.mlp.fc1.bias", (i,)),
            (f"{b}.mlp.fc2.weight", (e, i)),
            (f"{b}.mlp.fc2.bias", (e,)),
        ]
    return out + qwen2_5_vl.merger_shapes(e, m, text_hidden, norm_bias=True)


def _image_tokens(config: Config) -> int:
    """Merged embeddings of the largest image vLLM profiles (module docstring)."""
    return qwen2_5_vl.largest_image_tokens(_vision(config, "config"), qwen2_5_vl.MAX_PIXELS)


FAMILY = qwen2_5_vl.qwen2_text_family(
    "qwen2_vl",
    text_config,
    vision_shapes,
    VISION_RULES,
    _image_tokens,
    "vLLM qwen2_vl.py (Qwen2VLForConditionalGeneration)",
)
