"""Torch DCP files, one chunk at a time: a lazy writer through DCP's own planner and writer,
and a chunk reader of DCP's ``.metadata`` + ``__*.distcp`` files.

Writing: :func:`write` hands DCP a plan of write items (one per chunk, plus ``BYTE_IO`` items)
and a planner whose ``resolve_data`` builds each chunk only when DCP's ``FileSystemWriter``
asks for it (one thread: one chunk at a time). DCP's writer keeps a reference to the last chunk
of every key until the file is done; the planner releases each chunk's storage once DCP asks
for the next one (by then the serial writer has written it). The on-disk format is therefore
exactly DCP's, written by DCP.
Reading: the ``.metadata`` pickle goes through an allow-list unpickler (DCP's own metadata
classes only: a hostile pickle is refused, never run); each chunk is a ``torch.save``d tensor
at a byte range of a ``.distcp`` file, loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardctl.errors import InvalidInputError, ShardctlError


@dataclass(frozen=True)
class Chunk:
    """One chunk to write: ``fqn``, global shape, offsets, sizes, dtype; ``make()`` builds it."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Blob:
    """One ``BYTE_IO`` item (an mcore ShardedObject): its DCP key and its bytes."""

    fqn: str
    data: bytes


class _LazyPlanner(DefaultSavePlanner):
    """A save planner whose items are given up front and whose data is built on demand."""

    def __init__(self, chunks: Sequence[Chunk], blobs: Sequence[Blob]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.fqn, c.offsets): c for c in chunks}
        self._blobs = {b.fqn: b for b in blobs}
        self._last: torch.Tensor | None = None
        self.error: ShardctlError | None = None  # raised by a chunk's make(): DCP wraps it

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(c.fqn, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in self._chunks.values()
        ]
        items += [
            WriteItem(index=MetadataIndex(b.fqn), type=WriteItemType.BYTE_IO)
            for b in self._blobs.values()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        idx = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._blobs[idx.fqn].data)
        assert idx.offset is not None
        c = self._chunks[(idx.fqn, tuple(idx.offset))]
        if self._last is not None:
            # written already (DCP's serial loader asks for the next item only after writing
            # this one): free its bytes, which DCP's writer would otherwise hold to the end
            self._last.untyped_storage().resize_(0)
            self._last = None
        try:
            t = c.make()
        except ShardctlError as exc:
            self.error = exc
            raise
        assert tuple(t.shape) == c.sizes and t.dtype == c.dtype, (c.fqn, t.shape, t.dtype)
        if t.untyped_storage().nbytes() != t.nbytes or not t.untyped_storage().resizable():
            t = t.clone()  # a storage of its own, exactly its bytes (DCP would clone it anyway)
        self._last = t
        return t


def write(path: Path, chunks: Sequence[Chunk], blobs: Sequence[Blob]) -> None:
    """Write a DCP checkpoint of ``chunks`` and ``blobs`` into the existing directory ``path``."""
    writer = FileSystemWriter(
        str(path),
        single_file_per_rank=True,
        sync_files=True,
        thread_count=1,  # the serial loader: one chunk resolved at a time (see _LazyPlanner)
        overwrite=True,
        serialization_format=SerializationFormat.TORCH_SAVE,  # what mcore's loader reads
    )
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is meant
        warnings.simplefilter("ignore", UserWarning)
        planner = _LazyPlanner(chunks, blobs)
        try:
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # a BaseException, not an Exception
            error = planner.error or _refusal_in(exc)
            if error is not None:  # a refusal while building a chunk: its one line
                raise error from None
            raise


def _refusal_in(exc: BaseException) -> ShardctlError | None:
    """The ShardctlError a chunk's make() raised, out of DCP's CheckpointException (whose
    ``failures`` map a rank to ``(exception, traceback)``)."""
    for failure in (getattr(exc, "failures", None) or getattr(exc, "_failures", {})).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ShardctlError):
            return inner
    return None


# DCP's ``.metadata`` is a pickle: only these classes may be named in it (what torch's
# FileSystemWriter writes); anything else is refused instead of executed.
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    *(
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        ("torch", n)
        for n in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32")
    ),
    *(("torch", n) for n in ("int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` through an allow-list unpickler (never arbitrary code)."""
    where = path / ".metadata"
    try:
        with open(where, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise InvalidInputError(
            "not a torch DCP checkpoint (no .metadata file)",
            where=str(path),
            hint="point at a Megatron torch_dist checkpoint directory",
        ) from None
    except pickle.UnpicklingError as exc:
        raise InvalidInputError(
            f"DCP .metadata is not plain DCP metadata ({exc})",
            where=str(where),
            hint="shardctl unpickles only torch DCP's own metadata classes",
        ) from None
    except Exception as exc:  # truncated or garbage: name it, never a traceback
        raise InvalidInputError(
            f"unreadable DCP .metadata ({type(exc).__name__})",
            where=str(where),
            hint="the checkpoint is damaged or from an incompatible torch",
        ) from None
    if not isinstance(meta, Metadata):
        raise InvalidInputError(
            f"DCP .metadata holds a {type(meta).__name__}, not DCP Metadata", where=str(where)
        )
    return meta


class DcpReader:
    """Chunks of a DCP checkpoint directory, read one at a time (``boxes`` of global tensors)."""

    def __init__(self, path: Path):
        self.path = path
        self.metadata: Metadata = read_metadata(path)
        storage = self.metadata.storage_data or {}
        self._where: dict[tuple[str, tuple[int, ...]], Any] = {
            (k.fqn, tuple(k.offset or ())): v for k, v in storage.items()
        }

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        return {
            k: v
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }

    def objects(self) -> list[str]:
        return [
            k
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)
        ]

    def read_box(self, fqn: str, index: tuple[int, ...]) -> torch.Tensor:
        """The global tensor ``fqn`` at leading coordinates ``index`` (a layer, an expert),
        assembled from every chunk that overlaps it; shape ``global_shape[len(index):]``."""
        meta = self.tensors().get(fqn)
        if meta is None:
            raise InvalidInputError(
                f"torch_dist checkpoint has no tensor {fqn!r}", where=str(self.path)
            )
        shape = tuple(meta.size)
        k = len(index)
        whole = tuple(index) + (0,) * (len(shape) - k)
        for ch in meta.chunks:  # the common case: one chunk is exactly the box (no copy)
            if tuple(ch.offsets) == whole and tuple(ch.sizes) == (1,) * k + shape[k:]:
                data = self._load_chunk(fqn, whole, tuple(ch.sizes))
                return data.reshape(shape[k:])
        out = torch.empty(shape[k:], dtype=meta.properties.dtype)
        covered = 0
        for ch in meta.chunks:
            off, size = tuple(ch.offsets), tuple(ch.sizes)
            if any(not (o <= i < o + s) for i, o, s in zip(index, off, size, strict=False)):
                continue
            data = self._load_chunk(fqn, off, size)
            sel = tuple(i - o for i, o in zip(index, off, strict=False))
            piece = data[sel] if sel else data
            dst = tuple(slice(o, o + s) for o, s in zip(off[k:], size[k:], strict=True))
            out[dst] = piece
            covered += piece.numel()
        if covered != out.numel():
            raise InvalidInputError(
                f"tensor {fqn!r} at {list(index)}: chunks cover {covered} of {out.numel()} "
                "elements",
                where=str(self.path),
                hint="the checkpoint is incomplete",
            )
        return out

    def _load_chunk(
        self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> torch.Tensor:
        info = self._where.get((fqn, offsets))
        if info is None:
            raise InvalidInputError(
                f"DCP metadata lists chunk {fqn!r} at {list(offsets)} but no storage for it",
                where=str(self.path / ".metadata"),
            )
        if getattr(info, "transform_descriptors", None):
            raise InvalidInputError(
                f"chunk {fqn!r} is stored with transforms {info.transform_descriptors} "
                "(compression/extensions), which shardctl does not read",
                where=str(self.path / info.relative_path),
                hint="save the checkpoint without DCP storage extensions",
            )
        name = os.path.basename(info.relative_path)
        with open(self.path / name, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if len(raw) != info.length:
            raise InvalidInputError(
                f"chunk {fqn!r} at {list(offsets)}: file ends early "
                f"({len(raw)} of {info.length} bytes)",
                where=str(self.path / name),
            )
        try:
            t = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise InvalidInputError(
                f"chunk {fqn!r} at {list(offsets)} is not a tensor ({type(exc).__name__})",
                where=str(self.path / name),
            ) from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes:
            raise InvalidInputError(
                f"chunk {fqn!r} at {list(offsets)}: expected shape {list(sizes)}, got "
                f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}",
                where=str(self.path / name),
            )
        return t


def chunks_of(reader: DcpReader) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    for fqn, meta in reader.tensors().items():
        for ch in meta.chunks:
            yield fqn, tuple(ch.offsets), tuple(ch.sizes)
