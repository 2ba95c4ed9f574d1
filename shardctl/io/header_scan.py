"""The fastest path of the safetensors header reader: a header exactly as safetensors writes
it (compact JSON, ``__metadata__`` first, each entry ``dtype``, ``shape``, ``data_offsets`` in
that order, names without escapes) read as text columns, with no JSON objects built::

    {"__metadata__":{"format":"pt"},"a.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},...}

A regular-expression pass per chunk of ~1 MiB (cut at entry ends) finds every entry (its
separator, name, dtype, shape text and offsets); the entries are proven to cover the text
between the metadata and the closing brace exactly — the matches are disjoint, all inside that
span, and their lengths add up to its length — so nothing outside the grammar was skipped.
Shapes are parsed once per distinct shape text (90,000 expert tensors have a dozen), sizes
checked once per (dtype, shape).

Like :mod:`shardctl.io.header_fast` it only ever *accepts*: anything else — whitespace, an
escape in a string, another key order, an unknown field, a duplicate, a bad size, a gap —
returns ``None`` and the strict reader decides and words the error. At 90,000 tensors this is
~0.15 s where the JSON parse into pair lists plus the list-level checks took ~0.5 s (busy
2-core machine, 11 MB header).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from operator import sub

from shardctl.dtypes import DTYPE_BITS

METADATA_KEY = "__metadata__"
MAX_DIMS = 64
_KEYS = {"dtype", "shape", "data_offsets"}

_STR = r'[^"\\\x00-\x1f]*'  # a JSON string's body without escapes or control characters
_NUM = r"0|[1-9][0-9]*"  # a JSON integer without sign, fraction or exponent
# The dtype and the shape's text are one group (``BF16","shape":[2,3``): an entry is five
# strings, not six, and it is priced once per distinct such text.
_DTYPE_SHAPE = '","shape":['
_ENTRY = re.compile(
    rf'([{{,])"({_STR})":\{{"dtype":"({_STR}","shape":\[[0-9,]*)\],'
    rf'"data_offsets":\[({_NUM}),({_NUM})\]\}}'
)
# the literal characters of one entry: its length is this plus its four variable fields
_FIXED = len('{"":{"dtype":"],"data_offsets":[,]}')
_METADATA = re.compile(rf'\{{"__metadata__":(\{{(?:"{_STR}":"{_STR}"(?:,"{_STR}":"{_STR}")*)?\}}),')
_SHAPE = re.compile(rf"(?:(?:{_NUM})(?:,(?:{_NUM}))*)?")
_JSON_SPACE = " \t\n\r"
# Header text scanned per regular-expression pass (see scan_entries); tests shrink it.
CHUNK_CHARS = 1 << 20

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
    # the closing brace: the last character but JSON whitespace. safetensors pads the header
    # with up to 7 spaces (8-byte alignment); rstrip would copy the whole text (~6 ms at
    # 11 MB), so only a longer run of whitespace takes it
    end = len(text) - 1
    stop = end - 64
    while end > stop and end >= 0 and text[end] in _JSON_SPACE:
        end -= 1
    if end >= 0 and text[end] in _JSON_SPACE:
        end = len(text.rstrip(_JSON_SPACE)) - 1
    if end < 0 or text[end] != "}" or end <= start:
        return None
    # Scanned in chunks that end at an entry's end: each chunk's match tuples (six strings an
    # entry) are dropped before the next, so they are never all alive at once (at 90,000
    # tensors that was ~40 MB of short-lived objects, and the heap it fragmented).
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    begins: list[int] = []
    ends: list[int] = []
    one: dict[str, str] = {}  # one str per dtype, not one per tensor
    shape_of: dict[str, tuple[int, ...]] = {}  # one tuple per shape text
    # per dtype-and-shape text: its dtype, shape and bytes (90,000 experts have a dozen)
    dtype_of: dict[str, str] = {}
    typed_shape: dict[str, tuple[int, ...]] = {}
    size_of: dict[str, int] = {}
    covered = commas = 0
    first_sep = ""
    last_end = "0"  # the end text before the first entry: an in-order file begins at 0
    for a, b in _chunks(text, start, end):
        rows = _ENTRY.findall(text, a, b)
        if not rows:
            return None
        seps, nm, kinds, begin_texts, end_texts = zip(*rows, strict=True)
        covered += len(rows) * _FIXED + sum(
            sum(map(len, column)) for column in (nm, kinds, begin_texts, end_texts)
        )
        commas += seps.count(",")
        first_sep = first_sep or seps[0]
        for k in set(kinds).difference(size_of):
            d, _, t = k.partition(_DTYPE_SHAPE)
            if d not in DTYPE_BITS:
                return None
            shape = shape_of.get(t)
            if shape is None:
                if _SHAPE.fullmatch(t) is None:
                    return None
                shape = tuple(map(int, t.split(","))) if t else ()
                if len(shape) > MAX_DIMS:
                    return None
                shape_of[t] = shape
            dtype_of[k] = one.setdefault(d, d)
            typed_shape[k] = shape
            # dtype × shape must be end − begin bytes (also catches end < begin: a negative
            # span never equals a size)
            size_of[k] = _size(d, shape)
        chunk_ends = list(map(int, end_texts))
        # Integers are canonical here (no sign, no leading zero): equal texts are equal
        # numbers, so entries in file order need only their ends converted.
        if begin_texts[0] == last_end and begin_texts[1:] == end_texts[:-1]:
            chunk_begins = [ends[-1] if ends else 0, *chunk_ends[:-1]]
        else:
            chunk_begins = list(map(int, begin_texts))
        last_end = end_texts[-1]
        if list(map(size_of.__getitem__, kinds)) != list(map(sub, chunk_ends, chunk_begins)):
            return None
        names += nm
        dtypes += map(dtype_of.__getitem__, kinds)
        shapes += map(typed_shape.__getitem__, kinds)
        begins += chunk_begins
        ends += chunk_ends
    n = len(names)
    if covered != end - start:
        return None  # something between the entries is not an entry: the strict reader
    if commas != (n if metadata is not None else n - 1):
        return None  # the first separator is "{" (or the comma after the metadata), then ","
    if metadata is None and first_sep != "{":
        return None
    if len(set(names)) != n or "" in names or METADATA_KEY in names:
        return None
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


def _chunks(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """``[a, b)`` spans of ``text[start:end]`` of about ``CHUNK_CHARS`` each, cut after an
    entry's closing ``]}`` where the next entry's ``,"`` follows. That sequence is never inside
    a name: an unescaped name holds no quote, and an escaped one fails the scan anyway (its
    chunk does not tile)."""
    at = start
    while end - at > CHUNK_CHARS:
        cut = text.find(']},"', at + CHUNK_CHARS, end)
        if cut < 0:
            break
        yield at, cut + 2
        at = cut + 2
    yield at, end


def _size(dtype: str, shape: tuple[int, ...]) -> int:
    """The bytes of ``dtype × shape``; -1 (no span matches it) for a fraction of a byte."""
    numel = 1
    for d in shape:
        numel *= d
    bits = DTYPE_BITS[dtype] * numel
    return bits // 8 if bits % 8 == 0 else -1
