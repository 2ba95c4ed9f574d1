"""The fast path of the safetensors header reader: headers as safetensors (and shardctl) write
them — each entry exactly ``dtype``, ``shape``, ``data_offsets`` — validated with list-level
passes over all entries at once instead of ~10 Python checks per tensor.

It reads the strict reader's own parse (pair lists: duplicate keys stay visible), so nothing
is parsed twice, and it only ever *accepts*: anything unusual — a duplicate, another key order,
an unknown field, a malformed entry — returns ``None`` and the strict reader
(:func:`shardctl.io.safetensors_header.parse_header`) decides and words the error.
"""

from __future__ import annotations

import math
import operator

from shardctl.dtypes import DTYPE_BITS
from shardctl.io.header_raw import JsonObject

_KEYS = ("dtype", "shape", "data_offsets")
METADATA_KEY = "__metadata__"
MAX_DIMS = 64


def fast_entries(
    pairs: JsonObject, data_offset: int, file_size: int
) -> tuple[dict[str, str] | None, list[tuple[str, str, tuple[int, ...], int, int]]] | None:
    """``(metadata, [(name, dtype, shape, begin, end), ...] sorted by (begin, end))`` of a
    parsed header (the strict reader's pair lists, duplicates kept) that passes every check of
    the strict reader, or None to let the strict reader decide (it then refuses with the
    precise error, or accepts an unusual but legal header: unknown fields, other key order)."""
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names) or "" in names:
        return None
    try:
        "".join(names).encode("utf-8")
    except UnicodeEncodeError:
        return None  # a lone surrogate ("\ud800"): the strict reader names it
    metadata: dict[str, str] | None = None
    infos = [v for _, v in pairs]
    if METADATA_KEY in names:
        at = names.index(METADATA_KEY)
        meta = infos[at]
        if type(meta) is not JsonObject:
            return None
        metadata = dict(meta)
        if len(metadata) != len(meta) or not set(map(type, metadata.values())) <= {str}:
            return None
        if set(_KEYS) <= metadata.keys():
            return None  # a tensor named __metadata__: the strict reader refuses it
        del names[at], infos[at]
    # safetensors' own entry: exactly dtype, shape, data_offsets, in this order
    if not set(map(type, infos)) <= {JsonObject} or not set(map(len, infos)) <= {3}:
        return None
    if infos and (
        {i[0][0] for i in infos} != {"dtype"}
        or {i[1][0] for i in infos} != {"shape"}
        or {i[2][0] for i in infos} != {"data_offsets"}
    ):
        return None
    dtypes = [i[0][1] for i in infos]
    shapes = [i[1][1] for i in infos]
    offsets = [i[2][1] for i in infos]
    if not set(map(type, dtypes)) <= {str} or not set(dtypes) <= DTYPE_BITS.keys():
        return None
    if not set(map(type, shapes)) <= {list} or not set(map(type, offsets)) <= {list}:
        return None
    if shapes and max(map(len, shapes)) > MAX_DIMS:
        return None
    if offsets and set(map(len, offsets)) != {2}:
        return None
    begins = [o[0] for o in offsets]
    ends = [o[1] for o in offsets]
    flat = [x for s in shapes for x in s]
    if not set(map(type, flat)) <= {int} or (flat and min(flat) < 0):
        return None  # bools, floats, negatives
    if not set(map(type, begins)) <= {int} or not set(map(type, ends)) <= {int}:
        return None
    if begins and min(begins) < 0:
        return None
    bits = [DTYPE_BITS[d] for d in dtypes]
    want = list(map(operator.mul, bits, map(math.prod, shapes)))
    have = [8 * n for n in map(operator.sub, ends, begins)]
    if want != have:
        return None  # also catches end < begin: a negative span never equals a size
    shapes_t = list(map(tuple, shapes))
    # Headers are written in file order: tiled as they stand means sorted by (begin, end)
    # (a stable sort keeps them, ties included); otherwise sort, then check.
    if not (begins[:1] == [0] and begins[1:] == ends[:-1]):
        order = sorted(range(len(names)), key=lambda i: (begins[i], ends[i]))
        names = [names[i] for i in order]
        dtypes = [dtypes[i] for i in order]
        shapes_t = [shapes_t[i] for i in order]
        begins = [begins[i] for i in order]
        ends = [ends[i] for i in order]
        if begins and (begins[0] != 0 or begins[1:] != ends[:-1]):
            return None  # gap or overlap
    if data_offset + (ends[-1] if ends else 0) != file_size:
        return None
    entries = list(zip(names, dtypes, shapes_t, begins, ends, strict=True))
    return metadata, entries
