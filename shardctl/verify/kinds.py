"""Shard kinds of a record's rank table: the distinct ``(local shape, pieces)`` of its rows.

An MoE rank of 45,000 shards has a few dozen kinds (an expert's ``w1`` half, its ``w2`` half,
a norm's replica), found once per rank by ``record_table.boxes_of`` (columns folded into one
integer code per row: ``record_table.dense``)::

    ids, kinds = shard_kinds(table, rank)    # ids[j]: the kind of row j
    local_shape, pieces = kinds[ids[j]]
"""

from __future__ import annotations

import array

from shardctl.checkpoint import record_table as rt
from shardctl.checkpoint.record_table import dense
from shardctl.layout.types import Piece

__all__ = ["dense", "shard_kinds"]


def shard_kinds(
    table: rt.RecordTable, r: rt.RankTable
) -> tuple[array.array[int], list[tuple[tuple[int, ...], tuple[Piece, ...]]]] | None:
    """Every row's kind id and the kinds; None when a rank has more than
    ``record_table.CACHE_LIMIT`` kinds (build those rows one by one:
    ``record_table.local_shape_at``)."""
    ids, kinds = rt.boxes_of(table, r)
    if not kinds and len(r):
        return None
    assert isinstance(ids, array.array)  # boxes_of found them: its _ints column
    return ids, kinds
