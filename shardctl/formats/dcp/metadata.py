"""``.metadata`` of a DCP checkpoint: read without running arbitrary pickle, validated.

torch writes ``.metadata`` with ``pickle``; loading it with plain ``pickle.load`` would run any
code a hostile file names. :class:`_MetadataUnpickler` resolves only the classes DCP's metadata
is made of (listed in ``_ALLOWED``) and refuses anything else with one line (exit 3).
Every chunk is then checked: inside its tensor, tiling it exactly, its bytes inside a data file
of the checkpoint.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError

METADATA_NAME = ".metadata"
SUFFIX = ".distcp"

# (module, name) pairs a DCP .metadata legitimately refers to (torch 2.4 .. 2.13).
_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
}
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (module in _ALLOWED_MODULES and not name.startswith("__")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, not part of DCP metadata")


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: its box in the global tensor and its bytes on disk."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint root
    begin: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class DcpBytes:
    """A non-tensor item (``torch.save``'d object), e.g. ``optimizer.param_groups.0.lr``."""

    key: str
    file: str
    begin: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    root: Path
    tensors: dict[str, DcpTensor]  # in the metadata's key order
    objects: dict[str, DcpBytes]
    planner_data: dict[str, Any]
    files: tuple[str, ...]  # data files, sorted


def is_dcp(path: Path) -> bool:
    """A directory holding a ``.metadata`` file (how DCP's FileSystemReader finds one)."""
    return path.is_dir() and (path / METADATA_NAME).is_file()


def read_metadata(root: Path) -> DcpMetadata:
    """Parse and validate ``root/.metadata``; exit 3 (InvalidInputError) on anything malformed."""
    where = str(root / METADATA_NAME)
    try:
        raw = (root / METADATA_NAME).read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read ({exc.strerror})", where=where) from None
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # a hostile or truncated pickle: anything can go wrong
        raise InvalidInputError(
            f"not a readable DCP metadata file ({type(exc).__name__}: {exc})",
            where=where,
            hint="expected a .metadata written by torch.distributed.checkpoint.save",
        ) from None
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata):
        raise InvalidInputError(
            f"expected a DCP Metadata object, found {type(md).__name__}", where=where
        )
    storage = _storage_index(md, where)
    sizes = _data_files(root, storage, where)
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpBytes] = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise InvalidInputError(f"key {key!r} is not a string", where=where)
        if isinstance(item, BytesStorageMetadata):
            loc = storage.get((key, None))
            if loc is None:
                raise InvalidInputError(f"{key!r}: no storage entry", where=where)
            objects[key] = DcpBytes(key, *loc)
        elif isinstance(item, TensorStorageMetadata):
            tensors[key] = _tensor(key, item, storage, where)
        else:
            raise InvalidInputError(f"{key!r}: unknown entry {type(item).__name__}", where=where)
    for t in tensors.values():
        for c in t.chunks:
            _check_range(c.file, c.begin, c.length, sizes, t.key, where)
    for o in objects.values():
        _check_range(o.file, o.begin, o.length, sizes, o.key, where)
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    return DcpMetadata(root, tensors, objects, planner, tuple(sorted(sizes)))


def _storage_index(md: Any, where: str) -> dict[tuple[str, Any], tuple[str, int, int]]:
    """``(fqn, chunk offsets or None)`` -> ``(file, begin, length)``."""
    out: dict[tuple[str, Any], tuple[str, int, int]] = {}
    for idx, info in (md.storage_data or {}).items():
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            raise InvalidInputError(
                f"{idx.fqn!r} is stored with transforms {list(descriptors)}",
                where=where,
                hint="shardctl reads uncompressed DCP checkpoints only; re-save without "
                "a storage transform (compression, encryption)",
            )
        name, begin, length = info.relative_path, info.offset, info.length
        if (
            not isinstance(name, str)
            or "/" in name
            or name in ("", ".", "..")
            or name == METADATA_NAME
        ):
            raise InvalidInputError(f"{idx.fqn!r}: bad data file name {name!r}", where=where)
        if type(begin) is not int or type(length) is not int or begin < 0 or length < 0:
            raise InvalidInputError(f"{idx.fqn!r}: bad byte range", where=where)
        offsets = None if idx.offset is None else tuple(int(v) for v in idx.offset)
        out[(idx.fqn, offsets)] = (name, begin, length)
    return out


def _data_files(
    root: Path, storage: dict[tuple[str, Any], tuple[str, int, int]], where: str
) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, _, _ in storage.values():
        if name in sizes:
            continue
        path = root / name
        if path.is_symlink() or not path.is_file():
            raise InvalidInputError(
                "data file named by .metadata is missing or not a regular file",
                where=str(path),
                hint="copy the whole checkpoint directory",
            )
        sizes[name] = os.stat(path).st_size
    return sizes


def _check_range(
    name: str, begin: int, length: int, sizes: dict[str, int], key: str, where: str
) -> None:
    if begin + length > sizes[name]:
        raise InvalidInputError(
            f"{key!r}: bytes [{begin}, {begin + length}) lie past the end of {name} "
            f"({sizes[name]} B)",
            where=where,
            hint="the checkpoint is truncated; copy it again",
        )


def _tensor(
    key: str, item: Any, storage: dict[tuple[str, Any], tuple[str, int, int]], where: str
) -> DcpTensor:
    import torch

    shape = tuple(int(v) for v in item.size)
    dtype = item.properties.dtype
    if not isinstance(dtype, torch.dtype) or any(v < 0 for v in shape):
        raise InvalidInputError(f"{key!r}: bad shape {shape} or dtype {dtype!r}", where=where)
    chunks: list[Chunk] = []
    volume = 0
    for c in item.chunks:
        offsets = tuple(int(v) for v in c.offsets)
        sizes = tuple(int(v) for v in c.sizes)
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)
            )
        ):
            raise InvalidInputError(
                f"{key!r}: chunk offsets {list(offsets)} sizes {list(sizes)} fall outside "
                f"the tensor {list(shape)}",
                where=where,
            )
        loc = storage.get((key, offsets))
        if loc is None:
            raise InvalidInputError(
                f"{key!r}: chunk at {list(offsets)} has no storage entry", where=where
            )
        chunks.append(Chunk(offsets, sizes, *loc))
        volume += math.prod(sizes)
    _check_tiling(key, shape, chunks, volume, where)
    return DcpTensor(key, shape, dtype, tuple(chunks))


def _check_tiling(
    key: str, shape: tuple[int, ...], chunks: list[Chunk], volume: int, where: str
) -> None:
    """Chunks cover the tensor exactly once: volumes add up and no two boxes overlap."""
    if volume != math.prod(shape):
        raise InvalidInputError(
            f"{key!r}: chunks hold {volume} elements, the tensor {list(shape)} has "
            f"{math.prod(shape)}",
            where=where,
            hint="the metadata is corrupt or from a partial save",
        )
    boxes = sorted((c.offsets, c.sizes) for c in chunks if math.prod(c.sizes) > 0)
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if shape and ob[0] >= oa[0] + sa[0]:
                break  # sorted by dim-0 offset: no later box can overlap this one
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb, strict=True)):
                raise InvalidInputError(
                    f"{key!r}: chunks at {list(oa)} and {list(ob)} overlap", where=where
                )
