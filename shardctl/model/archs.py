"""config.json -> the exact tensors ``save_pretrained`` writes, per architecture; no torch.

The families and their shapes live in :mod:`shardctl.archs` (one file each); this module only
dispatches on ``model_type``. Shapes follow PyTorch storage (``nn.Linear`` ``[out, in]``,
``Conv1D`` ``[in, out]``); tied embeddings mean no ``lm_head.weight`` on disk; experts as the hub
files store them. Checked against transformers 5.23 ``save_pretrained``
(tests/test_inventory_real.py, tests/test_families.py).

Order: sorted by fqn, which is the order ``save_pretrained`` writes a single-dtype model into one
file (safetensors orders tensors by dtype alignment, then name).

Missing fields: the shape-defining ones are required; the rest get transformers' defaults
(``num_key_value_heads`` = heads, ``head_dim`` = hidden / heads, ``tie_word_embeddings`` per
family, biases off).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from shardctl.archs import SUPPORTED, family_for
from shardctl.archs._family import get_bool
from shardctl.errors import InvalidInputError
from shardctl.gcpause import gc_paused
from shardctl.globs import first_match
from shardctl.model.types import ModelDims, TensorInfo
from shardctl.quant.expand import expand

__all__ = ["SUPPORTED", "dims_from_config", "model_type_of", "tensors_from_config"]


def model_type_of(config: Mapping[str, Any], *, where: str = "config") -> str:
    """The config's ``model_type``, checked to be a supported family."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InvalidInputError(
            f"missing 'model_type' (got {model_type!r})",
            where=where,
            hint=f"set model_type to one of: {', '.join(SUPPORTED)}",
        )
    family_for(model_type, where=where)
    return model_type


def dims_from_config(config: Mapping[str, Any], *, where: str = "config") -> ModelDims:
    """The numbers layout rules need; Llama-3-8B -> ``ModelDims(4096, 32, 32, 8, 128, ...)``."""
    family = family_for(model_type_of(config, where=where), where=where)
    tied = get_bool(config, "tie_word_embeddings", where, family.tied_default)
    return family.dims(config, tied, where)


@gc_paused
def tensors_from_config(
    config: Mapping[str, Any], dtype: str, *, where: str = "config"
) -> tuple[TensorInfo, ...]:
    """Every tensor ``save_pretrained`` writes for ``config``, sorted by fqn, in ``dtype`` but
    for the modules the writer (``transformers_version``) keeps in F32 (``Family.fp32_kept``)
    and a quantized release's own dtypes (``Family.quantized_dtypes``).

    ``dtype`` is a safetensors code (``"BF16"``); see :func:`shardctl.dtypes.normalize_dtype`.
    """
    dims = dims_from_config(config, where=where)
    family = family_for(config["model_type"])
    shapes = family.tensors(config, dims, where)
    tensors = tuple(TensorInfo(fqn, shape, dtype) for fqn, shape in sorted(shapes))
    if config.get("quantization_config") is not None:  # the quantized checkpoint's tensors
        tensors = expand(tensors, config, family.quantizable, where=where)
        tensors = _stored_dtypes(tensors, family.quantized_dtypes)
    if dtype in ("BF16", "F16"):
        kept = writer_keeps_fp32(config, family.fp32_kept)
        tensors = _stored_dtypes(tensors, tuple((glob, "F32") for glob in kept))
    return tensors


_VERSION = re.compile(r"(\d+)\.(\d+)")


def writer_keeps_fp32(
    config: Mapping[str, Any], kept: tuple[tuple[str, str], ...]
) -> tuple[str, ...]:
    """The globs of ``kept`` (``Family.fp32_kept``) that apply to a checkpoint whose config
    says it was written by ``transformers_version``: those whose version is at or below it.
    A config without a readable version (a manifest's inline keys, a hand-written one) keeps
    none: what older transformers, and the published releases, store."""
    m = _VERSION.match(str(config.get("transformers_version") or ""))
    if m is None or not kept:
        return ()
    writer = (int(m.group(1)), int(m.group(2)))
    return tuple(glob for since, glob in kept if writer >= tuple(int(x) for x in since.split(".")))


def _stored_dtypes(
    tensors: tuple[TensorInfo, ...], dtypes: tuple[tuple[str, str], ...]
) -> tuple[TensorInfo, ...]:
    """A quantized release's non-16-bit unquantized tensors (``Family.quantized_dtypes``)."""
    if not dtypes:
        return tensors
    first = first_match(tuple(glob for glob, _ in dtypes))  # one regex call a name

    def stored(t: TensorInfo) -> TensorInfo:
        i = first(t.fqn)
        if i is None or dtypes[i][1] == t.dtype:
            return t
        return TensorInfo(t.fqn, t.shape, dtypes[i][1])

    return tuple(map(stored, tensors))
