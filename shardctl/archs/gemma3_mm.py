"""Gemma-3 multimodal (``gemma3``, ``Gemma3ForConditionalGeneration``): the published
Gemma-3-4B/12B/27B ``-it`` and ``-pt`` repositories. Its ``text_config`` is a :mod:`gemma3`
(``gemma3_text``) model under ``language_model.``; beside it a SigLIP vision tower and a
projector that average-pools the patches to ``mm_tokens_per_image`` and maps them to the text
width. On disk::

    language_model.model.*                  gemma3_text's tensors, prefixed (tied: no lm_head)
    vision_tower.embeddings.patch_embedding.weight [Hv, C, p, p] / .bias [Hv]   replicated
    vision_tower.embeddings.position_embedding.weight [(S/p)², Hv]    rows split (vLLM:
                                                                      VocabParallelEmbedding)
    vision_tower.encoder.layers.{i}.self_attn.{q,k,v}_proj .weight [Hv, Hv] / .bias   colwise
    vision_tower.encoder.layers.{i}.self_attn.out_proj.weight [Hv, Hv] rowwise, .bias replicated
    vision_tower.encoder.layers.{i}.mlp.fc1 .weight [Iv, Hv] / .bias   colwise
    vision_tower.encoder.layers.{i}.mlp.fc2.weight [Hv, Iv] rowwise, .bias replicated
    vision_tower.encoder.layers.{i}.layer_norm{1,2} .weight/.bias [Hv]   replicated
    vision_tower.post_layernorm .weight/.bias [Hv]                      replicated
    multi_modal_projector.mm_input_projection_weight [Hv, H]             replicated
    multi_modal_projector.mm_soft_emb_norm.weight [Hv]                   replicated

(``Hv`` / ``Iv`` the vision ``hidden_size`` / ``intermediate_size``, ``p`` ``patch_size``, ``S``
``image_size``, ``C`` ``num_channels``, ``H`` the text hidden size.) transformers 5.24
``save_pretrained`` writes the tower as ``vision_tower.*``; the published files name it
``vision_tower.vision_model.*``: the rules place both (their globs span the extra level), the
config-only inventory gives the writer's names. With ``vision_use_head`` (SigLIP's default; the
published Gemma-3 configs say false) the tower also has an attention-pooling ``head.*``, which
neither transformers' Gemma-3 nor vLLM runs: replicated.

Placement follows vLLM ``gemma3_mm.py`` / ``siglip.py`` in the default tensor-parallel encoder
mode: q/k/v ``QKVParallelLinear`` (a plain even split of ``Hv`` rows is whole vision heads when
tp divides their count), out_proj / fc2 ``RowParallelLinear`` (bias added once: whole on every
rank), fc1 ``ColumnParallelLinear``, the position table ``VocabParallelEmbedding`` (rows
split); the patch convolution, the norms and the projector's ``nn.Parameter`` whole. The
tower and projector make the image embeddings merged into the first stage's input embeddings,
so they sit on the first pipeline stage (their ``layers.{i}`` are not decoder layers). The
forward level of ``verify`` runs the text model (``gemma3_text`` built from ``text_config``):
the ranks' text shards under their in-memory names (``language_model.`` dropped), logits
compared with the unsharded model's (Gemma3ForConditionalGeneration on token input); the tower
and projector take no part in a token-only forward (``recomputed``), the structure and bitwise
levels check them.
"""

from __future__ import annotations

from typing import Any

from shardctl.archs import gemma3
from shardctl.archs._decoder import R
from shardctl.archs._family import (
    Config,
    Family,
    ForwardSpec,
    Shapes,
    get_int,
)
from shardctl.archs._keys import COMMON
from shardctl.archs._multimodal import (
    section,
    siglip_head,
    text_dims,
    text_forward,
    text_memory,
    text_rules,
    text_tensors,
    vit_layer_rules,
    vit_layers,
)
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

TEXT_TYPE = "gemma3_text"
V = "vision_tower"
# ``vision_tower.`` (transformers 5 save_pretrained) or ``vision_tower.vision_model.`` (hub)
_VL = f"{V}.*encoder.layers.*"
P = "multi_modal_projector"

VISION_RULES: tuple[RuleSpec, ...] = tuple(
    RuleSpec(match, tp=tp, stage="first")
    for match, tp in (
        *vit_layer_rules(_VL),
        (f"{V}.*embeddings.position_embedding.weight", "colwise"),
        (f"{V}.*", R),  # patch convolution, post_layernorm, SigLIP's unused pooling head
        (f"{P}.*", R),  # mm_input_projection_weight, mm_soft_emb_norm
    )
)

RULES: tuple[RuleSpec, ...] = text_rules(gemma3.FAMILY) + VISION_RULES

# transformers 5.24 Gemma3TextConfig defaults for the shape keys a published text_config leaves
# out (google/gemma-3-4b-it names only hidden_size, intermediate_size, num_hidden_layers,
# rope_scaling and sliding_window)
TEXT_DEFAULTS: Config = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10_000.0,  # transformers 4's key; 5 writes rope_parameters
}
# transformers 5.24 SiglipVisionConfig defaults
VISION_DEFAULTS: Config = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "vision_use_head": True,
}


def _sub(config: Config, key: str, where: str) -> dict[str, Any]:
    return section(config, key, where, "Gemma-3", required=False)


def text_config(config: Config, where: str = "config") -> Config:
    """The ``text_config`` as a ``gemma3_text`` config, Gemma3TextConfig's defaults filled in.
    ``tie_word_embeddings``: the section's own, else the top level's (unset: tied, as every
    published Gemma-3 is)."""
    text = {**TEXT_DEFAULTS, **_sub(config, "text_config", f"{where}: text_config")}
    if text.get("tie_word_embeddings") is None:
        text["tie_word_embeddings"] = config.get("tie_word_embeddings")
    text["model_type"] = TEXT_TYPE
    return text


def vision_shapes(config: Config, text_hidden: int, where: str) -> Shapes:
    """The tower's and the projector's tensors, under the names save_pretrained writes."""
    v = {**VISION_DEFAULTS, **_sub(config, "vision_config", f"{where}: vision_config")}
    w = f"{where}: vision_config"
    h, i = get_int(v, "hidden_size", w), get_int(v, "intermediate_size", w)
    patch, image = get_int(v, "patch_size", w), get_int(v, "image_size", w)
    e = f"{V}.embeddings"
    out: Shapes = [
        (f"{e}.patch_embedding.weight", (h, get_int(v, "num_channels", w), patch, patch)),
        (f"{e}.patch_embedding.bias", (h,)),
        (f"{e}.position_embedding.weight", ((image // patch) ** 2, h)),
        (f"{V}.post_layernorm.weight", (h,)),
        (f"{V}.post_layernorm.bias", (h,)),
    ]
    out += vit_layers(f"{V}.encoder.layers", get_int(v, "num_hidden_layers", w), h, i)
    if v.get("vision_use_head"):
        out += siglip_head(f"{V}.head", h, i)
    out += [
        (f"{P}.mm_input_projection_weight", (h, text_hidden)),
        (f"{P}.mm_soft_emb_norm.weight", (h,)),
    ]
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    return text_tensors(gemma3.FAMILY, text_config, config, d, where) + vision_shapes(
        config, d.hidden_size, where
    )


def _image_tokens(config: Config) -> int:
    """``mm_tokens_per_image`` (Gemma3Config's default 256): the projector pools every image
    to that many embeddings (vLLM's largest item without pan-and-scan)."""
    return get_int(config, "mm_tokens_per_image", "config", default=256)


def _forward() -> ForwardSpec:
    return text_forward(
        gemma3.FAMILY,
        text_config,
        recomputed=(f"{V}.*", f"{P}.*"),
        # AutoModelForCausalLM builds Gemma3ForConditionalGeneration from the whole config
        reference_layers="model.language_model.layers",
    )


FAMILY = Family(
    name="gemma3_mm",
    model_types=("gemma3",),
    tied_default=True,
    dims=text_dims(gemma3.FAMILY, text_config),
    tensors=_tensors,
    rules=RULES,
    memory=text_memory(gemma3.FAMILY, text_config),
    forward=_forward(),
    follows="vLLM gemma3_mm.py (Gemma3ForConditionalGeneration; tower: siglip.py)",
    shape_keys=("text_config", "vision_config", "tie_word_embeddings"),
    config_keys=(
        *COMMON,
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "mm_tokens_per_image",
    ),
    text=text_config,
    towers=(f"{V}.*", f"{P}.*"),
    modalities=("image",),  # vLLM builds the tower under _mark_tower_model(..., "image")
    image_tokens=_image_tokens,
    # the closed form's per-layer counts describe the text decoder only
    closed_form=False,
)
