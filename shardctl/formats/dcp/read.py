"""Read one DCP item at a time: a tensor assembled from its chunks, or a saved object.

Each chunk is a ``torch.save``'d tensor at ``[begin, begin + length)`` of its data file; it is
read with ``os.pread`` and ``torch.load(weights_only=True)`` (no arbitrary pickle), checked
against the metadata (shape, dtype) and copied into the global tensor. Peak memory: one
tensor plus one chunk.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.formats.dcp.metadata import DcpBytes, DcpMetadata, DcpTensor


class DcpReader:
    """Open data files once; read items by key. Use as a context manager."""

    def __init__(self, md: DcpMetadata):
        self.md = md
        self._fds: dict[str, int] = {}

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _pread(self, name: str, begin: int, length: int) -> bytes:
        fd = self._fds.get(name)
        if fd is None:
            fd = os.open(Path(self.md.root) / name, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[name] = fd
        data = os.pread(fd, length, begin)
        if len(data) != length:
            raise InvalidInputError(
                f"short read: {len(data)} of {length} B at {begin}",
                where=str(Path(self.md.root) / name),
                hint="the checkpoint is truncated; copy it again",
            )
        return data

    def tensor(self, key: str) -> Any:
        """The global tensor ``key`` (a new CPU tensor, contiguous)."""
        import torch

        t: DcpTensor = self.md.tensors[key]
        out = torch.empty(t.shape, dtype=t.dtype) if len(t.chunks) != 1 else None
        for c in t.chunks:
            where = f"{Path(self.md.root) / c.file} @ {c.begin}"
            piece = self._load(c.file, c.begin, c.length, where)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != c.sizes:
                got = tuple(piece.shape) if isinstance(piece, torch.Tensor) else type(piece)
                raise InvalidInputError(
                    f"{key!r}: stored chunk is {got}, the metadata says {c.sizes}", where=where
                )
            if piece.dtype != t.dtype:
                raise InvalidInputError(
                    f"{key!r}: stored chunk is {piece.dtype}, the metadata says {t.dtype}",
                    where=where,
                )
            if len(t.chunks) == 1:  # the chunk is the tensor: no copy
                return piece.contiguous()
            assert out is not None
            view = out
            for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
                view = view.narrow(dim, o, s)
            view.copy_(piece)
            del piece
        return out

    def obj(self, key: str) -> Any:
        """A non-tensor item (``optimizer.param_groups.0.lr`` -> ``0.01``)."""
        b: DcpBytes = self.md.objects[key]
        return self._load(b.file, b.begin, b.length, f"{Path(self.md.root) / b.file} @ {b.begin}")

    def _load(self, name: str, begin: int, length: int, where: str) -> Any:
        import torch

        data = self._pread(name, begin, length)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refusals, corrupt zip: one line, exit 3
            raise InvalidInputError(
                f"unreadable item ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                where=where,
                hint="only tensors and plain Python values are read (torch.load weights_only)",
            ) from None
