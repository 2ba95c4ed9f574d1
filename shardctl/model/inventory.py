"""Build a :class:`ModelInfo` from a config, a checkpoint directory, or a parameter count.

No tensor data is read, and torch is never imported:

- ``from_config`` / ``from_config_file``: closed-form shapes per architecture
  (:mod:`shardctl.model.archs`);
- ``from_checkpoint``: the safetensors headers (through
  :func:`shardctl.checkpoint.hf.open_checkpoint`, which validates the index and paths),
  plus ``config.json`` for the architecture and dims;
- ``from_parameters``: a bare count, for what-if planning (no per-tensor layout).

dtype: an explicit ``dtype`` wins; otherwise the config's ``torch_dtype`` (transformers 4) or
``dtype`` (transformers 5) field; otherwise BF16 (what nearly every current LLM ships in).
For a checkpoint, each tensor keeps its on-disk dtype and ``ModelInfo.dtype`` is the dtype that
holds the most bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardctl.checkpoint.hf import CheckpointFiles, open_checkpoint
from shardctl.checkpoint.strict_json import read_json_strict
from shardctl.columns import from_columns
from shardctl.dtypes import normalize_dtype
from shardctl.errors import InvalidInputError
from shardctl.gcpause import gc_paused
from shardctl.model.archs import SUPPORTED, dims_from_config, tensors_from_config
from shardctl.model.types import ModelInfo, TensorInfo, bytes_by_dtype, numel_by_dtype

DEFAULT_DTYPE = "BF16"
MAX_CONFIG_BYTES = 10 * 2**20


def config_dtype(config: Mapping[str, Any], *, where: str = "config") -> str | None:
    """The config's own dtype (``torch_dtype`` or ``dtype``), or None when absent or ``auto``."""
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value != "auto":
            return normalize_dtype(value, where=f"{where}: {key}")
    return None


def from_config(
    config: Mapping[str, Any],
    *,
    dtype: str | None = None,
    source: str = "config",
    where: str | None = None,
) -> ModelInfo:
    """Inventory from HF config fields: a parsed ``config.json`` or a manifest's inline keys."""
    where = where or source
    if not isinstance(config, Mapping):
        raise InvalidInputError(
            f"config must be an object, got {type(config).__name__}", where=where
        )
    code = (
        normalize_dtype(dtype, where=where)
        if dtype is not None
        else config_dtype(config, where=where) or DEFAULT_DTYPE
    )
    tensors = tensors_from_config(config, code, where=where)
    return ModelInfo(
        architecture=config["model_type"],
        dims=dims_from_config(config, where=where),
        tensors=tensors,
        dtype=code,
        source=source,
        config=MappingProxyType(dict(config)),
    )


def read_config(path: Path) -> dict[str, Any]:
    """A ``config.json`` as a dict, read strictly (size cap, no duplicate keys, no NaN)."""
    data = read_json_strict(Path(path), max_bytes=MAX_CONFIG_BYTES, what="config")
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"config is not a JSON object (got {type(data).__name__})", where=str(path)
        )
    return data


def from_config_file(path: Path, *, dtype: str | None = None) -> ModelInfo:
    """Inventory from a ``config.json`` file."""
    return from_config(read_config(path), dtype=dtype, source="config", where=str(path))


@gc_paused
def from_checkpoint(
    root: Path, *, follow_external_symlinks: bool = False, opened: CheckpointFiles | None = None
) -> ModelInfo:
    """Inventory from a checkpoint's headers, in file order (index file order, then offset).

    A shardctl per-rank layout is refused here (its record, read by shardctl.reshard, gives
    the global tensors); shardctl's HF-format outputs (record + HF weights) are read as HF.

    ``config.json`` (beside the weights) gives ``architecture`` (its ``model_type``) and ``dims``;
    an architecture shardctl has no shapes for still inventories, with ``dims=None``; without a
    config the architecture is ``"unknown"``.

    ``opened``: the HF checkpoint ``root`` already opened by the caller (its headers are not
    read again: at 90,000 tensors a header parse is most of ``inspect``).
    """
    root = Path(root)
    if opened is not None and opened.kind == "hf":
        ck = opened
    else:
        ck = open_checkpoint(root, follow_external_symlinks=follow_external_symlinks)
    if ck.kind == "shardctl" and any(
        (root / n).exists() for n in ("model.safetensors", "model.safetensors.index.json")
    ):
        # shardctl's HF-format output: the record describes it, the weights are plain HF.
        ck = open_checkpoint(
            root, follow_external_symlinks=follow_external_symlinks, ignore_layout_record=True
        )
    if ck.kind != "hf":
        raise InvalidInputError(
            f"is a shardctl {ck.kind} layout, not a Hugging Face checkpoint",
            where=str(root),
            hint="merge it back with shardctl reshard, or inspect its layout record",
        )
    return from_tensors(root if root.is_dir() else root.parent, tensor_infos(ck))


def tensor_infos(ck: CheckpointFiles) -> tuple[TensorInfo, ...]:
    """Every tensor of an opened HF checkpoint, in ``ck.locations`` order (file, then offset;
    the headers' entries in file order are that order, and ``ck.locations`` is not built).

    Built by :func:`~shardctl.columns.from_columns` from the headers' columns: at 90,000
    tensors the per-tensor loop was ~0.1 s, and the headers' entry objects ~40 ms more."""
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    for h in ck.files:  # the headers' columns (no entry objects)
        names += h.names
        dtypes += h.dtypes
        shapes += h.shapes
    return tuple(from_columns(TensorInfo, len(names), fqn=names, shape=shapes, dtype=dtypes))


def from_tensors(
    root: Path, tensors: tuple[TensorInfo, ...], *, architecture: str | None = None
) -> ModelInfo:
    """An inventory of ``tensors`` (from headers or a layout record), described by
    ``root/config.json`` when present: its ``model_type`` wins over ``architecture``."""
    config_path = Path(root) / "config.json"
    config: dict[str, Any] = read_config(config_path) if config_path.exists() else {}
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        architecture = model_type
    architecture = architecture or "unknown"
    dims = dims_from_config(config, where=str(config_path)) if architecture in SUPPORTED else None
    if dims is not None:
        from shardctl.archs import find

        family = find(architecture)
        if family is not None and family.check_tensors is not None:
            shapes = ((t.fqn, t.shape) for t in tensors)
            family.check_tensors(shapes, config, str(config_path))
    numels = numel_by_dtype(tensors)
    by_bytes = bytes_by_dtype(tensors, numels)
    dominant = min(by_bytes, key=lambda d: (-by_bytes[d], d)) if by_bytes else None
    model = ModelInfo(
        architecture=architecture,
        dims=dims,
        tensors=tensors,
        dtype=dominant or config_dtype(config) or DEFAULT_DTYPE,
        source="checkpoint",
        config=MappingProxyType(config),
    )
    # the counts just made are the model's own (its cached properties): not counted again
    model.__dict__.update(numel_by_dtype=numels, bytes_by_dtype=by_bytes)
    return model


def from_parameters(n: int, dtype: str) -> ModelInfo:
    """Model states only: ``n`` parameters of ``dtype``, no tensors, no dims."""
    value: object = n  # a manifest may hand over 7.5e9 as a float
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(
            f"model.parameters: expected a positive integer, got {n!r}", where="model"
        )
    return ModelInfo(
        architecture="unknown",
        dims=None,
        tensors=(),
        dtype=normalize_dtype(dtype, where="model.dtype"),
        source="parameters",
        parameter_count=value,
    )
