"""What a multimodal family file shares: a text family's model under ``language_model.``
beside a vision tower (Llama-4, Gemma-3). The text family supplies the decoder's rules, shapes
and forward; the multimodal file adds its tower and says how its config nests the text model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from shardctl.archs._decoder import R
from shardctl.archs._family import Config, Family, ForwardSpec, MemoryFlags, Shapes, get_bool
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

TEXT = "language_model."


def section(config: Config, key: str, where: str, model: str, *, required: bool) -> dict[str, Any]:
    """``config[key]`` (``text_config``, ``vision_config``) as a dict; ``{}`` when absent and not
    ``required``. ``model`` names the config in the error ("Llama-4")."""
    value = config.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        got = "it is missing" if value is None else f"got {type(value).__name__}"
        raise InvalidInputError(
            f"{key!r}: expected an object (the multimodal {model} config nests it); {got}",
            where=where,
            hint=f"give {key} as in the model's config.json",
        )
    return dict(value)


def text_rules(text: Family) -> tuple[RuleSpec, ...]:
    """The text family's rules for its tensors under ``language_model.``."""
    return tuple(dataclasses.replace(r, match=TEXT + r.match) for r in text.rules)


def text_forward(
    text: Family,
    text_config: Callable[[Config], Config],
    *,
    recomputed: tuple[str, ...],
    reference_layers: str = "",
    reference_auto: str = "AutoModelForCausalLM",
) -> ForwardSpec:
    """The forward level of a multimodal family: the text family's, on each rank's text config
    (``text_config`` of the whole one, at the text family's local sizes), the on-disk
    ``language_model.`` names mapped to the text model's, the tower ``recomputed`` (skipped)."""
    forward = text.forward
    assert forward is not None
    model_type = text.model_types[0]

    def local_config(
        cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
    ) -> dict[str, Any]:
        section = text_config(cfg)
        assert forward is not None
        local = dict(section)
        local.update(forward.local_config(section, d, tp, ep, first_layer, num_layers))
        local["model_type"] = model_type
        # the nested sections stay out of the text model's config (transformers reads them as
        # sub-configs there)
        local.update(text_config=None, vision_config=None)
        return local

    return dataclasses.replace(
        forward,
        local_config=local_config,
        renames=((TEXT + "model.", "model."), (TEXT + "lm_head.", "lm_head.")),
        recomputed=recomputed,
        sub_config="text_config",
        reference_layers=reference_layers,
        reference_auto=reference_auto,
    )


def text_tensors(
    text: Family,
    text_config: Callable[[Config, str], Config],
    config: Config,
    d: ModelDims,
    where: str,
) -> Shapes:
    """The text family's tensors for the text section, under ``language_model.``."""
    shapes = text.tensors(text_config(config, where), d, f"{where}: text_config")
    return [(TEXT + n, s) for n, s in shapes]


def text_dims(
    text: Family, text_config: Callable[[Config, str], Config]
) -> Callable[[Config, bool, str], ModelDims]:
    """A ``Family.dims`` of the text section: the text family's, tied as the section says
    (``text_config`` fills the tie in as the multimodal family reads it), else ``tied``."""

    def dims(config: Config, tied: bool, where: str) -> ModelDims:
        section = text_config(config, where)
        tied = get_bool(section, "tie_word_embeddings", f"{where}: text_config", tied)
        return text.dims(section, tied, f"{where}: text_config")

    return dims


def text_memory(
    text: Family, text_config: Callable[[Config, str], Config]
) -> Callable[[Config], MemoryFlags]:
    """A ``Family.memory`` of the text section: the text family's flags."""
    return lambda config: text.memory(text_config(config, "config"))


# ---- what several multimodal families share -------------------------------------------------

# transformers 5.24's config-class defaults for the shape keys a saved text_config may leave out
# (transformers 4 wrote nested sections as differences from them), per text model_type;
# head_dim and num_key_value_heads follow the given sizes where the class derives them
TEXT_DEFAULTS: dict[str, Config] = {
    "llama": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    "mistral": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "granite": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    "qwen2": {
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
    },
}


def feature_layers(config: Config, where: str, *, default: int) -> int:
    """How many tower layers' outputs a projector concatenates (``vision_feature_layer``: one
    index, or a list of them; a tuple is an inline manifest's YAML list)."""
    value = config.get("vision_feature_layer", default)
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if isinstance(value, (list, tuple)) and value and all(type(x) is int for x in value):
        return len(value)
    raise InvalidInputError(
        f"'vision_feature_layer': expected a layer index or a list of them, got {value!r}",
        where=where,
        hint=f"give vision_feature_layer as in the model's config.json (default: {default})",
    )


def vit_layer_rules(layers: str) -> tuple[tuple[str, str], ...]:
    """``(glob, tp)`` of a CLIP / SigLIP encoder layer under ``layers`` (vLLM ``clip.py`` /
    ``siglip.py``: q/k/v ``QKVParallelLinear``, out_proj / fc2 ``RowParallelLinear`` with their
    bias added once, fc1 ``ColumnParallelLinear``, LayerNorms whole)."""
    return (
        (f"{layers}.self_attn.[qkv]_proj.*", "colwise"),
        (f"{layers}.self_attn.out_proj.weight", "rowwise"),
        (f"{layers}.self_attn.out_proj.bias", R),
        (f"{layers}.mlp.fc1.*", "colwise"),
        (f"{layers}.mlp.fc2.weight", "rowwise"),
        (f"{layers}.mlp.fc2.bias", R),
        (f"{layers}.layer_norm*", R),
    )


def vit_layers(prefix: str, n: int, h: int, i: int) -> Shapes:
    """``n`` CLIP / SigLIP encoder layers ``{prefix}.{k}`` of width ``h``, MLP ``i``."""
    out: Shapes = []
    for k in range(n):
        p = f"{prefix}.{k}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(f"{p}.self_attn.{proj}.weight", (h, h)), (f"{p}.self_attn.{proj}.bias", (h,))]
        out += [
            (f"{p}.mlp.fc1.weight", (i, h)),
            (f"{p}.mlp.fc1.bias", (i,)),
            (f"{p}.mlp.fc2.weight", (h, i)),
            (f"{p}.mlp.fc2.bias", (h,)),
        ]
        for norm in ("layer_norm1", "layer_norm2"):
            out += [(f"{p}.{norm}.weight", (h,)), (f"{p}.{norm}.bias", (h,))]
    return out


def siglip_head(prefix: str, h: int, i: int) -> Shapes:
    """SigLIP's attention-pooling head (``SiglipMultiheadAttentionPoolingHead``, with
    ``vision_use_head``), which neither Gemma-3 nor LLaVA runs."""
    return [
        (f"{prefix}.probe", (1, 1, h)),
        (f"{prefix}.attention.in_proj_weight", (3 * h, h)),
        (f"{prefix}.attention.in_proj_bias", (3 * h,)),
        (f"{prefix}.attention.out_proj.weight", (h, h)),
        (f"{prefix}.attention.out_proj.bias", (h,)),
        (f"{prefix}.layernorm.weight", (h,)),
        (f"{prefix}.layernorm.bias", (h,)),
        (f"{prefix}.mlp.fc1.weight", (i, h)),
        (f"{prefix}.mlp.fc1.bias", (i,)),
        (f"{prefix}.mlp.fc2.weight", (h, i)),
        (f"{prefix}.mlp.fc2.bias", (h,)),
    ]
