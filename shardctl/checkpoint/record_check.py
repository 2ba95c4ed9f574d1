"""The layout record is hostile input until validated (RELIABILITY group I).

Two passes, both before any shard is opened or any byte written:

1. :func:`check_schema` — types and bounds of every field the reader uses: integers are JSON
   integers (not bools, strings or floats) within bounds, degrees ``1 ≤ d ≤ MAX_AXIS``, one rank
   entry per model-parallel rank whose ``rank`` and ``coord`` match its position, file names a
   single path component (confined to DST), at most ``MAX_DIMS`` dims, names valid UTF-8.
2. :func:`check_tiling` — per tensor, the distinct pieces of all ranks (replicas hold identical
   boxes) tile ``global_shape`` exactly: inside it, pairwise disjoint, volumes summing to its
   element count; within one shard, pieces' local boxes are disjoint. A record with one offset
   changed (``32 → 22``) covers the same element count with an overlap and a gap; the copy would
   read rows twice and leave others as stale buffer bytes, so it is refused here (exit 3).

Every refusal is one line naming the field, e.g.
``shardctl.layout.json: ranks[1].shards[0].pieces[0]: overlaps ranks[0].shards[0].pieces[0]
of 'w' ...``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from shardctl.dtypes import DTYPE_BITS
from shardctl.errors import InvalidInputError
from shardctl.manifest.limits import MAX_AXIS  # the manifest's cap on a mesh degree

MAX_DIM = 2**40  # one dimension of a tensor
MAX_NUMEL = 2**62  # elements of one tensor
MAX_DIMS = 64  # dimensions of one tensor (torch's own limit)
MAX_NAME = 4096  # characters of an fqn or a file name
MAX_FILE_SIZE = 2**50
MAX_PIECES = 2**16  # distinct pieces of one tensor across all ranks
MAX_ENTRIES = 2**24  # tensors, shards, files: each list


def _fail(field: str, message: str, where: str) -> InvalidInputError:
    return InvalidInputError(f"{field}: {message}", where=where)


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(v), "null" if v is None else type(v).__name__)


def _int(v: Any, field: str, where: str, lo: int = 0, hi: int = MAX_NUMEL) -> int:
    if type(v) is not int:
        raise _fail(field, f"expected an integer, got {_kind(v)}", where)
    if not lo <= v <= hi:
        raise _fail(field, f"{v} is out of range [{lo}, {hi}]", where)
    return v


def _text(v: Any, field: str, where: str, *, name: bool = False) -> str:
    if not isinstance(v, str):
        raise _fail(field, f"expected a string, got {_kind(v)}", where)
    if len(v) > MAX_NAME:
        raise _fail(field, f"longer than {MAX_NAME} characters", where)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(field, "not valid Unicode (a lone surrogate)", where) from None
    if name and not v:
        raise _fail(field, "empty name", where)
    return v


def _list(v: Any, field: str, where: str, hi: int = MAX_ENTRIES) -> list[Any]:
    if not isinstance(v, list):
        raise _fail(field, f"expected a list, got {_kind(v)}", where)
    if len(v) > hi:
        raise _fail(field, f"{len(v)} entries, above the limit of {hi}", where)
    return v


def _obj(v: Any, field: str, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(field, f"expected an object, got {_kind(v)}", where)
    return v


def _shape(v: Any, field: str, where: str, lo: int = 0) -> tuple[int, ...]:
    dims = _list(v, field, where, MAX_DIMS)
    out = tuple(_int(d, f"{field}[{i}]", where, lo, MAX_DIM) for i, d in enumerate(dims))
    if math.prod(out) > MAX_NUMEL:
        raise _fail(field, f"{list(out)} has more than 2^62 elements", where)
    return out


def file_name(v: Any, field: str, where: str) -> str:
    """A name that stays inside DST: one path component, not ``.``/``..``, no NUL/backslash."""
    name = _text(v, field, where, name=True)
    if (
        name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name.startswith("..")
    ):
        raise _fail(field, f"{name!r} is not a plain file name inside the output", where)
    return name


def check_schema(obj: dict[str, Any], where: str) -> None:
    """Types and bounds of every field :func:`shardctl.checkpoint.record.read` uses."""
    degrees, names = check_head(obj, where)
    seen: set[str] = set()
    for i, t in enumerate(_list(obj.get("tensors"), "tensors", where)):
        w = f"tensors[{i}]"
        t = _obj(t, w, where)
        fqn = _text(t.get("fqn"), f"{w}.fqn", where, name=True)
        if fqn in seen:
            raise _fail(f"{w}.fqn", f"duplicate name {fqn!r}", where)
        seen.add(fqn)
        dtype = _text(t.get("dtype"), f"{w}.dtype", where)
        if dtype not in DTYPE_BITS:
            raise _fail(f"{w}.dtype", f"unknown dtype {dtype!r}", where)
        shape = _shape(t.get("global_shape"), f"{w}.global_shape", where)
        if "padded_shape" in t:
            padded = _shape(t["padded_shape"], f"{w}.padded_shape", where)
            if len(padded) != len(shape) or any(p < g for p, g in zip(padded, shape, strict=True)):
                raise _fail(
                    f"{w}.padded_shape", f"{list(padded)} smaller than {list(shape)}", where
                )
    ranks = check_ranks_head(obj, degrees, where)
    if ranks:
        _ranks(ranks, seen, names, where)


def check_ranks_head(obj: dict[str, Any], degrees: dict[str, int], where: str) -> list[Any]:
    """The ``ranks`` list: empty for format 'hf'; else one entry per model-parallel rank whose
    ``rank`` and ``coord`` match its position (both schemas)."""
    ranks = _list(obj.get("ranks", []), "ranks", where)
    if obj.get("format") == "hf":
        if ranks:
            raise _fail("ranks", "format 'hf' has no rank entries", where)
        return []
    pp, ep, tp = degrees["pp"], degrees["ep"], degrees["tp"]
    if len(ranks) != pp * ep * tp:
        raise _fail(
            "ranks",
            f"{len(ranks)} entries for a mesh of pp {pp} × ep {ep} × tp {tp} = {pp * ep * tp} "
            "model-parallel ranks",
            where,
        )
    for i, r in enumerate(ranks):
        w = f"ranks[{i}]"
        r = _obj(r, w, where)
        if "rank" in r and _int(r["rank"], f"{w}.rank", where, 0, MAX_NUMEL) != i:
            raise _fail(f"{w}.rank", f"{r['rank']} at position {i}", where)
        c = _obj(r.get("coord"), f"{w}.coord", where)
        want = {"pp": i // (ep * tp), "ep": (i // tp) % ep, "tp": i % tp}
        for axis, expect in want.items():
            got = _int(c.get(axis), f"{w}.coord.{axis}", where, 0, MAX_AXIS)
            if got != expect:
                raise _fail(
                    f"{w}.coord.{axis}",
                    f"{got}, but rank {i} of mesh pp {pp} × ep {ep} × tp {tp} is at {expect}",
                    where,
                )
    return ranks


def check_head(obj: dict[str, Any], where: str) -> tuple[dict[str, int], set[str]]:
    """Every field but the ``tensors`` and ``ranks`` tables (the same in both schemas); the
    mesh degrees and the recorded file names."""
    fmt = obj.get("format")
    if fmt not in ("ranks", "hf"):
        raise _fail("format", f"expected 'ranks' or 'hf', got {fmt!r}", where)
    if "architecture" in obj:
        _text(obj["architecture"], "architecture", where)
    mesh = _obj(obj.get("mesh"), "mesh", where)
    degrees = {
        a: _int(mesh.get(a, 1), f"mesh.{a}", where, 1, MAX_AXIS) for a in ("pp", "dp", "ep", "tp")
    }
    extra = set(mesh) - set(degrees)
    if extra:
        raise _fail("mesh", f"unknown axis {sorted(extra)[0]!r}", where)
    opts = obj.get("options")
    if opts is not None:
        _options(_obj(opts, "options", where), where)
    for i, s in enumerate(_list(obj.get("stages", []), "stages", where, MAX_AXIS)):
        s = _obj(s, f"stages[{i}]", where)
        _int(s.get("index"), f"stages[{i}].index", where, 0, MAX_AXIS)
        layers = s.get("layers")
        if layers is not None:
            pair = _list(layers, f"stages[{i}].layers", where)
            if len(pair) != 2:
                raise _fail(f"stages[{i}].layers", "expected [first, last]", where)
            a = _int(pair[0], f"stages[{i}].layers[0]", where, 0, MAX_DIM)
            b = _int(pair[1], f"stages[{i}].layers[1]", where, 0, MAX_DIM)
            if a > b:
                raise _fail(f"stages[{i}].layers", f"first {a} > last {b}", where)
    _source(obj.get("source"), where)
    _text(obj.get("hash"), "hash", where)
    names: set[str] = set()
    for i, f in enumerate(_list(obj.get("files"), "files", where)):
        f = _obj(f, f"files[{i}]", where)
        name = file_name(f.get("name"), f"files[{i}].name", where)
        if name in names:
            raise _fail(f"files[{i}].name", f"duplicate file {name!r}", where)
        names.add(name)
        _int(f.get("size"), f"files[{i}].size", where, 0, MAX_FILE_SIZE)
        digest = _text(f.get("digest"), f"files[{i}].digest", where)
        if len(digest) > 256:
            raise _fail(f"files[{i}].digest", "longer than 256 characters", where)
    for i, c in enumerate(_list(obj.get("carried", []), "carried", where)):
        file_name(c, f"carried[{i}]", where)
    return degrees, names


def _options(o: dict[str, Any], where: str) -> None:
    choices = {
        "pipeline": ("even", "vllm", "tensorrt-llm", "megatron"),
        "vocab_padding": ("none", "tp", "megatron"),
        "uneven": ("error", "chunk"),
    }
    for key, allowed in choices.items():
        if key in o and o[key] not in allowed:
            raise _fail(f"options.{key}", f"expected one of {', '.join(allowed)}", where)
    lps = o.get("layers_per_stage")
    if lps is not None:
        for i, n in enumerate(_list(lps, "options.layers_per_stage", where, MAX_AXIS)):
            _int(n, f"options.layers_per_stage[{i}]", where, 0, MAX_DIM)


def _source(v: Any, where: str) -> None:
    if v is None:
        return
    src = _obj(v, "source", where)
    if "kind" in src:
        _text(src["kind"], "source.kind", where)
    if "path" in src and src["path"] is not None:
        _text(src["path"], "source.path", where)
    for i, f in enumerate(_list(src.get("files", []), "source.files", where)):
        f = _obj(f, f"source.files[{i}]", where)
        _text(f.get("name"), f"source.files[{i}].name", where, name=True)
        _int(f.get("size"), f"source.files[{i}].size", where, 0, MAX_FILE_SIZE)
        if "mtime_ns" in f:
            _int(f["mtime_ns"], f"source.files[{i}].mtime_ns", where, -(2**63), 2**63 - 1)
        if f.get("sha256") is not None:
            _text(f["sha256"], f"source.files[{i}].sha256", where)
    if src.get("record") is not None:
        _obj(src["record"], "source.record", where)


def _ranks(ranks: list[Any], fqns: set[str], files: set[str], where: str) -> None:
    for i, r in enumerate(ranks):
        w = f"ranks[{i}]"
        for j, s in enumerate(_list(r.get("shards"), f"{w}.shards", where)):
            if _shard_ok(s, fqns, files):
                continue  # the checks below would all pass; they run to name what fails
            ws = f"{w}.shards[{j}]"
            s = _obj(s, ws, where)
            fqn = _text(s.get("fqn"), f"{ws}.fqn", where, name=True)
            if fqn not in fqns:
                raise _fail(ws, f"tensor {fqn!r} not in 'tensors'", where)
            file = file_name(s.get("file"), f"{ws}.file", where)
            if file not in files:
                raise _fail(f"{ws}.file", f"{file!r} is not a recorded file", where)
            if "placement" in s:
                _text(s["placement"], f"{ws}.placement", where)
            _shape(s.get("local_shape"), f"{ws}.local_shape", where)
            for k, p in enumerate(_list(s.get("pieces"), f"{ws}.pieces", where, MAX_PIECES)):
                wp = f"{ws}.pieces[{k}]"
                p = _obj(p, wp, where)
                for key in ("offsets", "sizes", "local_offsets"):
                    _shape(p.get(key), f"{wp}.{key}", where)


def _shape_ok(v: Any) -> bool:
    """What :func:`_shape` accepts, without building a field name per dim (180,000 shards)."""
    if type(v) is not list or len(v) > MAX_DIMS:
        return False
    n = 1
    for d in v:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            return False
        n *= d
    return n <= MAX_NUMEL


def _shard_ok(s: Any, fqns: set[str], files: set[str]) -> bool:
    """True when every check of a shard row in :func:`_ranks` passes (``fqns``/``files`` hold
    names already validated); False sends the row through them to name the failure."""
    if type(s) is not dict:
        return False
    fqn, file = s.get("fqn"), s.get("file")
    if type(fqn) is not str or fqn not in fqns or type(file) is not str or file not in files:
        return False
    if "placement" in s:
        pl = s["placement"]
        if type(pl) is not str or len(pl) > MAX_NAME:
            return False
        if not pl.isascii():  # "E·S(1)"; a lone surrogate cannot be encoded
            try:
                pl.encode("utf-8")
            except UnicodeEncodeError:
                return False
    if not _shape_ok(s.get("local_shape")):
        return False
    pieces = s.get("pieces")
    if type(pieces) is not list or len(pieces) > MAX_PIECES:
        return False
    for p in pieces:
        if type(p) is not dict:
            return False
        if not (
            _shape_ok(p.get("offsets"))
            and _shape_ok(p.get("sizes"))
            and _shape_ok(p.get("local_offsets"))
        ):
            return False
    return True


# ---- exact tiling ------------------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _disjoint(a: Box, b: Box) -> bool:
    return any(
        ao + an <= bo or bo + bn <= ao
        for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def overlap(boxes: Sequence[tuple[Box, str]]) -> tuple[str, str] | None:
    """The labels of two overlapping boxes, or None. A sweep along the dim with the most
    distinct offsets: each box is compared only with boxes still open along that dim."""
    live = [(b, lab) for b, lab in boxes if all(n > 0 for n in b[1])]
    if len(live) < 2:
        return None
    nd = len(live[0][0][0])
    if nd == 0:
        return live[0][1], live[1][1]  # two non-empty scalars: the same element twice
    d = max(range(nd), key=lambda k: len({b[0][k] for b, _ in live}))
    live.sort(key=lambda x: x[0][0][d])
    active: list[tuple[Box, str]] = []
    for box, lab in live:
        start = box[0][d]
        active = [(b, lb) for b, lb in active if b[0][d] + b[1][d] > start]
        for other, olab in active:
            if not _disjoint(box, other):
                return olab, lab
        active.append((box, lab))
    return None


def check_tiling(
    tensors: dict[str, tuple[int, ...]],
    shards: Sequence[tuple[str, str, tuple[int, ...], Sequence[Box], Sequence[tuple[int, ...]]]],
    where: str,
) -> None:
    """Each tensor's distinct pieces tile its global shape exactly; local boxes are disjoint.

    ``shards``: ``(label, fqn, local_shape, [(offsets, sizes)], [local_offsets])`` per shard,
    labels like ``ranks[1].shards[0]``. Replicas hold identical boxes and count once.
    """
    distinct: dict[str, dict[Box, str]] = {fqn: {} for fqn in tensors}
    for label, fqn, local, boxes, locs in shards:
        g = tensors[fqn]
        local_boxes: list[tuple[Box, str]] = []
        for k, ((off, siz), loc) in enumerate(zip(boxes, locs, strict=True)):
            wp = f"{label}.pieces[{k}]"
            if not (len(off) == len(siz) == len(loc) == len(g) == len(local)):
                raise _fail(wp, f"rank of the box differs from the tensor's {len(g)}", where)
            if any(o + n > gd for o, n, gd in zip(off, siz, g, strict=True)):
                raise _fail(wp, f"box outside the global shape {list(g)} of {fqn!r}", where)
            if any(lo + n > ld for lo, n, ld in zip(loc, siz, local, strict=True)):
                raise _fail(wp, f"box outside the local shape {list(local)}", where)
            local_boxes.append(((loc, siz), wp))
            if math.prod(siz) > 0:
                distinct[fqn].setdefault((off, siz), wp)
                if len(distinct[fqn]) > MAX_PIECES:
                    raise _fail(wp, f"more than {MAX_PIECES} distinct pieces of {fqn!r}", where)
        clash = overlap(local_boxes)
        if clash is not None:
            raise _fail(clash[1], f"overlaps {clash[0]} inside the local tensor", where)
    for fqn, pieces in distinct.items():
        g = tensors[fqn]
        if not pieces:
            if math.prod(g) > 0 and shards:
                raise _fail("ranks", f"no rank holds any piece of {fqn!r}", where)
            continue
        clash = overlap([(b, lab) for b, lab in pieces.items()])
        if clash is not None:
            raise _fail(
                clash[1],
                f"overlaps {clash[0]} of {fqn!r}: pieces must tile the tensor exactly",
                where,
            )
        covered = sum(math.prod(s) for _, s in pieces)
        if covered != math.prod(g):
            raise _fail(
                f"pieces of {fqn!r}",
                f"cover {covered} of its {math.prod(g)} elements (a gap): "
                "pieces must tile the tensor exactly",
                where,
            )


__all__ = ["MAX_AXIS", "MAX_DIMS", "check_schema", "check_tiling", "file_name", "overlap"]
