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
from shardctl.io.header_scan import scan_entries


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
    real, scan = sh.fast_entries, sh.scan_entries
    sh.fast_entries = lambda *a: None  # type: ignore[assignment]
    sh.scan_entries = lambda *a: None  # type: ignore[assignment]
    try:
        return _outcome(raw, size)
    finally:
        sh.fast_entries, sh.scan_entries = real, scan


def _no_scan(raw: bytes, size: int) -> Any:
    """The reader without the text scanner (the pair-list fast path and the strict reader)."""
    scan = sh.scan_entries
    sh.scan_entries = lambda *a: None  # type: ignore[assignment]
    try:
        return _outcome(raw, size)
    finally:
        sh.scan_entries = scan


def _written_tensors() -> dict[str, np.ndarray]:
    """A few tensors safetensors writes: a non-ASCII name, a scalar, empty shapes."""
    return {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "v": np.ones(3, dtype=np.float16),
        "é": np.zeros((0,), dtype=np.int64),
        "s": np.array(7, dtype=np.int8),
        "q": np.zeros((2, 0, 3), dtype=np.uint8),
    }


def test_a_file_written_by_safetensors_takes_the_fast_path() -> None:
    tensors = _written_tensors()
    blob = save(tensors, metadata={"format": "pt", "k": 'a "quoted" value'})
    n = int.from_bytes(blob[:8], "little")
    raw = blob[8 : 8 + n]
    assert _fast(raw, len(blob)) is not None
    assert _outcome(raw, len(blob)) == _strict(raw, len(blob))
    # the escaped quote in the metadata is not for the text scanner: it hands the header over
    assert scan_entries(raw, 8 + len(raw), len(blob)) is None


def test_a_plain_safetensors_file_takes_the_text_scanner() -> None:
    tensors = _written_tensors()
    for metadata in ({"format": "pt"}, None):
        blob = save(tensors, metadata=metadata)
        n = int.from_bytes(blob[:8], "little")
        raw = blob[8 : 8 + n]
        assert scan_entries(raw, 8 + len(raw), len(blob)) is not None
        taken = _outcome(raw, len(blob))
        assert taken == _strict(raw, len(blob)) == _no_scan(raw, len(blob))
        assert sorted(e.name for e in taken.tensors) == sorted(tensors)
        assert [(e.begin, e.end) for e in taken.tensors] == sorted(
            (e.begin, e.end) for e in taken.tensors
        )


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
    assert scan_entries(raw, 8 + len(raw), size) is None
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
    assert _outcome(raw, size) == _strict(raw, size) == _no_scan(raw, size)


E4 = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
E8 = '{"dtype":"F32","shape":[1],"data_offsets":[4,8]}'


@pytest.mark.parametrize(
    "text,data",
    [
        (f'{{"a":{E4},"b":{E8}}}', 8),  # the canonical form: taken (the control case)
        (f'{{"a":{E4}{{"b":{E8}}}', 8),  # no comma between entries
        (f'{{"a":{E4},,"b":{E8}}}', 8),  # two commas
        (f'{{"a":{E4},x"b":{E8}}}', 8),  # junk between entries
        (f'{{"a":{E4}, "b":{E8}}}', 8),  # whitespace between entries
        (f' {{"a":{E4},"b":{E8}}}', 8),  # whitespace before the object
        (f'{{"a":{E4},"b":{E8}}}}}', 8),  # a brace too many
        (f'{{"a":{E4},"b":{E8}', 8),  # no closing brace
        (f'{{"a":{E4},"b":{E8}}} x', 8),  # text after the object
        (f'{{"a":{E4},"a":{E8}}}', 8),  # duplicate name
        (f'{{"a":{E4},"__metadata__":{E8}}}', 8),  # a tensor named __metadata__
        (f'{{"__metadata__":{{"k":"1"}},"__metadata__":{E4}}}', 4),
        (f'{{"__metadata__":{{"k":"1","k":"2"}},"a":{E4}}}', 4),  # duplicate metadata key
        (f'{{"__metadata__":{{"k":"1"}}"a":{E4}}}', 4),  # no comma after the metadata
        (f'{{"__metadata__":{{"k":"1"}},{{"a":{E4}}}', 4),  # a brace for a comma
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,04]}}', 4),  # leading zero
        ('{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}', 4),
        ('{"a":{"dtype":"F32","shape":[1,],"data_offsets":[0,4]}}', 4),  # trailing comma
        ('{"a":{"dtype":"F32","shape":[,1],"data_offsets":[0,4]}}', 4),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', 4),  # a float
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}', 4),  # end before begin
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', 4),  # wrong size
        ('{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,4]}}', 4),  # unknown dtype
        (r'{"a\u0062":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),  # escapes
        (r'{"a\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
        (r'{"a\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
        (r'{"a\tb":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
        ('{"a\tb":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),  # a raw tab
        (r'{"a\"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
        (
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],'
            '"data_offsets":[0,4]}}',
            4,
        ),  # aliases
        (f'{{"b":{E8},"a":{E4}}}', 8),  # out of file order (legal: sorted)
        (f'{{"a":{E4},"b":{E8}}}', 12),  # trailing bytes
        (f'{{"a":{E4},"b":{E8}}}', 4),  # truncated
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', 4),  # unknown field
        ('{"a":{"shape":[1],"dtype":"F32","data_offsets":[0,4]}}', 4),  # another key order
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}\t', 4),  # JSON space after
    ],
)
def test_the_text_scanner_takes_only_what_the_strict_reader_takes_alike(
    text: str, data: int
) -> None:
    raw = _compact(text)
    size = 8 + len(raw) + data
    scanned = scan_entries(raw, 8 + len(raw), size)
    strict = _strict(raw, size)
    if scanned is not None:
        assert _outcome(raw, size) == strict  # taken: the same entries
        assert not isinstance(strict, tuple)
    assert _outcome(raw, size) == strict


def test_the_scanner_takes_canonical_headers_with_or_without_metadata() -> None:
    for text, data in ((f'{{"a":{E4},"b":{E8}}}', 8), (f'{{"b":{E8},"a":{E4}}}', 8)):
        for meta in ("", '"__metadata__":{"format":"pt","k":"v"},'):
            raw = _compact(text[:1] + meta + text[1:])
            size = 8 + len(raw) + data
            scanned = scan_entries(raw, 8 + len(raw), size)
            assert scanned is not None
            assert scanned[1] == ["a", "b"]  # file order
            assert scanned[0] == ({"format": "pt", "k": "v"} if meta else None)


def test_a_checkpoint_written_by_save_pretrained_takes_the_text_scanner() -> None:
    """examples/tiny-llama is transformers' own ``save_pretrained`` output."""
    from shardctl.io.header_raw import read_raw

    path = Path(__file__).resolve().parent.parent / "examples/tiny-llama/model.safetensors"
    raw, size = read_raw(path, sh.DEFAULT_MAX_HEADER_BYTES)
    scanned = scan_entries(raw, 8 + len(raw), size)
    assert scanned is not None and len(scanned[1]) > 10
    assert _outcome(raw, size) == _strict(raw, size)


def _scan_in_chunks(raw: bytes, size: int, chars: int) -> Any:
    """scan_entries with CHUNK_CHARS set to ``chars`` (restored after)."""
    from shardctl.io import header_scan

    real = header_scan.CHUNK_CHARS
    header_scan.CHUNK_CHARS = chars
    try:
        return scan_entries(raw, 8 + len(raw), size)
    finally:
        header_scan.CHUNK_CHARS = real


@settings(max_examples=300, deadline=None)
@given(_headers(), st.sampled_from([1, 5, 40, 120]))
def test_the_scanner_decides_alike_in_any_chunk_size(case: tuple[bytes, int], chars: int) -> None:
    # Chunks end at an entry's "]}": a chunk per entry (1) or a few entries (40, 120) read the
    # same entries, and refuse (None) the same headers, as one pass over the whole text.
    raw, size = case
    assert _scan_in_chunks(raw, size, chars) == _scan_in_chunks(raw, size, 1 << 30)


def test_a_save_pretrained_header_in_chunks_is_the_same_columns() -> None:
    from shardctl.io.header_raw import read_raw

    path = Path(__file__).resolve().parent.parent / "examples/tiny-llama/model.safetensors"
    raw, size = read_raw(path, sh.DEFAULT_MAX_HEADER_BYTES)
    whole = _scan_in_chunks(raw, size, 1 << 30)
    assert whole is not None
    for chars in (1, 100, 1000):
        assert _scan_in_chunks(raw, size, chars) == whole
    # a header moved out of file order by hand is still read, and sorted, in chunks
    text = raw.decode().rstrip()
    body = text[text.index(',"', text.index("__metadata__")) + 1 : -1]
    entries = body.split('},"')
    entries = [e if e.endswith("}") else e + "}" for e in entries]
    entries = [e if e.startswith('"') else '"' + e for e in entries]
    shuffled = "{" + text[1 : text.index(',"', text.index("__metadata__"))] + ","
    shuffled += ",".join(reversed(entries)) + "}"
    moved = _compact(shuffled)
    size2 = size - len(raw) + len(moved)
    assert _scan_in_chunks(moved, size2, 1 << 30) == _scan_in_chunks(moved, size2, 50) == whole


@pytest.mark.parametrize("tail", ["", " ", " " * 7, " " * 64, " " * 65, "\n\t\r " * 100, " x", "x"])
def test_scan_finds_the_closing_brace_past_any_trailing_whitespace(tail: str) -> None:
    # safetensors pads with up to 7 spaces; the scanner steps over 64 and strips longer runs
    raw = ('{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}' + tail).encode()
    size = 8 + len(raw) + 4
    got = scan_entries(raw, 8 + len(raw), size)
    if "x" in tail:
        assert got is None and _outcome(raw, size)[0] == "refused"
    else:
        assert got is not None and got[1] == ["a"]
        assert _outcome(raw, size) == _strict(raw, size)
