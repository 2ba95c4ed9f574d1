"""The raw half of the safetensors header reader: bytes off the disk, then strict JSON.

:func:`read_raw` opens with ``os.open(O_RDONLY | O_NONBLOCK)``, refuses non-regular files from
``fstat`` before reading a byte, checks the u64 length field against the file size and the cap,
and ``pread``s the header bytes (never mmap). :func:`decode_json` turns them into nested
:class:`JsonObject` pair lists, so duplicate keys survive for the checks in
:mod:`shardctl.io.safetensors_header`, which knows what a tensor entry is; this module does not.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError


class JsonObject(list[tuple[str, Any]]):
    """A JSON object kept as its key/value pairs, so duplicates survive parsing."""


class _Refused(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"non-finite number {name}")


def read_raw(path: Path, max_header_bytes: int) -> tuple[bytes, int]:
    """The JSON header bytes of the file at ``path`` and its size; checks only the
    file kind and the length field (at most ``max_header_bytes``), reads no data."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidInputError("file not found", where=where) from None
    except PermissionError as exc:
        raise EnvironmentFailure(f"cannot open: {exc.strerror}", where=where) from None
    except OSError as exc:  # ENXIO (socket), ELOOP, ...
        raise InvalidInputError(f"cannot open: {exc.strerror}", where=where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(
                f"not a regular file ({_kind(st.st_mode)})",
                where=where,
                hint="pass a safetensors file, not a FIFO, directory or device",
            )
        file_size = st.st_size
        if file_size < 8:
            raise InvalidInputError(
                f"not a safetensors file (too small: {file_size} bytes, need at least 8)",
                where=where,
            )
        header_len = int.from_bytes(pread_exact(fd, 8, 0, where), "little")
        if header_len > max_header_bytes:
            raise InvalidInputError(
                f"header exceeds shardctl limit ({_mib(max_header_bytes)}): "
                f"header length field says {header_len} bytes",
                where=where,
                hint="pass --max-header-bytes N (reshard, verify, inspect) if the file is trusted",
            )
        if 8 + header_len > file_size:
            raise InvalidInputError(
                f"header length {header_len} runs past the end of the file "
                f"({file_size} bytes): truncated or not a safetensors file",
                where=where,
            )
        raw = pread_exact(fd, header_len, 8, where)
    finally:
        os.close(fd)
    return raw, file_size


def decode_json(raw: bytes, where: str) -> JsonObject:
    """Strict UTF-8 JSON → the top-level object's pairs (nested objects are ``JsonObject`` too)."""
    if b"\x00" in raw:
        raise InvalidInputError("header holds NUL bytes (corrupt or NUL-padded)", where=where)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(
            f"header is not valid UTF-8 (byte {exc.start} of the header)", where=where
        ) from None
    try:
        value = json.loads(text, object_pairs_hook=JsonObject, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidInputError("header JSON nests too deeply", where=where) from None
    except _Refused as exc:
        raise InvalidInputError(f"header is not strict JSON: {exc}", where=where) from None
    except ValueError as exc:  # JSONDecodeError, or an integer literal too long to convert
        raise InvalidInputError(f"header is not valid JSON: {exc}", where=where) from None
    if not isinstance(value, JsonObject):
        raise InvalidInputError(
            f"header is not a JSON object (got {json_type(value)})", where=where
        )
    return value


def pread_exact(fd: int, n: int, offset: int, where: str) -> bytes:
    """``n`` bytes at ``offset``: one ``pread`` of them all, more only after a short read (an
    11 MB header in 1 MiB reads, joined, took twice as long and twice the memory)."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise InvalidInputError(
                f"file ended at byte {offset + got} while reading {n} bytes at {offset} "
                "(changed while reading?)",
                where=where,
            )
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def json_type(v: Any) -> str:
    if isinstance(v, JsonObject):
        return "object"
    if isinstance(v, list):
        return "array"
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    return "string"


def short(v: Any) -> str:
    text = repr(list(v) if isinstance(v, JsonObject) else v)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def _mib(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"
