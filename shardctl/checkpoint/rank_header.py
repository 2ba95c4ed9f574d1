"""A rank file's header checked against the record by its bytes, without parsing it (verify's
DST, and a sharded SRC that reshard merges or re-splits).

``reshard`` writes each header as text from the record's own rows (``plan_header.header_text``:
the file's shards in record row order, back to back). So the header the record implies can be
built again and compared with the file's bytes: equal bytes mean every entry is a recorded
shard of the recorded dtype and local shape, at the offsets the text names, and nothing else is
in the file — what the entry-by-entry check (``dst._ranks``) would conclude, at ~1/5 of the
cost (90,213 tensors split four ways: 180,000 entries, ~1.2 s of JSON parsing and objects
saved). Anything else (another writer's key order, a tampered entry, a file shared by ranks)
returns None and the entry-by-entry check decides and words the findings::

    {"__metadata__":{...},"model.norm.weight":{"dtype":"BF16","shape":[64],"data_offsets":[0,128]},...}
"""

from __future__ import annotations

import json
from operator import attrgetter

import numpy as np

from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.plan_header import METADATA_KEY, entries_text, kind_text
from shardctl.dtypes import DTYPE_BITS
from shardctl.io.mapped import row_kinds

_META_OPEN = b'{"' + METADATA_KEY.encode() + b'":'
_FQN, _DTYPE = attrgetter("fqn"), attrgetter("dtype")


def metadata_of(raw: bytes) -> tuple[bool, dict[str, str] | None]:
    """``(ok, metadata)`` of a header's JSON bytes when it opens with ``__metadata__`` (as
    ``header_text`` writes it), ``(True, None)`` when it has none there; ``ok`` False when it
    is not a string map (the full reader words that)."""
    if not raw.startswith(_META_OPEN):
        return True, None
    try:
        meta, _ = json.JSONDecoder().raw_decode(raw.decode("utf-8"), len(_META_OPEN))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False, None
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        return False, None
    return True, meta


def begins_if_exact(
    raw: bytes, file_size: int, table: rt.RecordTable, rank: int, rows: np.ndarray
) -> tuple[np.ndarray, dict[str, str] | None] | None:
    """``(absolute begin of each of rank ``rank``'s ``rows``, header metadata)`` when the
    header bytes ``raw`` (the JSON after the length field) are exactly the header of those rows
    back to back in row order, and the data region ends at ``file_size``; else None."""
    if rows.size == 0:
        return None
    ok, meta = metadata_of(raw)
    if not ok:
        return None
    r = table.ranks[rank]
    tids = r.tensor[rows]
    # each tensor once (names are unique per tensor in every record; a schema-1 record's rank
    # is not checked for a tensor twice): a scatter, not a set of the names
    once = np.zeros(len(table.tensors), dtype=bool)
    once[tids] = True
    if int(np.count_nonzero(once)) != tids.size:
        return None
    # column by column, in C-level maps (45,000 rows a rank file at 90,000 tensors)
    infos = list(map(table.tensors.__getitem__, tids.tolist()))
    names = list(map(_FQN, infos))
    if METADATA_KEY in names or "" in names:
        return None
    dtypes = list(map(_DTYPE, infos))
    del infos
    kinds_of = {d: i for i, d in enumerate(set(dtypes))}
    if not kinds_of.keys() <= DTYPE_BITS.keys():
        return None
    dtype_of = list(kinds_of)
    code = np.fromiter(map(kinds_of.__getitem__, dtypes), dtype=np.int64, count=len(dtypes))
    del dtypes
    bits = np.array([DTYPE_BITS[d] for d in dtype_of], dtype=np.int64)[code]
    local = r.local_shape[rows]
    nbits = bits * np.prod(local, axis=1, dtype=np.int64)  # padded dims are 1
    if (nbits % 8).any():
        return None  # sub-byte rows that do not fill whole bytes: the full reader decides
    ends = np.cumsum(nbits // 8)
    data_offset = 8 + len(raw)
    if data_offset + int(ends[-1]) != file_size:
        return None
    # an entry's dtype and shape text made once per distinct (padded shape, ndim, dtype):
    # 90,000 experts share a handful
    which, distinct = row_kinds(np.column_stack((local, table.ndim[tids], code)))
    made = [kind_text(dtype_of[row[-1]], row[:-2][: row[-2]]) for row in distinct.tolist()]
    try:
        text = entries_text(names, list(map(made.__getitem__, which.tolist())), ends.tolist(), meta)
    except UnicodeEncodeError:
        return None  # a lone surrogate in a name: the full reader names it
    # ``endswith``: one memcmp (a memoryview compare goes element by element: ~0.4 s for the
    # 160 MB of headers of a tp-8 split of 96,000 tensors)
    if len(text) != 8 + len(raw) or not text.endswith(raw):
        return None
    return data_offset + ends - nbits // 8, meta
