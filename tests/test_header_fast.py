"""The fast path of the header reader (``shardctl/io/header_fast.py``) must decide exactly as
the strict reader: the same entries for every header it takes, and no header taken that the
strict reader refuses (it hands those over, and the strict reader words the error)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from shardctl.errors import InvalidInputError
from shardctl.io import safetensors_header as sh
from shardctl.io.header_fast import fast_entries
from shardctl.io.header_raw import decode_json


def _compact(text: str) -> bytes:
    raw = text.encode()
    return raw + b" " * (-len(raw) % 8)


def _outcome(raw: bytes, size: int) -> Any:
    try:
        return sh.parse_header(raw, path=Path("mem"), file_size=size)
    except InvalidInputError as exc:
        return ("refused", exc.message)


def _fast(raw: bytes, size: int) -> Any:
    """The fast path's answer, None when the parse itself refuses (NUL, NaN, not UTF-8)."""
    try:
        pairs = decode_json(raw, "mem")
    except InvalidInputError:
        return None
    return fast_entries(pairs, 8 + len(raw), size)


def _strict(raw: bytes, size: int) -> Any:
    real = sh.fast_entries
    sh.fast_entries = lambda *a: None  # type: ignore[assignment]
    try:
        return _outcome(raw, size)
    finally:
        sh.fast_entries = real


def test_a_file_written_by_safetensors_takes_the_fast_path() -> None:
    tensors = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "v": np.ones(3, dtype=np.float16),
        "é": np.zeros((0,), dtype=np.int64),
        "s": np.array(7, dtype=np.int8),
        "q": np.zeros((2, 0, 3), dtype=np.uint8),
    }
    blob = save(tensors, metadata={"format": "pt", "k": 'a "quoted" value'})
    n = int.from_bytes(blob[:8], "little")
    raw = blob[8 : 8 + n]
    assert _fast(raw, len(blob)) is not None
    assert _outcome(raw, len(blob)) == _strict(raw, len(blob))


ENTRY = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


@pytest.mark.parametrize(
    "text,data,fragment",
    [
        (f'{{"a":{ENTRY},"a":{ENTRY}}}', 8, "duplicate tensor name 'a'"),
        (f'{{"a":{{}},"a":{ENTRY}}}', 4, "tensor 'a': missing 'dtype'"),
        (f'{{"a":1,"a":{ENTRY}}}', 4, "tensor 'a': expected an object"),
        (
            '{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            4,
            "duplicate field 'dtype'",
        ),
        (f'{{"__metadata__":{{"k":"1"}},"__metadata__":{{"k":"1"}},"a":{ENTRY}}}', 4, "duplicate"),
        (f'{{"__metadata__":{{"k":"1","k":"1"}},"a":{ENTRY}}}', 4, "duplicate key 'k'"),
        (
            '{"__metadata__":{"dtype":"F32","shape":"1","data_offsets":"0"}}',
            0,
            "reserves",
        ),
        (
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":NaN}}',
            4,
            "non-finite",
        ),
        ('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', 4, "shape"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8, "gap"),
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', 4, "needs 8 bytes"),
        ('{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, "empty tensor name"),
        ('{"__metadata__":null}', 0, "__metadata__"),
        ('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, "surrogate"),
        (
            '{"a":{"shape":[1],"dtype":"F32","data_offsets":[0,4]},"b":{"dtype":"F32"}}',
            4,
            "missing 'shape'",
        ),
    ],
)
def test_what_the_strict_reader_refuses_the_fast_path_hands_over(
    text: str, data: int, fragment: str
) -> None:
    raw = _compact(text)
    size = 8 + len(raw) + data
    assert _fast(raw, size) is None
    with pytest.raises(InvalidInputError, match=fragment):
        sh.parse_header(raw, path=Path("mem"), file_size=size)


_DTYPES = {"F32": 4, "BF16": 2, "U8": 1, "F64": 8, "I32": 4}


@st.composite
def _headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A compact header, valid or nudged into an invalid one (gap, overlap, wrong size,
    duplicate, odd field), entries in file order or shuffled."""
    n = draw(st.integers(0, 6))
    names = draw(st.lists(st.text("abc.", min_size=1, max_size=3), min_size=n, max_size=n))
    entries: list[tuple[str, dict[str, Any]]] = []
    cursor = 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(_DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = _DTYPES[dtype] * int(np.prod(shape, dtype=np.int64))
        entries.append(
            (name, {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]})
        )
        cursor += nbytes
    fault = draw(st.sampled_from(["none", "none", "shuffle", "gap", "size", "dup", "field"]))
    if entries and fault == "shuffle":
        entries = draw(st.permutations(entries))
    elif entries and fault == "gap":
        entries[-1][1]["data_offsets"][0] += 1
    elif entries and fault == "size":
        entries[0][1]["shape"] = [*entries[0][1]["shape"], 2]
    elif entries and fault == "dup":
        entries.append(entries[0])
    elif entries and fault == "field":
        entries[0][1]["x"] = draw(st.sampled_from([1, 1.5, "y", None]))
    parts = [
        f"{json.dumps(k, ensure_ascii=False)}:{json.dumps(v, separators=(',', ':'))}"
        for k, v in entries
    ]
    if draw(st.booleans()):
        parts.insert(0, '"__metadata__":{"format":"pt"}')
    raw = _compact("{" + ",".join(parts) + "}")
    return raw, 8 + len(raw) + cursor + draw(st.sampled_from([0, 0, 0, 1]))


@settings(max_examples=300, deadline=None)
@given(_headers())
def test_fast_and_strict_decide_alike(case: tuple[bytes, int]) -> None:
    raw, size = case
    assert _outcome(raw, size) == _strict(raw, size)
