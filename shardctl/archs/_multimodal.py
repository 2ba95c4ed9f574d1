"""What a multimodal family file shares: a text family's model under ``language_model.``
beside a vision tower (Llama-4, Gemma-3). The text family supplies the decoder's rules, shapes
and forward; the multimodal file adds its tower and says how its config nests the text model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from shardctl.archs._family import Config, Family, ForwardSpec
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
