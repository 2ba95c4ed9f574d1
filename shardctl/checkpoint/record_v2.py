"""Schema ``"shardctl.layout/2"``: the record's ``tensors`` and per-rank ``shards`` as columns.

Schema 1 wrote one JSON object per shard and per piece: 60 MB for a 90k-tensor MoE split four
ways, 1.7 s and 335 MiB just to ``json.load``. Schema 2 keeps every other key of schema 1 as it
was and stores the two big tables as columns of integers (little-endian unsigned arrays, base64,
the narrowest of u1/u2/u4/u8 that holds the column) plus string tables::

    "tensors": {"count": 3,
                "fqn": ["model.embed_tokens.weight", ...],      # file order
                "dtypes": ["BF16"], "dtype": COL,                # index into "dtypes"
                "ndim": COL, "global_shape": COL, "padded_shape": COL},   # shapes back to back
    "ranks": [{"rank": 0, "coord": {"pp": 0, "ep": 0, "tp": 0},
               "shards": {"count": 2,
                          "tensor": COL,                         # index into tensors
                          "file": COL,                           # index into the record's files
                          "placements": ["S(0)", "R"], "placement": COL,
                          "local_shape": COL,                    # ndim of its tensor per shard
                          "pieces": COL,                         # pieces per shard
                          "offsets": COL, "sizes": COL, "local_offsets": COL}}]  # per piece

    COL = {"type": "<u2", "data": "<base64 of the little-endian array>"}

The same 90k-tensor split's record is 11 MB (was 60), ~1 s to read and check. Why this form:
it stays one strict-JSON file (the one strict reader, the size cap, ``--force``'s recognition,
the other keys readable and diffable as before); the names stay plain JSON strings (5 MB of
the 11: ``grep`` still finds a tensor; a shard names its tensor by index, so each name is
written once, not once per shard); every integer table decodes with one ``b64decode`` and one
``np.frombuffer``, never a Python object per value. Reading builds arrays, never a dict per
shard, and validation is vectorized with the same refusals as schema 1 (bounds of every index
and dim, boxes inside the global and local shapes, exact tiling, duplicate names), plus: a
column's length must equal its row count, base64 is strict, a rank may hold a tensor once, and
the int64 cells a table may ask for are capped (``MAX_CELLS``). A record that fails the tiling
check is explained by schema 1's checker on the same rows, so both schemas name the offending
piece the same way. :func:`to_v1` / :func:`to_v2` convert between the two JSON forms (tools,
tests).
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardctl.checkpoint import record_check as rc
from shardctl.checkpoint import record_table as rt
from shardctl.columns import from_columns
from shardctl.dtypes import DTYPE_BITS
from shardctl.errors import InvalidInputError
from shardctl.model.types import TensorInfo

SCHEMA_V2 = "shardctl.layout/2"
# Rows x widest dim held as int64 per table (tensors; one rank's shards or pieces): a 1M-tensor
# 4-dim checkpoint is 4M cells. A hostile record could otherwise ask for GBs with a few bytes.
MAX_CELLS = 2**26
_TYPES: dict[str, type[np.unsignedinteger[Any]]] = {
    "<u1": np.uint8,
    "<u2": np.uint16,
    "<u4": np.uint32,
    "<u8": np.uint64,
}


# ---- columns ---------------------------------------------------------------------------------


def column(values: np.ndarray | Sequence[int]) -> dict[str, str]:
    """Non-negative integers as the narrowest little-endian unsigned array, base64."""
    arr = np.asarray(values, dtype=np.int64).ravel()
    top = int(arr.max()) if arr.size else 0
    assert arr.size == 0 or int(arr.min()) >= 0
    for name, typ in _TYPES.items():
        if top <= np.iinfo(typ).max:
            data = arr.astype(typ).tobytes()
            return {"type": name, "data": base64.b64encode(data).decode("ascii")}
    raise AssertionError("unreachable: int64 fits u8")


def read_column(v: Any, field: str, count: int, where: str, hi: int = rc.MAX_NUMEL) -> np.ndarray:
    """A column of exactly ``count`` integers in ``[0, hi]`` as int64 (exit 3 otherwise)."""
    o = rc._obj(v, field, where)
    typ = o.get("type")
    if not isinstance(typ, str) or typ not in _TYPES:
        raise rc._fail(f"{field}.type", f"expected one of {', '.join(_TYPES)}, got {typ!r}", where)
    data = o.get("data")
    if not isinstance(data, str):
        raise rc._fail(f"{field}.data", f"expected a base64 string, got {rc._kind(data)}", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise rc._fail(f"{field}.data", "not valid base64", where) from None
    size = np.dtype(_TYPES[typ]).itemsize
    if len(raw) != count * size:
        raise rc._fail(
            field, f"{len(raw) / size:g} values, expected {count} (the row count)", where
        )
    arr = np.frombuffer(raw, dtype=np.dtype(_TYPES[typ]).newbyteorder("<"))
    if arr.size and int(arr.max()) > hi:
        k = int(np.argmax(arr > hi))
        raise rc._fail(f"{field}[{k}]", f"{int(arr[k])} is out of range [0, {hi}]", where)
    return arr.astype(np.int64)


# ---- writing ---------------------------------------------------------------------------------


def encode(
    table: rt.RecordTable, padded_shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``tensors`` object and each rank's ``shards`` object of a schema-2 record."""
    return encode_tensors(table, padded_shapes), [encode_rank(table, r) for r in table.ranks]


def encode_tensors(
    table: rt.RecordTable, padded_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The ``tensors`` object of a schema-2 record (the ranks of ``table`` are not read)."""
    tensors = table.tensors
    dtypes: dict[str, int] = {}
    dtype = [dtypes.setdefault(t.dtype, len(dtypes)) for t in tensors]
    flat = [d for t in tensors for d in t.shape]
    padded = [d for t in tensors for d in padded_shapes.get(t.fqn, t.shape)]
    tobj = {
        "count": len(tensors),
        "fqn": [t.fqn for t in tensors],
        "dtypes": list(dtypes),
        "dtype": column(dtype),
        "ndim": column(table.ndim),
        "global_shape": column(flat),
        "padded_shape": column(padded),
    }
    return tobj


def encode_rank(table: rt.RecordTable, r: rt.RankTable) -> dict[str, Any]:
    """The ``shards`` object of rank table ``r`` of ``table`` in a schema-2 record."""
    nd = table.ndim[r.tensor]
    pnd = np.repeat(nd, np.diff(r.piece_start))
    return {
        "count": len(r),
        "tensor": column(r.tensor),
        "file": column(r.file),
        "placements": list(r.placements),
        "placement": column(r.placement),
        "local_shape": column(rt.unpad_rows(r.local_shape, nd)),
        "pieces": column(np.diff(r.piece_start)),
        "offsets": column(rt.unpad_rows(r.offsets, pnd)),
        "sizes": column(rt.unpad_rows(r.sizes, pnd)),
        "local_offsets": column(rt.unpad_rows(r.local_offsets, pnd)),
    }


# ---- reading ---------------------------------------------------------------------------------


def _names(v: Any, field: str, count: int, where: str) -> list[str]:
    names = rc._list(v, field, where)
    if len(names) != count:
        raise rc._fail(field, f"{len(names)} names, expected {count}", where)
    for i, n in enumerate(names):
        if type(n) is not str or not 0 < len(n) <= rc.MAX_NAME:
            rc._text(n, f"{field}[{i}]", where, name=True)
    try:
        "".join(names).encode("utf-8")
    except UnicodeEncodeError:
        for i, n in enumerate(names):
            rc._text(n, f"{field}[{i}]", where)
    return names


def _numel_ok(rows: np.ndarray) -> np.ndarray:
    """Per row: the product of its dims is at most MAX_NUMEL (exact near the limit)."""
    approx = np.prod(rows.astype(np.float64), axis=1) if rows.shape[1] else np.ones(len(rows))
    ok = approx <= rc.MAX_NUMEL / 2
    for k in np.flatnonzero(~ok).tolist():
        ok[k] = math.prod(rows[k].tolist()) <= rc.MAX_NUMEL
    return ok


def read_tensors(
    obj: dict[str, Any], where: str
) -> tuple[tuple[TensorInfo, ...], np.ndarray, np.ndarray, dict[str, tuple[int, ...]]]:
    """``tensors``: the TensorInfo rows, ``ndim``, the global shapes as ``(N, D)`` rows and
    the padded shapes that differ from the global ones."""
    t = rc._obj(obj.get("tensors"), "tensors", where)
    n = rc._int(t.get("count"), "tensors.count", where, 0, rc.MAX_ENTRIES)
    fqns = _names(t.get("fqn"), "tensors.fqn", n, where)
    if len(set(fqns)) != n:
        seen: set[str] = set()
        for i, f in enumerate(fqns):
            if f in seen:
                raise rc._fail(f"tensors.fqn[{i}]", f"duplicate name {f!r}", where)
            seen.add(f)
    # Interned: verify holds two records (or a header and a record) naming the same 100,000
    # tensors; the second's names are then the first's objects (~10 MB less at 100,000).
    fqns = list(map(sys.intern, fqns))
    dtypes = rc._list(t.get("dtypes"), "tensors.dtypes", where, 1024)
    for i, d in enumerate(dtypes):
        if not isinstance(d, str) or d not in DTYPE_BITS:
            raise rc._fail(f"tensors.dtypes[{i}]", f"unknown dtype {d!r}", where)
    dtype = read_column(t.get("dtype"), "tensors.dtype", n, where, max(len(dtypes) - 1, 0))
    if n and not dtypes:
        raise rc._fail("tensors.dtypes", "empty, but there are tensors", where)
    ndim = read_column(t.get("ndim"), "tensors.ndim", n, where, rc.MAX_DIMS)
    total = int(ndim.sum())
    width = int(ndim.max()) if n else 0
    if n * width > MAX_CELLS:
        raise rc._fail(
            "tensors", f"{n} tensors of up to {width} dims, above the limit of {MAX_CELLS}", where
        )
    shape = rt.pad_rows(
        read_column(t.get("global_shape"), "tensors.global_shape", total, where, rc.MAX_DIM),
        ndim,
        width,
        1,
    )
    padded = rt.pad_rows(
        read_column(t.get("padded_shape"), "tensors.padded_shape", total, where, rc.MAX_DIM),
        ndim,
        width,
        1,
    )
    bad = ~_numel_ok(padded) | (padded < shape).any(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise rc._fail(
            f"tensors[{i}].padded_shape",
            f"{padded[i, : ndim[i]].tolist()} smaller than {shape[i, : ndim[i]].tolist()} "
            "or too many elements",
            where,
        )
    nds = ndim.tolist()
    # one shape tuple per distinct shape (90,000 experts have a dozen), not one per tensor
    ids, first = rt.dense(np.concatenate([ndim.astype(np.int64)[:, None], shape], axis=1))
    distinct = [tuple(shape[i, : nds[i]].tolist()) for i in first.tolist()]
    shapes = list(map(distinct.__getitem__, ids.tolist()))
    dts = [dtypes[d] for d in dtype.tolist()]
    # slots set column by column (from_columns): ~20 ms less than 90,000 __init__ calls
    tensors = tuple(from_columns(TensorInfo, n, fqn=fqns, shape=shapes, dtype=dts))
    differ = np.flatnonzero((padded != shape).any(axis=1)).tolist()
    pads = {fqns[i]: tuple(padded[i, : nds[i]].tolist()) for i in differ}
    return tensors, ndim, shape, pads


def read_rank(
    s: Any,
    w: str,
    ndim: np.ndarray,
    gshape: np.ndarray,
    nfiles: int,
    where: str,
) -> rt.RankTable:
    """One rank's ``shards`` object, every index and box bound-checked."""
    s = rc._obj(s, f"{w}.shards", where)
    field = f"{w}.shards"
    n = rc._int(s.get("count"), f"{field}.count", where, 0, rc.MAX_ENTRIES)
    places = rc._list(s.get("placements"), f"{field}.placements", where)
    for k, p in enumerate(places):
        rc._text(p, f"{field}.placements[{k}]", where)
    ntensors = ndim.shape[0]
    tensor = read_column(s.get("tensor"), f"{field}.tensor", n, where, max(ntensors - 1, 0))
    if n and not ntensors:
        raise rc._fail(f"{field}.tensor", "shards, but no tensors", where)
    # a tensor twice: fewer distinct ids than rows (a scatter into one flag per tensor; the
    # ids are bound-checked above. np.unique hashed 96,000 ids a rank in ~20 ms)
    seen = np.zeros(ntensors, dtype=bool)
    seen[tensor] = True
    if int(np.count_nonzero(seen)) != n:
        _, first = np.unique(tensor, return_index=True)
        j = int(np.setdiff1d(np.arange(n), first)[0])
        raise rc._fail(f"{w}.shards[{j}]", "a second shard of the same tensor in one rank", where)
    file = read_column(s.get("file"), f"{field}.file", n, where, max(nfiles - 1, 0))
    if n and not nfiles:
        raise rc._fail(f"{field}.file", "shards, but no recorded files", where)
    placement = read_column(
        s.get("placement"), f"{field}.placement", n, where, max(len(places) - 1, 0)
    )
    if n and not places:
        raise rc._fail(f"{field}.placements", "empty, but there are shards", where)
    nd = ndim[tensor]
    width = gshape.shape[1]
    local = rt.pad_rows(
        read_column(s.get("local_shape"), f"{field}.local_shape", int(nd.sum()), where, rc.MAX_DIM),
        nd,
        width,
        1,
    )
    if n and not _numel_ok(local).all():
        j = int(np.argmax(~_numel_ok(local)))
        raise rc._fail(f"{w}.shards[{j}].local_shape", "more than 2^62 elements", where)
    counts = read_column(s.get("pieces"), f"{field}.pieces", n, where, rc.MAX_PIECES)
    if max(n, int(counts.sum())) * max(width, 1) > MAX_CELLS:
        raise rc._fail(
            f"{field}.pieces",
            f"{int(counts.sum())} pieces of up to {width} dims, above the limit of {MAX_CELLS}",
            where,
        )
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=start[1:])
    pnd = np.repeat(nd, counts)
    total = int(pnd.sum())
    boxes = [
        rt.pad_rows(
            read_column(s.get(key), f"{field}.{key}", total, where, rc.MAX_DIM), pnd, width, fill
        )
        for key, fill in (("offsets", 0), ("sizes", 1), ("local_offsets", 0))
    ]
    off, siz, loc = boxes
    owner = np.repeat(np.arange(n), counts)  # piece -> shard row
    outside = ((off + siz) > gshape[tensor[owner]]).any(axis=1) | ((loc + siz) > local[owner]).any(
        axis=1
    )
    if outside.any():
        p = int(np.argmax(outside))
        j = int(owner[p])
        t = int(tensor[j])
        k = p - int(start[j])
        raise rc._fail(
            f"{w}.shards[{j}].pieces[{k}]",
            f"box outside the global {gshape[t, : ndim[t]].tolist()} or local "
            f"{local[j, : nd[j]].tolist()} tensor",
            where,
        )
    # Most shards are one piece, the whole local shard, at local offset 0: then ``sizes`` is
    # ``local_shape`` and ``local_offsets`` all zeros, and neither is kept twice (2 x 11 MB
    # at 90,000 tensors on 8 ranks). Both stay read-only arrays of the same values.
    if off.shape[0] == n and (counts == 1).all() and np.array_equal(siz, local):
        siz = local
    if not loc.any():
        loc = np.broadcast_to(np.zeros(width, dtype=loc.dtype), loc.shape)
    if len(places) <= 2**16:  # an index into a few placement strings: 2 B, not 8
        placement = placement.astype(np.uint16)
    start = start.astype(np.int32)  # piece indexes: at most MAX_CELLS (2**26)
    # a file index: 2 B where a few thousand files are named (the usual case), else 4 (a record
    # names at most MAX_ENTRIES); a rank in one file (the usual case): one value
    file = file.astype(np.uint16 if nfiles <= 2**16 else np.int32)
    if n and (file == file[0]).all():
        file = np.broadcast_to(np.array([file[0]], dtype=file.dtype), file.shape)
    local.flags.writeable = False
    return rt.RankTable(tensor, file, placement, tuple(places), local, start, off, siz, loc)


# ---- exact tiling, vectorized -----------------------------------------------------------------

_PAIRWISE = 16  # groups up to this size are checked pair by pair in numpy; larger in Python
_PAIRS_PER_CHUNK = 1 << 18  # box pairs compared per numpy pass (memory ~ 100 B a pair)


def _overlapping(group: np.ndarray, off: np.ndarray, siz: np.ndarray) -> bool:
    """Whether any two boxes of one group overlap; ``group`` sorted, boxes all non-empty."""
    if group.size < 2:
        return False
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, group.size])
    for k in np.unique(sizes).tolist():
        if k < 2:
            continue
        first = starts[sizes == k]
        if k > _PAIRWISE:
            for a in first.tolist():
                boxes = [
                    ((tuple(off[i].tolist()), tuple(siz[i].tolist())), str(i))
                    for i in range(a, a + k)
                ]
                if rc.overlap(boxes) is not None:
                    return True
            continue
        ia, ib = np.triu_indices(k, 1)
        # groups a chunk at a time: 90,000 tensors split 8 ways are 2.5M pairs, ~300 MB at once
        step = max(1, _PAIRS_PER_CHUNK // ia.size)
        for c in range(0, first.size, step):
            a = (first[c : c + step, None] + ia[None, :]).ravel()
            b = (first[c : c + step, None] + ib[None, :]).ravel()
            hit = ((off[a] < off[b] + siz[b]) & (off[b] < off[a] + siz[a])).all(axis=1)
            if hit.any():
                return True
    return False


def tiles_exactly(table: rt.RecordTable, gshape: np.ndarray) -> bool:
    """True when every tensor's distinct pieces tile it and no shard's local boxes overlap
    (what :func:`shardctl.checkpoint.record_check.check_tiling` refuses, as one bool)."""
    n = len(table.tensors)
    width = table.width
    # Each live piece as one int64 code, tensor * (box count) + box id, where a box is an
    # (offsets, sizes) pair numbered across ranks: a tp-8 split of 90,000 tensors has 720,000
    # pieces but a few hundred distinct boxes. (np.unique(axis=0) of the (tensor, offsets,
    # sizes) rows held several copies of a 29 MB table.)
    box_ids: dict[tuple[int, ...], int] = {}
    codes: list[tuple[np.ndarray, np.ndarray]] = []
    for r in table.ranks:
        counts = np.diff(r.piece_start)
        if r.sizes.shape[0] == 0:
            continue
        owner = np.repeat(np.arange(len(r)), counts)
        live = (r.sizes > 0).all(axis=1)
        # local boxes of one shard pairwise disjoint (a shard of one piece has no pair)
        idx = np.flatnonzero(live)
        if (
            idx.size
            and (counts > 1).any()
            and _overlapping(owner[idx], r.local_offsets[idx], r.sizes[idx])
        ):
            return False
        boxes = np.concatenate([r.offsets[idx], r.sizes[idx]], axis=1)
        local_ids, firsts = rt.dense(boxes)
        to_global = np.array(
            [box_ids.setdefault(tuple(row), len(box_ids)) for row in boxes[firsts].tolist()],
            dtype=np.int64,
        )
        codes.append((r.tensor[owner[idx]], to_global[local_ids]))
    if not codes:
        return not any(math.prod(t.shape) for t in table.tensors) or table.shard_count() == 0
    nb = max(1, len(box_ids))
    code = np.concatenate([t * nb + b for t, b in codes])
    del codes
    code.sort()
    keep = np.empty(code.size, dtype=bool)
    keep[:1] = True
    np.not_equal(code[1:], code[:-1], out=keep[1:])
    code = code[keep]  # distinct (tensor, box), sorted by tensor
    del keep
    table_of_boxes = (
        np.array(list(box_ids), dtype=np.int64).reshape(len(box_ids), 2 * width)
        if box_ids
        else np.zeros((0, 2 * width), dtype=np.int64)
    )
    tensor = code // nb
    picked = table_of_boxes[code % nb]
    del code
    off, siz = picked[:, :width], picked[:, width:]
    if np.bincount(tensor, minlength=n).max() > rc.MAX_PIECES:
        return False
    vol = np.prod(siz, axis=1) if width else np.ones(len(tensor), dtype=np.int64)
    numel = np.prod(gshape, axis=1) if width else np.ones(n, dtype=np.int64)
    approx = np.bincount(tensor, weights=vol.astype(np.float64), minlength=n)
    exact = np.zeros(n, dtype=np.int64)
    np.add.at(exact, tensor, vol)
    if (np.abs(approx - numel) > numel * 1e-6 + 1).any() or (exact != numel).any():
        return False
    return not _overlapping(tensor, off, siz)


# ---- JSON conversions (tools, tests) ----------------------------------------------------------


def to_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """A schema-2 record as schema-1 JSON (rows per tensor and shard); trusts its input."""
    from shardctl.checkpoint.record import SCHEMA

    t = obj["tensors"]
    n = t["count"]
    ndim = _raw(t["ndim"])
    gs, ps = _split(_raw(t["global_shape"]), ndim), _split(_raw(t["padded_shape"]), ndim)
    dt = _raw(t["dtype"])
    out = dict(obj, schema=SCHEMA)
    out["tensors"] = [
        {
            "fqn": t["fqn"][i],
            "dtype": t["dtypes"][dt[i]],
            "global_shape": gs[i],
            "padded_shape": ps[i],
        }
        for i in range(n)
    ]
    files = [f["name"] for f in obj["files"]]
    ranks = []
    for r in obj["ranks"]:
        s = r["shards"]
        tensor, counts = _raw(s["tensor"]), _raw(s["pieces"])
        nd = [ndim[k] for k in tensor]
        pnd = [d for d, c in zip(nd, counts, strict=True) for _ in range(c)]
        local = _split(_raw(s["local_shape"]), nd)
        boxes = [_split(_raw(s[k]), pnd) for k in ("offsets", "sizes", "local_offsets")]
        place, fidx = _raw(s["placement"]), _raw(s["file"])
        rows, p = [], 0
        for j, k in enumerate(tensor):
            pieces = []
            for q in range(p, p + counts[j]):
                pieces.append(
                    {"offsets": boxes[0][q], "sizes": boxes[1][q], "local_offsets": boxes[2][q]}
                )
            p += counts[j]
            rows.append(
                {
                    "fqn": t["fqn"][k],
                    "file": files[fidx[j]],
                    "placement": s["placements"][place[j]],
                    "local_shape": local[j],
                    "pieces": pieces,
                }
            )
        ranks.append(dict(r, shards=rows))
    out["ranks"] = ranks
    return out


def to_v2(obj: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 record as schema-2 JSON; trusts its input's types (not its values)."""
    tensors = obj["tensors"]
    fqns = [t["fqn"] for t in tensors]
    index = {f: i for i, f in enumerate(fqns)}
    dtypes: dict[str, int] = {}
    tobj = {
        "count": len(tensors),
        "fqn": fqns,
        "dtypes": [],
        "dtype": column([dtypes.setdefault(t["dtype"], len(dtypes)) for t in tensors]),
        "ndim": column([len(t["global_shape"]) for t in tensors]),
        "global_shape": column([d for t in tensors for d in t["global_shape"]]),
        "padded_shape": column(
            [d for t in tensors for d in t.get("padded_shape", t["global_shape"])]
        ),
    }
    tobj["dtypes"] = list(dtypes)
    files = {f["name"]: i for i, f in enumerate(obj["files"])}
    ranks = []
    for r in obj["ranks"]:
        rows = r["shards"]
        places: dict[str, int] = {}
        place = [places.setdefault(s.get("placement", "?"), len(places)) for s in rows]
        pieces = [p for s in rows for p in s["pieces"]]
        shards = {
            "count": len(rows),
            "tensor": column([index[s["fqn"]] for s in rows]),
            "file": column([files[s["file"]] for s in rows]),
            "placements": list(places),
            "placement": column(place),
            "local_shape": column([d for s in rows for d in s["local_shape"]]),
            "pieces": column([len(s["pieces"]) for s in rows]),
        }
        for key in ("offsets", "sizes", "local_offsets"):
            shards[key] = column([d for p in pieces for d in p[key]])
        ranks.append(dict(r, shards=shards))
    return dict(obj, schema=SCHEMA_V2, tensors=tobj, ranks=ranks)


def _raw(col: dict[str, str]) -> list[int]:
    data = base64.b64decode(col["data"])
    return np.frombuffer(data, dtype=np.dtype(_TYPES[col["type"]])).astype(np.int64).tolist()


def _split(flat: list[int], lengths: Sequence[int]) -> list[list[int]]:
    out, p = [], 0
    for k in lengths:
        out.append(flat[p : p + k])
        p += k
    return out


# ---- the reader ------------------------------------------------------------------------------


def read(obj: dict[str, Any], where: str, *, exact_tiling: bool = True) -> Any:
    """Validate a schema-2 record and return its ``LayoutRecord`` (exit 3 on anything wrong)."""
    from shardctl.checkpoint import record as rec

    degrees, _ = rc.check_head(obj, where)
    tensors, ndim, gshape, padded = read_tensors(obj, where)
    ranks = rc.check_ranks_head(obj, degrees, where)
    fmt = obj["format"]
    files = rec.file_digests(obj, where)
    hash_name = rec.hash_name(obj["hash"], where)
    width = gshape.shape[1]
    table = rt.RecordTable(
        tensors,
        ndim,
        tuple(f.name for f in files),
        tuple(
            read_rank(r.get("shards"), f"ranks[{i}]", ndim, gshape, len(files), where)
            for i, r in enumerate(ranks)
        ),
        width,
    )
    for i, r in enumerate(table.ranks):
        # the distinct files of a rank (``file`` is one broadcast value when it has one)
        files_of = r.file[:1] if r.file.size and r.file.strides == (0,) else np.unique(r.file)
        for k in files_of.tolist():
            if files[k].name.startswith("."):
                j = int(np.argmax(r.file == k))
                raise rc._fail(
                    f"ranks[{i}].shards[{j}].file",
                    f"{files[k].name!r} is not a recorded file",
                    where,
                )
    layout = rec.make_layout(obj, table, padded) if fmt == "ranks" else None
    if layout is not None and exact_tiling and not tiles_exactly(table, gshape):
        rec.check_tiling(layout, where, tensors)  # names the piece, as for schema 1
        raise InvalidInputError("pieces do not tile their tensors exactly", where=where)
    return rec.LayoutRecord(
        format=fmt,
        architecture=str(obj.get("architecture", "unknown")),
        layout=layout,
        tensors=tensors,
        padded_shapes=padded,
        shard_files=rt.ShardFiles(table, rt.index_of(table)),
        hash=hash_name,
        files=files,
        carried=tuple(str(c) for c in obj.get("carried", [])),
        source=dict(obj.get("source") or {}),
        # the big tables are in ``table`` now: their JSON (base64 columns, ~20 MB at 90,000
        # tensors on 8 ranks) is not kept twice
        raw={k: v for k, v in obj.items() if k not in ("tensors", "ranks")},
        table=table if fmt == "ranks" else None,
    )
