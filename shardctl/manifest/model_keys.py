"""The config keys a manifest may type under ``model:`` (inline HF config fields), per family.

Each family file declares its two lists (:mod:`shardctl.archs`, shared ones in
``shardctl/archs/_keys.py``); this module only gathers them:

- :data:`SHAPE_KEYS`: the keys the family's inventory reads — they set tensor shapes, so the
  plan's bytes;
- :data:`PASS_THROUGH`: keys transformers configs carry that do not change any tensor's shape
  (rope settings, token ids, dropout, norm epsilons, activations). Accepted and ignored.

Any other key typed in the manifest is an error with a did-you-mean (``num_key_value_head`` →
``num_key_value_heads``): a typo there silently changes the model. A ``config.json`` named by
``model.config`` is not checked this way (real files carry many more keys).
"""

from __future__ import annotations

import difflib

from shardctl.archs import FAMILIES

SHAPE_KEYS: dict[str, tuple[str, ...]] = {t: f.shape_keys for t, f in FAMILIES.items()}
PASS_THROUGH: dict[str, tuple[str, ...]] = {t: f.config_keys for t, f in FAMILIES.items()}
assert all(SHAPE_KEYS.values()) and all(PASS_THROUGH.values()), "a family without its keys"

# Accepted inline for every family: a published config's ``quantization_config`` pasted as it is
# says how the checkpoint stores its weights (its stored tensors are priced, as from a
# config.json; :mod:`shardctl.quant.config` checks it, and ``quantization:`` beside it is
# refused as pricing the model twice).
EVERY_FAMILY = ("quantization_config",)


def known_keys(model_type: str) -> tuple[str, ...] | None:
    """Every key the manifest accepts inline for ``model_type``; None for other families."""
    if model_type not in SHAPE_KEYS:
        return None
    return SHAPE_KEYS[model_type] + PASS_THROUGH[model_type] + EVERY_FAMILY


def unknown_key_hint(model_type: str, key: str) -> str:
    """``did you mean 'num_key_value_heads'?`` — shape keys first, then the pass-through list."""
    for pool in (SHAPE_KEYS[model_type], PASS_THROUGH[model_type]):
        close = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
        if close:
            return f"did you mean {close[0]!r}?"
    return (
        f"{model_type} keys that set shapes: {', '.join(SHAPE_KEYS[model_type])}; keys that "
        "do not change memory are accepted and ignored (docs: manifest reference); or point "
        "model.config at a config.json"
    )
