"""Shard kinds of a record's rank table: the distinct ``(local shape, pieces)`` of its rows.

An MoE rank of 45,000 shards has a few dozen kinds (an expert's ``w1`` half, its ``w2`` half,
a norm's replica). ``record_table.boxes_of`` finds them with ``np.unique(axis=0)`` over rows of
~10 integers, which sorts the rows as raw bytes (~0.2 s a rank at 45,000 rows). Here the
columns are folded into one int64 code per row and sorted once (:func:`dense`): ~6 ms a rank.
Same kinds, numbered in another order::

    ids, kinds = shard_kinds(table, rank)    # ids[j]: the kind of row j
    local_shape, pieces = kinds[ids[j]]
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from shardctl.checkpoint import record_table as rt
from shardctl.layout.types import Piece

LIMIT = rt.CACHE_LIMIT  # past this many kinds a rank's shards are built row by row


def dense(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, first)`` of the rows of the 2-d integer array ``key``: ``ids[j]`` numbers row
    ``j``'s distinct value (in the order of the rows' codes), ``first[i]`` a row holding
    value ``i``. Columns are folded into one int64 code (``code * span + value``), the code
    renumbered densely only when the next column would overflow it; one sort at the end."""
    n = key.shape[0]
    code = np.zeros(n, dtype=np.int64)
    hi = 1  # every code is below hi
    for col in key.T:
        if n == 0:
            break
        lo = int(col.min())
        span = int(col.max()) - lo + 1
        if hi * span >= 2**62:
            code = np.unique(code, return_inverse=True)[1].ravel()
            hi = int(code.max()) + 1
            if hi * span >= 2**62:  # a column of huge values: its ranks instead
                col = np.unique(col, return_inverse=True)[1].ravel()
                lo, span = 0, int(col.max()) + 1
        code = code * span + (col - lo)
        hi *= span
    _, first, ids = np.unique(code, return_index=True, return_inverse=True)
    return ids.ravel(), first


def shard_kinds(
    table: rt.RecordTable, r: rt.RankTable
) -> tuple[array.array[int], list[tuple[tuple[int, ...], tuple[Piece, ...]]]] | None:
    """Every row's kind id and the kinds (kept on the rank table); None when a rank has more
    than ``LIMIT`` kinds (build those rows one by one: ``record_table.local_shape_at``)."""
    got: Any = r.__dict__.get("_verify_kinds")
    if got is not None:
        return got or None  # () when there were too many
    n, width = len(r), table.width
    ids = np.empty(n, dtype=np.int64)
    kinds: list[tuple[tuple[int, ...], tuple[Piece, ...]]] = []
    counts = np.diff(r.piece_start)
    nd = table.ndim[r.tensor]
    for c in np.unique(counts).tolist():
        rows = np.flatnonzero(counts == c)
        first = r.piece_start[rows]
        k = (first[:, None] + np.arange(c)[None, :]).ravel()
        key = np.column_stack(
            [
                nd[rows],
                r.local_shape[rows],
                r.offsets[k].reshape(rows.size, c * width),
                r.sizes[k].reshape(rows.size, c * width),
                r.local_offsets[k].reshape(rows.size, c * width),
            ]
        )
        local_ids, firsts = dense(key)
        if len(kinds) + len(firsts) > LIMIT:
            object.__setattr__(r, "_verify_kinds", ())
            return None
        ids[rows] = local_ids + len(kinds)
        for row in key[firsts].tolist():
            d = row[0]
            local = tuple(row[1 : 1 + d])
            base = 1 + width
            pieces = []
            for q in range(c):
                o = base + q * width
                z = o + c * width
                lo = z + c * width
                pieces.append(
                    Piece(tuple(row[o : o + d]), tuple(row[z : z + d]), tuple(row[lo : lo + d]))
                )
            kinds.append((local, tuple(pieces)))
    got = (array.array("i", ids.astype(np.int32).tobytes()), kinds)  # plain ints on indexing
    object.__setattr__(r, "_verify_kinds", got)
    return got
