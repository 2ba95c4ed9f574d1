"""The one list of supported families: ``model_type`` → :class:`Family`.

Adding a family = one module in this package declaring ``FAMILY`` (a Llama-like one is a
:func:`~shardctl.archs._decoder.decoder_family` call naming its differences), listed in
``_MODULES`` below, plus one entry in tests/test_families.py ``FAMILIES`` and its config in
tests/_models.py. The inventory, the layout presets, the memory model and verify's forward level
all read this registry; nothing else in shardctl names a family.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from shardctl.archs import (
    cohere,
    deepseek_v2,
    deepseek_v3,
    falcon,
    gemma,
    gemma2,
    gemma3,
    gemma3_mm,
    glm4,
    glm4_moe,
    gpt2,
    gpt_neox,
    gpt_oss,
    granite,
    llama,
    llama4,
    llama4_text,
    llava_next,
    minimax_m2,
    mistral,
    mistral3,
    mixtral,
    olmo2,
    phi,
    phi3,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen2_vl,
    qwen3,
    qwen3_moe,
    qwen3_vl,
    qwen3_vl_moe,
    stablelm,
    starcoder2,
)
from shardctl.archs._family import ExpertSpec, Family, ForwardSpec, MemoryFlags
from shardctl.errors import InvalidInputError

__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "ExpertSpec",
    "Family",
    "ForwardSpec",
    "MemoryFlags",
    "closest_family",
    "family_for",
    "find",
    "language_model",
    "refusal_hint",
]

_MODULES: tuple[ModuleType, ...] = (
    gemma,
    gemma2,
    gpt2,
    granite,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    # fam-dense
    olmo2,
    starcoder2,
    cohere,
    stablelm,
    glm4,
    gemma3,
    # fam-fused
    gpt_neox,
    phi,
    falcon,
    # fam-moe
    qwen2_moe,
    qwen3_moe,
    llama4_text,
    gpt_oss,
    glm4_moe,
    minimax_m2,
    # fam-mla
    deepseek_v2,
    deepseek_v3,
    # flagships
    llama4,
    gemma3_mm,
    mistral3,
    llava_next,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_vl,
    qwen3_vl_moe,
)

FAMILIES: dict[str, Family] = {
    model_type: m.FAMILY for m in _MODULES for model_type in m.FAMILY.model_types
}
SUPPORTED: tuple[str, ...] = tuple(sorted(FAMILIES))
# model_type -> why it is refused and what to do, for a known relative a family file declines
# (a module's optional ``REFUSED`` dict, e.g. qwen3_vl_moe.py: the omni-modal
# "qwen3_omni_moe").
REFUSED: dict[str, str] = {t: why for m in _MODULES for t, why in getattr(m, "REFUSED", {}).items()}

_LAYER_INDEX = re.compile(r"\.\d+\.")


def find(model_type: str) -> Family | None:
    """The family of ``model_type``, or ``None`` when shardctl has no file for it."""
    return FAMILIES.get(model_type)


def language_model(model_type: str, config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """The language model of a multimodal family (``Family.text``: Gemma-3's ``gemma3_text``
    section, defaults filled in) as ``(model_type, config)``; any other model as it is.

    >>> language_model("gemma3", {"text_config": {"hidden_size": 2560}})[0]
    'gemma3_text'
    """
    family = find(model_type)
    if family is None or family.text is None:
        return model_type, config
    text = family.text(config)
    return str(text.get("model_type") or model_type), text


def closest_family(model_type: str, fqns: Iterable[str] = ()) -> str:
    """The known ``model_type`` nearest to an unknown one: by how many of its tensor names a
    family's rules place (when names are given), else by spelling.

    >>> closest_family("llama5")
    'llama'
    """
    templates = sorted({_LAYER_INDEX.sub(".*.", n) for n in fqns})
    if templates:
        scores: dict[str, int] = {}
        for name, fam in FAMILIES.items():
            globs = [r.match for r in fam.rules if r.tp is not None]
            scores[name] = sum(any(fnmatch.fnmatchcase(t, g) for g in globs) for t in templates)
        best = max(scores.values())
        if best:
            tied = [n for n in SUPPORTED if scores[n] == best]
            close = difflib.get_close_matches(model_type, tied, n=1, cutoff=0.0)
            return close[0] if close else tied[0]
    close = difflib.get_close_matches(model_type, SUPPORTED, n=1, cutoff=0.0)
    return close[0] if close else SUPPORTED[0]


def refusal_hint(model_type: str, fqns: Iterable[str] = ()) -> str:
    """The remedy for an architecture with no family file, as one line."""
    from shardctl.archs.suggest import rule_yaml

    if model_type in REFUSED:
        return REFUSED[model_type]
    near = closest_family(model_type, fqns)
    rules = ", ".join(rule_yaml(r) for r in FAMILIES[near].rules if r.tp is not None)
    return (
        f"closest known family: {near!r}; supported: {', '.join(SUPPORTED)}; for another "
        f"architecture inventory a checkpoint directory and place its tensors with manifest "
        f"rules: like {near!r}'s [{rules}] (shardctl/archs/{FAMILIES[near].name}.py; "
        f"`shardctl inspect CHECKPOINT` suggests rules for its own tensor names)"
    )


def family_for(model_type: str, *, where: str = "config") -> Family:
    """The family of ``model_type``; an unknown one is refused naming the closest family."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise InvalidInputError(
            f"unsupported model_type {model_type!r}", where=where, hint=refusal_hint(model_type)
        )
    return fam
