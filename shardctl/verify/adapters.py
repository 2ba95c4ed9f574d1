"""What the sharded forward must know per architecture, read from its family file.

A rank builds transformers' own model class from a *local* config (heads, kv heads,
intermediate size and vocab divided by tp; only its stage's layers), loads its local tensors by
their on-disk names, then wraps the modules whose outputs are partial sums (row-parallel) or
vocab slices. The family's :class:`~shardctl.archs.ForwardSpec` says which modules those are,
e.g. o_proj and down_proj (weight ``[out, in/tp]``, all-reduce, bias once), or GPT-2's Conv1D
c_proj (``[in/tp, out]``).

Fused tensors (``[Q; K; V]``, ``[gate; up]``) are split by the model at its *local* sizes: a
rank holding ``[Q_r; K_r; V_r]`` computes correctly, a rank holding a plain chunk of
``[Q; K; V]`` does not — which is what the forward level is there to catch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardctl.archs import FAMILIES, ForwardSpec, find
from shardctl.errors import InvalidInputError
from shardctl.model.archs import dims_from_config
from shardctl.model.types import ModelDims

Adapter = ForwardSpec
Dims = ModelDims

# The families the forward level runs: every family whose file declares its forward.
SUPPORTED: tuple[str, ...] = tuple(t for t, f in sorted(FAMILIES.items()) if f.forward)


def adapter_for(arch: str) -> Adapter:
    family = find(arch)
    if family is None or family.forward is None:
        raise InvalidInputError(
            f"forward level does not support architecture {arch!r}",
            hint=f"supported: {', '.join(SUPPORTED)}; use --level bitwise",
        )
    return dataclasses.replace(family.forward, arch=arch)


def forward_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config the forward level reads: a multimodal family's text section lifted to the
    top (``ForwardSpec.sub_config``), its own ``model_type`` kept and its tie as the family
    reads it (``Family.text``); others unchanged."""
    family = find(str(cfg.get("model_type")))
    section = family.forward.sub_config if family is not None and family.forward else ""
    sub = cfg.get(section) if section else None
    if not isinstance(sub, Mapping):
        return cfg
    lifted = {**cfg, **dict(sub), "model_type": cfg["model_type"]}
    assert family is not None
    # the tie the family reads (Mistral-3: the top level's first, as transformers ties)
    tied = family.text(cfg).get("tie_word_embeddings") if family.text is not None else None
    if tied is not None:
        lifted["tie_word_embeddings"] = tied
    return lifted


def dims_of(cfg: dict[str, Any]) -> Dims:
    """The global sizes the local config divides (the inventory's own dims)."""
    return dims_from_config(cfg)


def local_config(
    cfg: dict[str, Any],
    *,
    tp: int,
    ep: int,
    first_layer: int,
    num_layers: int,
    vocab: int,
) -> dict[str, Any]:
    """The config of one rank's model: local heads/intermediate/vocab, its stage's layers.

    ``kv heads`` become ``max(1, kv // tp)``: with ``tp > kv`` each rank holds one replicated
    kv head (rank r: head ``r // (tp / kv)``). Experts stay global here (the router scores all
    of them); the expert module is rebuilt with the rank's experts (the family's ``localize``).
    """
    d = dims_of(cfg)
    ad = adapter_for(str(cfg.get("model_type")))
    local = dict(cfg)
    if d.num_kv_heads % tp and tp % d.num_kv_heads:
        raise InvalidInputError(
            f"tp={tp} and num_key_value_heads={d.num_kv_heads}: one must divide the other"
        )
    local.update(ad.local_config(cfg, d, tp, ep, first_layer, num_layers))
    local["vocab_size"] = vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(local.get(key), int) and local[key] >= vocab:
            local[key] = None
    return local
