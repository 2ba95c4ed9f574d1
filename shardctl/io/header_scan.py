"""The fastest path of the safetensors header reader: a header exactly as safetensors writes
it (compact JSON, ``__metadata__`` first, each entry ``dtype``, ``shape``, ``data_offsets`` in
that order, names without escapes) read as text columns, with no JSON objects built::

    {"__metadata__":{"format":"pt"},"a.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},...}

One regular-expression pass finds every entry (its separator, name, dtype, shape text and
offsets); the entries are proven to cover the text between the metadata and the closing brace
exactly — the matches are disjoint, all inside that span, and their lengths add up to its
length — so nothing outside the grammar was skipped. Shapes are parsed once per distinct
shape text (90,000 expert tensors have a dozen), sizes checked once per (dtype, shape).

Like :mod:`shardctl.io.header_fast` it only ever *accepts*: anything else — whitespace, an
escape in a string, another key order, an unknown field, a duplicate, a bad size, a gap —
returns ``None`` and the strict reader decides and words the error. At 90,000 tensors this is
~0.1 s where the JSON parse into pair lists plus the list-level checks took ~0.5 s.
"""

from __future__ import annotations

import json
import re
from operator import sub

from shardctl.dtypes import DTYPE_BITS

METADATA_KEY = "__metadata__"
MAX_DIMS = 64
_KEYS = {"dtype", "shape", "data_offsets"}

_STR = r'[^"\\\x00-\x1f]*'  # a JSON string's body without escapes or control characters
_NUM = r"0|[1-9][0-9]*"  # a JSON integer without sign, fraction or exponent
_ENTRY = re.compile(
    rf'([{{,])"({_STR})":\{{"dtype":"({_STR})","shape":\[([0-9,]*)\],'
    rf'"data_offsets":\[({_NUM}),({_NUM})\]\}}'
)
# the literal characters of one entry: its length is this plus its five variable fields
_FIXED = len('{"":{"dtype":"","shape":[],"data_offsets":[,]}')
_METADATA = re.compile(rf'\{{"__metadata__":(\{{(?:"{_STR}":"{_STR}"(?:,"{_STR}":"{_STR}")*)?\}}),')
_SHAPE = re.compile(rf"(?:(?:{_NUM})(?:,(?:{_NUM}))*)?")
_JSON_SPACE = " \t\n\r"

Columns = tuple[
    dict[str, str] | None, list[str], list[str], list[tuple[int, ...]], list[int], list[int]
]


def scan_entries(raw: bytes, data_offset: int, file_size: int) -> Columns | None:
    """``(metadata, names, dtypes, shapes, begins, ends)`` in file order (sorted by
    ``(begin, end)``) of a canonical header that passes every check of the strict reader, or
    None to hand it to the other readers."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    metadata: dict[str, str] | None = None
    start = 0
    if text.startswith('{"__metadata__":'):
        m = _METADATA.match(text)
        if m is None:
            return None
        pairs = json.loads(m.group(1), object_pairs_hook=list)
        metadata = dict(pairs)
        if len(metadata) != len(pairs) or _KEYS <= metadata.keys():
            return None  # a duplicate key, or a tensor named __metadata__: the strict reader
        start = m.end() - 1  # the first entry's separator is the comma after the metadata
    body = text.rstrip(_JSON_SPACE)
    end = len(body) - 1
    if not body.endswith("}") or end <= start:
        return None
    rows = _ENTRY.findall(text, start, end)
    if not rows:
        return None
    seps, names, dtypes, shape_texts, begin_texts, end_texts = map(list, zip(*rows, strict=True))
    n = len(rows)
    covered = n * _FIXED + sum(
        sum(map(len, column)) for column in (names, dtypes, shape_texts, begin_texts, end_texts)
    )
    if covered != end - start:
        return None  # something between the entries is not an entry: the strict reader
    if seps.count(",") != (n if metadata is not None else n - 1):
        return None  # the first separator is "{" (or the comma after the metadata), then ","
    if metadata is None and seps[0] != "{":
        return None
    if len(set(names)) != n or "" in names or METADATA_KEY in names:
        return None
    if not set(dtypes) <= DTYPE_BITS.keys():
        return None
    shape_of: dict[str, tuple[int, ...]] = {}
    for s in set(shape_texts):
        if _SHAPE.fullmatch(s) is None:
            return None
        shape = tuple(map(int, s.split(","))) if s else ()
        if len(shape) > MAX_DIMS:
            return None
        shape_of[s] = shape
    size_of: dict[tuple[str, str], int] = {}
    for dtype, s in set(zip(dtypes, shape_texts, strict=True)):
        numel = 1
        for d in shape_of[s]:
            numel *= d
        bits = DTYPE_BITS[dtype] * numel
        size_of[dtype, s] = bits // 8 if bits % 8 == 0 else -1  # -1: no span can match it
    begins = list(map(int, begin_texts))
    ends = list(map(int, end_texts))
    if list(map(size_of.__getitem__, zip(dtypes, shape_texts, strict=True))) != list(
        map(sub, ends, begins)
    ):
        return None  # also catches end < begin: a negative span never equals a size
    shapes = list(map(shape_of.__getitem__, shape_texts))
    if not (begins[0] == 0 and begins[1:] == ends[:-1]):
        order = sorted(range(n), key=lambda i: (begins[i], ends[i]))
        names = [names[i] for i in order]
        dtypes = [dtypes[i] for i in order]
        shapes = [shapes[i] for i in order]
        begins = [begins[i] for i in order]
        ends = [ends[i] for i in order]
        if begins[0] != 0 or begins[1:] != ends[:-1]:
            return None  # gap or overlap
    if data_offset + ends[-1] != file_size:
        return None
    return metadata, names, dtypes, shapes, begins, ends
