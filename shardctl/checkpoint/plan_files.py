"""Output files and their headers, computed from the layout before a byte is written.

Every tensor's offset is known up front, so the copy engine streams data straight into place.
Within every output file tensors follow one global order (the source's file order), which lets
the engine walk an fqn's target shards in lockstep and write every file sequentially.

- ``ranks``: ``rank-00003-of-00008.safetensors`` per model-parallel rank (index ``(pp·ep + e)·tp
  + t``); above ``max_shard_size`` ``rank-00003-of-00008.part-00001-of-00002.safetensors``.
- ``hf``: ``model.safetensors``, or ``model-00001-of-00003.safetensors`` … plus the index.
"""

from __future__ import annotations

import json
import math
import operator
import zlib
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import accumulate, repeat
from operator import attrgetter
from typing import overload

from shardctl.checkpoint.plan_header import header_text, saved_offsets_json
from shardctl.checkpoint.record import RECORD_NAME, SCHEMA
from shardctl.checkpoint.record_table import PlannedFiles
from shardctl.dtypes import nbytes
from shardctl.layout.types import Layout, LocalTensor, Piece, Shard
from shardctl.model.types import TensorInfo

# Tensors per output file, at most: each costs ~200 header bytes in a rank file (its
# safetensors entry and its DCP offsets in ``__metadata__``), and readers refuse headers over
# 16 MiB (RELIABILITY A5) — 45,000 shards in one rank file made 20 MB when ``__metadata__``
# also repeated the record's rows.
MAX_TENSORS_PER_FILE = 16384
DCP_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY
SHARDCTL_KEY = "shardctl"


@dataclass(frozen=True)
class OutputFile:
    """One output file. Its header is kept deflated (``header`` inflates it): at 90,000
    tensors the headers of all files are tens of MB raw and a few MB deflated; making them
    again instead costs ~0.5 s per 16k-tensor file. Its ``tensors`` are made when read."""

    name: str
    header_size: int
    tensors: Sequence[LocalTensor]  # a FileTensors: made when read
    size: int
    rank: int | None = None
    header_z: bytes = field(default=b"", repr=False)

    @property
    def header(self) -> bytes:
        data = zlib.decompress(self.header_z)
        assert len(data) == self.header_size, (self.name, len(data), self.header_size)
        return data

    def header_pieces(self, size: int = 2**16) -> Iterator[bytes]:
        """The header inflated ``size`` bytes at a time: a writer thread holds one piece, not
        the whole header (inflated whole there, a tp-2 split's headers kept ~10 MiB more of
        the writers' heaps resident)."""
        d = zlib.decompressobj()
        z, n = self.header_z, 0
        while not d.eof:
            piece = d.decompress(z, size)  # z empty: the output still held back, if any
            z = d.unconsumed_tail
            if not piece and not z:
                break  # a cut stream (never: the planner deflated it), caught below
            n += len(piece)
            yield piece
        assert d.eof and n == self.header_size, (self.name, n, self.header_size)


class FileTensors(Sequence[LocalTensor]):
    """A file's local tensors, each made when read from the layout's own ``Shard`` (or the
    model's ``TensorInfo``) and its begin: a ``LocalTensor`` kept per target costs ~100 bytes,
    ~20 MB at 180,000 targets, while the layout holds everything but the begins already."""

    __slots__ = ("begins", "objs", "pieces", "whole")

    def __init__(
        self,
        objs: Sequence[Shard | TensorInfo],
        begins: array[int],
        pieces: Sequence[tuple[Piece, ...]] | None,
    ) -> None:
        self.objs, self.begins, self.pieces = objs, begins, pieces
        self.whole: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[Piece, ...]]] = {}

    def __len__(self) -> int:
        return len(self.objs)

    @overload
    def __getitem__(self, i: int) -> LocalTensor: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[LocalTensor]: ...

    def __getitem__(self, i: int | slice) -> LocalTensor | Sequence[LocalTensor]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        o = self.objs[i]
        if isinstance(o, Shard):
            shape, pieces = o.local_shape, o.pieces
        else:
            shape, pieces = o.shape, (Piece((0,) * len(o.shape), o.shape, (0,) * len(o.shape)),)
        if self.pieces is not None:
            pieces = self.pieces[i]
        return LocalTensor(o.fqn, o.dtype, shape, pieces, self.begins[i])

    def __iter__(self) -> Iterator[LocalTensor]:
        for i in range(len(self.objs)):
            yield self[i]

    def fqns(self) -> list[str]:
        """Every tensor's name, in file order (no ``LocalTensor`` made)."""
        return list(map(_FQN, self.objs))

    def fields(self, i: int) -> tuple[str, str, tuple[int, ...], tuple[Piece, ...], int]:
        """Tensor ``i``'s ``(fqn, dtype, local_shape, pieces, begin)``: what ``self[i]`` holds,
        without the ``LocalTensor`` (the copy engine's short path reads 360,000 of them)."""
        o = self.objs[i]
        if self.pieces is not None:
            pieces = self.pieces[i]
            shape = o.local_shape if isinstance(o, Shard) else o.shape
        elif isinstance(o, Shard):
            shape, pieces = o.local_shape, o.pieces
        else:  # a whole tensor: one shape and pieces object per shape (the engine caches by
            # identity; each TensorInfo has its own shape tuple)
            got = self.whole.get(o.shape)
            if got is None:
                z = (0,) * len(o.shape)
                got = self.whole[o.shape] = (o.shape, (Piece(z, o.shape, z),))
            shape, pieces = got
        return o.fqn, o.dtype, shape, pieces, self.begins[i]


def _file(
    name: str,
    items: Sequence[tuple[Shard | TensorInfo, tuple[Piece, ...]]],
    metadata: Callable[[], dict[str, str]] | dict[str, str],
    rank: int | None,
) -> OutputFile:
    """A file of ``items`` (each object's local tensor, made of the given pieces)."""
    return _file_of(name, [o for o, _ in items], metadata, rank, [p for _, p in items])


_FQN = attrgetter("fqn")


def _sizes(objs: Sequence[Shard | TensorInfo]) -> list[int]:
    """Each object's local tensor bytes, computed once per distinct ``(dtype, shape)`` (one
    C-level map over the columns: 90,000 experts share a handful)."""
    return list(map(_Bytes().__getitem__, zip(map(_DTYPE, objs), _shapes(objs), strict=True)))


def _shapes(objs: Sequence[Shard | TensorInfo]) -> list[tuple[int, ...]]:
    """Each object's local shape: a shard's ``local_shape``, a whole tensor's ``shape``."""
    if all(map(isinstance, objs, repeat(Shard))):
        return list(map(_LOCAL, objs))
    if all(map(isinstance, objs, repeat(TensorInfo))):
        return list(map(_SHAPE, objs))
    return [o.local_shape if isinstance(o, Shard) else o.shape for o in objs]


class _Bytes(dict[tuple[str, tuple[int, ...]], int]):
    """``(dtype, shape) -> bytes``, each computed on its first lookup."""

    def __missing__(self, key: tuple[str, tuple[int, ...]]) -> int:
        n = self[key] = nbytes(key[0], math.prod(key[1]))
        return n


_DTYPE, _LOCAL, _SHAPE = attrgetter("dtype"), attrgetter("local_shape"), attrgetter("shape")


def _file_of(
    name: str,
    objs: Sequence[Shard | TensorInfo],
    metadata: Callable[[], dict[str, str]] | dict[str, str],
    rank: int | None,
    pieces: Sequence[tuple[Piece, ...]] | None = None,
    sizes: list[int] | None = None,
    deflate: Callable[[bytes], bytes] = lambda header: zlib.compress(header, 1),
) -> OutputFile:
    """A file of ``objs``: shards with their own pieces, whole tensors, or ``pieces``;
    ``sizes``: their byte sizes when the caller has them already; ``deflate``: the header's
    ``header_z`` (see :class:`Deflater`).

    One pass, little per-object Python: a tensor's byte size is computed once per distinct
    ``(dtype, shape)`` (90,000 experts share a handful), and the header is built as text
    (:func:`~shardctl.checkpoint.plan_header.header_text`, the bytes ``header_bytes`` makes)."""
    meta = metadata if callable(metadata) else (lambda: metadata)
    shapes = _shapes(objs)
    if sizes is None:
        sizes = _sizes(objs)
    ends = list(accumulate(sizes))
    header = header_text(list(map(_FQN, objs)), list(map(_DTYPE, objs)), shapes, ends, meta())
    base = len(header)
    # tensor i begins where tensor i-1 ends, the first right after the header
    begins = array("q", accumulate(sizes[:-1], initial=base) if sizes else ())
    end = base + (ends[-1] if ends else 0)
    return OutputFile(name, base, FileTensors(objs, begins, pieces), end, rank, deflate(header))


class Deflater:
    """Headers deflated on a second thread while the planner builds the next file's in Python
    (``zlib.compress`` releases the GIL): 0.1 s of a 90,000-tensor split's planning moved off
    its critical path. Pass the object as ``deflate`` (each header's ``header_z`` is left
    empty), then :meth:`files` fills them in::

        with Deflater() as deflate:
            files = [_file_of(..., deflate=deflate) for ...]
        files = deflate.files(files)
    """

    def __enter__(self) -> Deflater:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardctl-deflate")
        self.pending: list[Future[bytes]] = []
        return self

    def __call__(self, header: bytes) -> bytes:
        self.pending.append(self.pool.submit(zlib.compress, header, 1))
        return b""  # filled in by files()

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(cancel_futures=True)

    def files(self, files: list[OutputFile]) -> list[OutputFile]:
        """``files`` (made with this object as ``deflate``, in order) with their headers."""
        return [replace(f, header_z=z.result()) for f, z in zip(files, self.pending, strict=True)]


def _parts(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Greedy ``[start, end)`` runs with byte sums <= limit (a lone item may exceed it) and at
    most ``MAX_TENSORS_PER_FILE`` items."""
    runs: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (acc + n > limit or i - start >= MAX_TENSORS_PER_FILE):
            runs.append((start, i))
            start, acc = i, 0
        acc += n
    runs.append((start, len(sizes)))
    return runs


def _rank_meta(
    layout: Layout, i: int, name: str, part: Sequence[Shard]
) -> Callable[[], dict[str, str]]:
    """The ``__metadata__`` of rank ``i``'s file ``name``: which rank it is and where its
    layout is (the record, ``shardctl.layout.json``, beside it). The shards' pieces are in the
    record only: repeated here they were ~8 MB of JSON per 16k-tensor file (one-piece shards
    are still described to torch DCP by ``DCP_SHARDING_INFO``)."""

    def make() -> dict[str, str]:
        rl = layout.ranks[i]
        meta = {
            "format": "pt",
            SHARDCTL_KEY: json.dumps(
                {
                    "schema": SCHEMA,
                    "rank": i,
                    "coord": {"pp": rl.pp, "ep": rl.ep, "tp": rl.tp},
                    "mesh": layout.mesh.as_dict(),
                    "record": RECORD_NAME,
                    "tensors": len(part),
                },
                separators=(",", ":"),
            ),
        }
        if _all_rectangular(part):
            # torch DCP's HuggingFaceStorageReader: global size = max(offset + shape)
            meta[DCP_KEY] = saved_offsets_json(
                [s.fqn for s in part], [s.pieces[0].offsets for s in part]
            )
        return meta

    return make


def _all_rectangular(part: Sequence[Shard]) -> bool:
    """``all(s.is_rectangular for s in part)``, decided once per distinct ``(local_shape,
    pieces)``: the layout shares one pieces tuple among every shard of a split. The distinct
    ones are found by identity in one C-level pass (the objects stay alive in ``part``, so an
    id stays theirs)."""
    ids = zip(map(id, map(_LOCAL, part)), map(id, map(_PIECES, part)), strict=True)
    return all(s.is_rectangular for s in dict(zip(ids, part, strict=True)).values())


_PIECES = attrgetter("pieces")


def rank_files(
    layout: Layout, order: dict[str, int], max_shard_size: int
) -> tuple[list[OutputFile], Mapping[tuple[int, str], str]]:
    """Per-rank files; also ``(rank, fqn) -> file name`` for the record."""
    files: list[OutputFile] = []
    placed: list[tuple[list[int], list[int], list[str]]] = []  # per rank: PlannedFiles' input
    with Deflater() as deflate:
        for i in range(len(layout.ranks)):
            placed.append(_rank_files(layout, i, order, max_shard_size, deflate, files))
        files = deflate.files(files)
    # (rank, fqn) -> name as a dict was ~110 B a shard (40 MB at 360,000): see PlannedFiles
    return files, PlannedFiles(order, placed)


def _rank_files(
    layout: Layout,
    i: int,
    order: dict[str, int],
    max_shard_size: int,
    deflate: Callable[[bytes], bytes],
    files: list[OutputFile],
) -> tuple[list[int], list[int], list[str]]:
    """Rank ``i``'s files, appended to ``files``; its entry of ``PlannedFiles``: its shards'
    positions in ``order``, each file's first shard and the files' names."""
    rl = layout.ranks[i]
    keys = list(map(order.__getitem__, map(_FQN, rl.shards)))
    if all(map(operator.lt, keys, keys[1:])):
        shards = list(rl.shards)  # build_layout appends in model order: nothing to sort
    else:
        shards = sorted(rl.shards, key=lambda s: order[s.fqn])
        keys = sorted(keys)
    sizes = _sizes(shards)
    runs = _parts(sizes, max_shard_size) if shards else [(0, 0)]
    base = f"rank-{i:05d}-of-{len(layout.ranks):05d}"
    names: list[str] = []
    for k, (a, b) in enumerate(runs):
        name = f"{base}.safetensors"
        if len(runs) > 1:
            name = f"{base}.part-{k + 1:05d}-of-{len(runs):05d}.safetensors"
        names.append(name)
        part = shards[a:b]
        meta = _rank_meta(layout, i, name, part)
        files.append(_file_of(name, part, meta, i, sizes=sizes[a:b], deflate=deflate))
    return keys, [a for a, _ in runs], names


def hf_files(
    tensors: Sequence[TensorInfo], max_shard_size: int
) -> tuple[list[OutputFile], bytes | None]:
    """Whole tensors in HF files (in the given order); the index bytes when there are several."""
    sizes = _sizes(tensors)
    runs = _parts(sizes, max_shard_size)
    files: list[OutputFile] = []
    weight_map: dict[str, str] = {}
    with Deflater() as deflate:
        for k, (a, b) in enumerate(runs):
            name = (
                "model.safetensors"
                if len(runs) == 1
                else f"model-{k + 1:05d}-of-{len(runs):05d}.safetensors"
            )
            part = tensors[a:b]
            meta = {"format": "pt"}
            files.append(_file_of(name, part, meta, None, sizes=sizes[a:b], deflate=deflate))
            weight_map.update(zip(map(_FQN, part), repeat(name)))
        files = deflate.files(files)
    if len(files) == 1:
        return files, None
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    return files, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
