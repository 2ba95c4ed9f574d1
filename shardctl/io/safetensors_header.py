"""A hardened safetensors header reader (and a header builder for writers); never reads data.

File layout::

    [8 bytes: N, u64 little-endian][N bytes: JSON header][data region]

    {"__metadata__": {"format": "pt"},
     "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}, ...}

``data_offsets`` are relative to the data region, which starts at ``8 + N``.

:func:`read_header` opens with ``os.open(O_RDONLY | O_NONBLOCK)`` and reads with ``os.pread``
(never mmap, so a truncated file is an error, not SIGBUS), and refuses non-regular files (FIFO,
directory, device) from ``fstat`` before reading a byte, so a FIFO cannot block. It refuses, with
:class:`~shardctl.errors.InvalidInputError` (exit 3) naming the file (reliability cases A1–A12):

- files under 8 bytes; a header length past the end of the file or above ``max_header_bytes``
  (checked before any allocation);
- headers that are not UTF-8, not JSON, not an object, hold NUL bytes (e.g. NUL padding),
  nest too deep, or spell ``NaN`` / ``Infinity``; duplicate keys anywhere (duplicate tensor
  names, duplicate ``__metadata__``, duplicate fields): JSON would silently keep the last;
- ``__metadata__`` that is not a string → string map;
- empty tensor names, and a tensor named ``__metadata__`` (reserved by the format);
- unknown dtypes; shapes that are not lists of non-negative integers; ``data_offsets`` that are
  not exactly two non-negative integers ``begin <= end`` (bools and floats refused);
- dtype × shape ≠ ``end - begin`` bytes;
- offsets that do not tile the data region exactly: overlaps, aliases (two tensors sharing
  bytes), gaps, offsets past the end of the file (truncation) or bytes after the last tensor
  (trailing garbage).

Accepted, as the safetensors library accepts them: whitespace before ``{`` (and after ``}``),
unknown fields in a tensor's info (ignored), and a header length that is not a multiple of 8.
Tensor names are never used as paths.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from pathlib import Path
from typing import Any

from shardctl.columns import from_columns
from shardctl.dtypes import DTYPE_BITS
from shardctl.errors import InvalidInputError
from shardctl.io.header_fast import fast_entries
from shardctl.io.header_raw import JsonObject, decode_json, json_type, read_raw, short
from shardctl.io.header_scan import scan_entries

DEFAULT_MAX_HEADER_BYTES = 16 * 2**20
# The largest limit ``--max-header-bytes`` may set: a legal 72 MB header already costs ~18 s and
# ~1 GiB to open; above 1 GiB nothing legitimate is left.
MAX_HEADER_LIMIT = 2**30
_limit = [DEFAULT_MAX_HEADER_BYTES]


@contextmanager
def header_limit(max_header_bytes: int | None) -> Iterator[None]:
    """``--max-header-bytes``: raise the header cap for every read in this block (one CLI call).

    A process-wide setting rather than a parameter threaded through every reader: the cap
    guards every header shardctl opens (inputs, outputs, verify's), and the CLI sets it once."""
    if max_header_bytes is None:
        yield
        return
    if not 8 <= max_header_bytes <= MAX_HEADER_LIMIT:
        from shardctl.errors import UsageError

        raise UsageError(
            f"--max-header-bytes: {max_header_bytes} is out of range [8, {MAX_HEADER_LIMIT}]"
        )
    old = _limit[0]
    _limit[0] = max_header_bytes
    try:
        yield
    finally:
        _limit[0] = old


METADATA_KEY = "__metadata__"
MAX_DIMS = 64  # torch refuses tensors of more dimensions


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor's header record; ``begin``/``end`` are relative to the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


EntryColumns = tuple[
    tuple[str, ...], tuple[str, ...], tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]
]
"""A header's entries as columns: names, dtypes, shapes, begins, ends (file order)."""
NO_ENTRIES: EntryColumns = ((), (), (), (), ())


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: its entries in file order (by ``begin``, then ``end``), as columns.

    ``tensors`` (one :class:`HeaderEntry` each) is built on first use: ``plan`` and
    ``inspect`` read the columns only (90,000 entries are ~40 ms to build)."""

    path: Path
    header_len: int
    data_offset: int  # 8 + header_len: where the data region starts in the file
    file_size: int
    metadata: dict[str, str] | None
    columns: EntryColumns

    @cached_property
    def tensors(self) -> tuple[HeaderEntry, ...]:
        return tuple(_entry_columns(*self.columns))

    @property
    def names(self) -> tuple[str, ...]:
        return self.columns[0]

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.columns[1]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.columns[2]

    @property
    def begins(self) -> tuple[int, ...]:
        """Each entry's first byte in the data region (``data_offset`` onwards)."""
        return self.columns[3]

    @property
    def ends(self) -> tuple[int, ...]:
        return self.columns[4]

    @property
    def data_bytes(self) -> int:
        """The bytes its entries span (their ends less their begins, summed in C)."""
        return sum(self.ends) - sum(self.begins)

    def entry(self, name: str) -> HeaderEntry:
        for e in self.tensors:
            if e.name == name:
                return e
        raise KeyError(name)


_FIELDS = ("name", "dtype", "shape", "begin", "end")


def _columns(entries: list[HeaderEntry]) -> EntryColumns:
    """The columns of ``entries`` (see :data:`EntryColumns`)."""
    return tuple(tuple(map(attrgetter(f), entries)) for f in _FIELDS)  # type: ignore[return-value]


def _entries(rows: list[tuple[str, str, tuple[int, ...], int, int]]) -> list[HeaderEntry]:
    """Entries of rows checked already (see :func:`_entry_columns`)."""
    if not rows:
        return []
    return _entry_columns(*map(list, zip(*rows, strict=True)))


def _entry_columns(*columns: Sequence[Any]) -> list[HeaderEntry]:
    """Entries of columns (names, dtypes, shapes, begins, ends) checked already, built by
    :func:`~shardctl.columns.from_columns` (the frozen ``__init__``'s five
    ``object.__setattr__`` calls each were 0.5 s at 90,000 tensors). Slots: ~70 B an entry
    instead of ~170 with a ``__dict__``."""
    return from_columns(HeaderEntry, len(columns[0]), **dict(zip(_FIELDS, columns, strict=True)))


def read_header(path: Path, *, max_header_bytes: int | None = None) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``; reads no tensor data.

    ``max_header_bytes``: default the current limit (16 MiB, or ``--max-header-bytes``)."""
    if max_header_bytes is None or max_header_bytes == DEFAULT_MAX_HEADER_BYTES:
        max_header_bytes = _limit[0]
    path = Path(path)
    raw, file_size = read_raw(path, max_header_bytes)
    return parse_header(raw, path=path, file_size=file_size)


def parse_header(raw: bytes, *, path: Path, file_size: int) -> SafetensorsHeader:
    """Validate the JSON header bytes ``raw`` of a file of ``file_size`` bytes."""
    where = str(path)

    def header(metadata: dict[str, str] | None, columns: EntryColumns) -> SafetensorsHeader:
        return SafetensorsHeader(
            path=path,
            header_len=len(raw),
            data_offset=8 + len(raw),
            file_size=file_size,
            metadata=metadata,
            columns=columns,
        )

    def of_entries(
        metadata: dict[str, str] | None, entries: list[HeaderEntry]
    ) -> SafetensorsHeader:
        made = header(metadata, _columns(entries))
        made.__dict__["tensors"] = tuple(entries)  # built already: the cached property's value
        return made

    scanned = scan_entries(raw, 8 + len(raw), file_size)
    if scanned is not None:  # a canonical header, read as text columns
        return header(scanned[0], tuple(map(tuple, scanned[1:])))  # type: ignore[arg-type]
    pairs = decode_json(raw, where)
    fast = fast_entries(pairs, 8 + len(raw), file_size)
    if fast is not None:
        return of_entries(fast[0], _entries(fast[1]))
    metadata: dict[str, str] | None = None
    seen_metadata = False
    names: set[str] = set()
    entries: list[HeaderEntry] = []
    for name, info in pairs:
        if name == METADATA_KEY:
            if seen_metadata:
                raise InvalidInputError(f"duplicate {METADATA_KEY!r} key in header", where=where)
            seen_metadata = True
            metadata = _metadata(info, where)
            continue
        if name in names:
            raise InvalidInputError(
                f"duplicate tensor name {name!r} in header",
                where=where,
                hint="the file is corrupt or hand-made; JSON would silently keep the last",
            )
        names.add(name)
        entries.append(_entry(name, info, where))
    data_offset = 8 + len(raw)
    entries.sort(key=lambda e: (e.begin, e.end))
    _check_tiling(entries, data_offset, file_size, where)
    return of_entries(metadata, entries)


def _metadata(info: Any, where: str) -> dict[str, str]:
    if not isinstance(info, JsonObject):
        raise InvalidInputError(
            f"{METADATA_KEY!r} must be an object of strings, got {json_type(info)}", where=where
        )
    keys = {k for k, _ in info}
    if {"dtype", "shape", "data_offsets"} <= keys:
        raise InvalidInputError(
            f"a tensor is named {METADATA_KEY!r}, which the safetensors format reserves",
            where=where,
            hint="rename the tensor",
        )
    out: dict[str, str] = {}
    for key, value in info:
        if key in out:
            raise InvalidInputError(f"duplicate key {key!r} in {METADATA_KEY!r}", where=where)
        if not isinstance(value, str):
            raise InvalidInputError(
                f"{METADATA_KEY}[{key!r}]: expected a string, got {json_type(value)}",
                where=where,
            )
        out[key] = value
    return out


def _entry(name: str, info: Any, where: str) -> HeaderEntry:
    if name == "":
        raise InvalidInputError("empty tensor name in header", where=where)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # JSON "\ud800" decodes to a lone surrogate: no file format or terminal can hold it.
        raise InvalidInputError(
            f"tensor name {name!r} is not valid Unicode (a lone surrogate)", where=where
        ) from None
    at = f"tensor {name!r}"
    if not isinstance(info, JsonObject):
        raise InvalidInputError(f"{at}: expected an object, got {json_type(info)}", where=where)
    fields: dict[str, Any] = {}
    for key, value in info:
        if key in fields:
            raise InvalidInputError(f"{at}: duplicate field {key!r}", where=where)
        fields[key] = value  # unknown fields are accepted and ignored, as safetensors does
    for key in ("dtype", "shape", "data_offsets"):
        if key not in fields:
            raise InvalidInputError(f"{at}: missing {key!r}", where=where)
    dtype = fields["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise InvalidInputError(
            f"{at}: unknown dtype {dtype!r}",
            where=where,
            hint=f"known: {', '.join(DTYPE_BITS)}",
        )
    shape = fields["shape"]
    if isinstance(shape, list) and len(shape) > MAX_DIMS:
        raise InvalidInputError(
            f"{name!r}: {len(shape)} dimensions, above the limit of {MAX_DIMS} (torch's own)",
            where=where,
        )
    if not isinstance(shape, list) or not _all_nonneg_ints(shape):
        raise InvalidInputError(
            f"{at}: shape must be a list of non-negative integers, got {short(shape)}",
            where=where,
        )
    offsets = fields["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not _all_nonneg_ints(offsets):
        raise InvalidInputError(
            f"{at}: data_offsets must be [begin, end], two non-negative integers, "
            f"got {short(offsets)}",
            where=where,
        )
    begin, end = offsets
    if begin > end:
        raise InvalidInputError(
            f"{at}: data_offsets [{begin}, {end}] end before they begin", where=where
        )
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    if bits != 8 * (end - begin):
        need = f"{bits // 8}" if bits % 8 == 0 else f"{bits / 8}"
        raise InvalidInputError(
            f"{at}: {dtype} {list(shape)} needs {need} bytes, "
            f"data_offsets [{begin}, {end}] span {end - begin}",
            where=where,
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def _check_tiling(entries: list[HeaderEntry], data_offset: int, file_size: int, where: str) -> None:
    """Sorted entries must cover ``[0, data size)`` exactly once: no overlap, gap or tail."""
    expected = data_offset + max((e.end for e in entries), default=0)
    if expected != file_size:
        raise InvalidInputError(
            f"truncated or trailing bytes (header expects {expected}, file has {file_size})",
            where=where,
            hint="re-download or re-copy the file",
        )
    cursor = 0
    prev: HeaderEntry | None = None
    for e in entries:
        if e.begin < cursor:
            assert prev is not None
            raise InvalidInputError(
                f"tensors {prev.name!r} [{prev.begin}, {prev.end}] and {e.name!r} "
                f"[{e.begin}, {e.end}] overlap",
                where=where,
            )
        if e.begin > cursor:
            raise InvalidInputError(
                f"gap in the data region: bytes [{cursor}, {e.begin}) belong to no tensor "
                f"(next is {e.name!r})",
                where=where,
            )
        cursor = e.end
        prev = e


def header_bytes(
    entries: Iterable[HeaderEntry], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The first ``data_offset`` bytes of a safetensors file holding ``entries``, in that order.

    As safetensors writes it: compact JSON, ``__metadata__`` first (keys sorted here, for
    reproducible bytes; safetensors' own order is arbitrary), padded with spaces to a multiple
    of 8, behind its u64 little-endian length. Entries must tile ``[0, total)`` in order::

        >>> header_bytes([HeaderEntry("w", "F32", (2,), 0, 8)])[8:]
        b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}     '
    """
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj[METADATA_KEY] = {k: metadata[k] for k in sorted(metadata)}
    cursor = 0
    for e in entries:
        assert e.name and e.name != METADATA_KEY and e.name not in obj, e.name
        assert e.begin == cursor and e.end >= e.begin, f"{e.name}: offsets do not tile"
        assert DTYPE_BITS[e.dtype] * math.prod(e.shape) == 8 * e.nbytes, e.name
        obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        cursor = e.end
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _all_nonneg_ints(values: list[Any]) -> bool:
    for v in values:
        if type(v) is not int or v < 0:
            return False
    return True
