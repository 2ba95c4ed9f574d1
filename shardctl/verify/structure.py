"""Level 1, structure: from headers and the record only — no tensor data is read.

Checks, each a finding naming the tensor / rank / file:

- the same tensors on both sides (missing, extra, renamed), same global shape and dtype;
- DST's files agree with its record (``dst.py``): shards present with the recorded dtype and
  local shape, no unrecorded tensors or files, sizes as recorded, each rank file where its
  header says it belongs (swapped rank files);
- coverage: within every tensor-parallel group ``(pp, ep)`` that holds a tensor, its pieces tile
  the tensor exactly — distinct boxes disjoint, no gaps; identical boxes are replicas (K/V heads
  when ``tp > kv heads``, norms); every non-expert tensor present in every ``ep`` group of its
  stage, an expert in exactly one; a tensor of packed experts (``experts.gate_up_proj [E, ..]``)
  may instead be split over the stage's ``ep`` groups, which then tile it together, disjointly;
- stages complete and contiguous (``0..L-1`` in order), each layer's tensors only on its stage;
- the original unchanged since the reshard (size and mtime against the record's ``source``).
"""

from __future__ import annotations

import math
import os
import re
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.checkpoint import record_table as rt
from shardctl.layout.types import Layout, Piece
from shardctl.model.types import TensorInfo
from shardctl.verify.dst import Destination, RecordDstShards
from shardctl.verify.kinds import dense, shard_kinds
from shardctl.verify.result import LevelResult

_LAYER = re.compile(r"^(?:model\.layers|transformer\.h|model\.decoder\.layers)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _per_name(fqns: list[str], pattern: str) -> list[str] | None:
    """For each name, group 1 of its first match of ``pattern`` ("" where it has none), in
    one ``findall`` over the names joined by newlines (``pattern`` never spans a newline;
    ``^`` is the name's start); None when a name holds a newline itself."""
    joined = "\n".join(fqns)
    if joined.count("\n") != max(len(fqns) - 1, 0):
        return None
    # every line matches once: the pattern where it is found, else nothing, then the rest
    got = re.findall(rf"^(?:{pattern})?.*$", joined, re.M)  # re caches the compiled pattern
    return got if len(got) == len(fqns) else None


def _layer_numbers(fqns: list[str]) -> np.ndarray:
    """Each name's layer number (``_LAYER``), -1 where it has none."""
    got = None
    if _LAYER.pattern.startswith("^"):  # anchored at the name's start by _per_name
        got = _per_name(fqns, _LAYER.pattern.removeprefix("^"))
    if got is None:
        return np.fromiter(
            (int(m.group(1)) if (m := _LAYER.match(f)) else -1 for f in fqns), np.int64, len(fqns)
        )
    out = np.full(len(fqns), -1, dtype=np.int64)
    at = np.flatnonzero(np.fromiter(map(bool, got), bool, len(got)))
    if at.size:
        out[at] = np.array([got[i] for i in at.tolist()], dtype=np.int64)
    return out


def check_structure(
    src_tensors: dict[str, TensorInfo], src_root: Path, src_files: list[Path], dst: Destination
) -> LevelResult:
    level = LevelResult("structure")
    _names(level, src_tensors, dst)
    level.findings.extend(dst.problems)
    layout = dst.layout
    if isinstance(dst.shards, RecordDstShards):
        shards = dst.shards.shard_count()  # the record's columns: no shard built
    else:
        shards = sum(len(v) for v in dst.shards.values())
    level.figures.update(
        tensors=len(src_tensors), shards=shards, files=len(dst.files), kind=dst.kind
    )
    if layout is not None:
        level.figures.update(mesh=layout.mesh.as_dict())
        table = dst.record.table if dst.record is not None else None
        # the record's columns settle a clean layout; anything else is worded shard by shard
        if table is None or not coverage_clean(layout, table, src_tensors):
            _coverage(level, layout, src_tensors)
        _stages(level, layout, dst)
    elif dst.kind == "hf":
        for fqn, ss in dst.shards.items():
            if fqn in src_tensors and len(ss) != 1:
                level.fail(f"held {len(ss)} times", fqn=fqn)
    _source_identity(level, src_root, src_files, dst)
    return level.close()


_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def _names(level: LevelResult, src: dict[str, TensorInfo], dst: Destination) -> None:
    # the same names, shapes and dtypes (the usual case): set and list compares in C
    if src.keys() == dst.tensors.keys():
        # column by column: no (shape, dtype) pair made per tensor (~27 → ~17 ms at 90,000)
        out = list(map(dst.tensors.__getitem__, src))
        if list(map(_SHAPE, src.values())) == list(map(_SHAPE, out)) and list(
            map(_DTYPE, src.values())
        ) == list(map(_DTYPE, out)):
            return
    missing = [f for f in src if f not in dst.tensors]
    extra = [f for f in dst.tensors if f not in src]
    for f in missing:
        level.fail("in the source, missing from the output", fqn=f)
    for f in extra:
        level.fail("in the output, not in the source", fqn=f)
    for fqn, t in src.items():
        d = dst.tensors.get(fqn)
        if d is not None and (d.shape, d.dtype) != (t.shape, t.dtype):
            level.fail(
                f"output {list(d.shape)} {d.dtype}, source {list(t.shape)} {t.dtype}", fqn=fqn
            )
    level.figures["missing"] = len(missing)
    level.figures["extra"] = len(extra)


def _boxes_tile(shape: tuple[int, ...], boxes: list[Piece]) -> str | None:
    """None when the distinct boxes are disjoint and cover ``shape``; else what is wrong."""
    distinct = list({(p.offsets, p.sizes) for p in boxes})
    if _slabs(shape, distinct):
        return None
    total = math.prod(shape)
    covered = sum(math.prod(s) for _, s in distinct)
    for i, (oa, sa) in enumerate(distinct):
        for ob, sb in distinct[i + 1 :]:
            if all(a < b + n and b < a + m for a, m, b, n in zip(oa, sa, ob, sb, strict=True)):
                return f"pieces at {list(oa)} and {list(ob)} overlap"
    if covered < total:
        return f"pieces cover {covered} of {total} elements"
    if covered > total:
        return f"pieces cover {covered} elements of a {total}-element tensor"
    return None


def _slabs(shape: tuple[int, ...], distinct: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """The common case, decided without the pairwise check: boxes whole on every dim but one,
    along which they follow each other from 0 to its end (a tp split, or the whole tensor)."""
    if len(distinct) == 1:
        offsets, sizes = distinct[0]
        return sizes == shape and not any(offsets)
    split = -1
    ndim = len(shape)
    for o, z in distinct:
        if len(o) != ndim or len(z) != ndim:
            return False
        for d in range(ndim):
            if o[d] or z[d] != shape[d]:
                if split == -1:
                    split = d
                elif split != d:
                    return False
    if split == -1:
        return False  # identical whole boxes: distinct has one entry, so not reached
    cursor = 0
    for start, size in sorted((o[split], z[split]) for o, z in distinct):
        if start != cursor or size == 0:
            return False
        cursor += size
    return cursor == shape[split]


def _coverage(level: LevelResult, layout: Layout, src: dict[str, TensorInfo]) -> None:
    # fqn -> (pp, ep) -> the boxes that group holds, as (offsets, sizes) pairs
    groups: dict[str, dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for rl in layout.ranks:
        at = (rl.pp, rl.ep)
        for s in rl.shards:
            held = groups.get(s.fqn)
            if held is None:
                held = groups[s.fqn] = {}
            boxes = held.get(at)
            if boxes is None:
                boxes = held[at] = []
            boxes.extend([(p.offsets, p.sizes) for p in s.pieces])
    mesh = layout.mesh
    # The verdict on a group's boxes depends only on the shape and the set of boxes: at 90,000
    # tensors a few dozen kinds (an expert's w1 halves, its w2 halves, a norm's replicas), so
    # each kind is tiled once and every other group of it costs one lookup.
    verdicts: dict[tuple[tuple[int, ...], frozenset[Any]], str | None] = {}
    for fqn, t in src.items():
        held = groups.get(fqn)
        if not held:
            level.fail("no rank holds it", fqn=fqn)
            continue
        shape = t.shape if t.shape else (1,)
        split_over_ep: set[int] = set()  # stages where the ep groups hold disjoint parts
        for (pp, ep), boxes in sorted(held.items()) if len(held) > 1 else held.items():
            key = (shape, frozenset(boxes))
            try:
                bad = verdicts[key]
            except KeyError:
                bad = verdicts[key] = _boxes_tile(shape, _norm_boxes(boxes))
            if bad and pp not in split_over_ep:
                if _tiles_over_ep(shape, held, pp, mesh.ep):
                    split_over_ep.add(pp)  # packed experts: E/ep rows of dim 0 per ep group
                    continue
                level.fail(f"tp group pp={pp} ep={ep}: {bad}", fqn=fqn)
        if len(held) == 1:
            ((pp, ep),) = held
            eps, stages = {ep}, {pp}
        else:
            eps = {ep for _, ep in held}
            stages = {pp for pp, _ in held}
        if _EXPERT.search(fqn):
            if len(eps) != 1:
                level.fail(f"expert held by {len(eps)} ep groups, expected 1", fqn=fqn)
        elif mesh.ep > 1:
            for pp in stages - split_over_ep:
                have = {ep for p, ep in held if p == pp}
                if len(have) != mesh.ep:
                    level.fail(
                        f"replica missing: stage {pp} holds it in ep groups "
                        f"{sorted(have)} of {mesh.ep}",
                        fqn=fqn,
                    )


def coverage_clean(layout: Layout, table: rt.RecordTable, src: dict[str, TensorInfo]) -> bool:
    """True when :func:`_coverage` would find nothing, decided on the record's columns: every
    tensor SRC has is held, each ``(pp, ep)`` group's boxes of it tile it, an expert sits in one
    ep group and anything else in every ep group of its stages. False: ``_coverage`` decides
    (and words each finding). At 180,000 shards: ~0.1 s instead of ~1.3 s, no shard built.

    A group's verdict depends only on the tensor's shape and its set of boxes, so the
    ``(tensor, group)`` pairs are folded into kinds (shape id, box-set ids) and each kind is
    tiled once by the same ``_boxes_tile``."""
    mesh = layout.mesh
    if len(layout.ranks) != len(table.ranks):
        return False
    index = rt.index_of(table)
    n = len(table.tensors)
    shape_ids: dict[tuple[int, ...], int] = {}
    sid = np.full(n, -1, dtype=np.int64)  # the SRC shape of each tensor SRC has, as an id
    for fqn, info in src.items():
        at = index.get(fqn)
        if at is None:
            return False  # "no rank holds it"
        sid[at] = shape_ids.setdefault(info.shape if info.shape else (1,), len(shape_ids))
    shapes = list(shape_ids)
    group_ids: dict[tuple[int, int], int] = {}
    for rl in layout.ranks:
        group_ids.setdefault((rl.pp, rl.ep), len(group_ids))
    box_ids: dict[tuple[Any, ...], int] = {}
    # Per rank: the rows of tensors SRC has, and each row's box-set id. Kept per rank and
    # narrow until the box-set count is known: at 90,000 tensors on 8 ranks there are 720,000
    # rows, and three concatenated int64 columns plus np.unique's copies were ~80 MB.
    cols: list[tuple[np.ndarray, int, np.ndarray]] = []
    held = np.zeros(n, dtype=bool)
    for rl, r in zip(layout.ranks, table.ranks, strict=True):
        kinds = shard_kinds(table, r)
        if kinds is None:
            return False
        boxset = np.array(
            [
                box_ids.setdefault(tuple((p.offsets, p.sizes) for p in pieces), len(box_ids))
                for _, pieces in kinds[1]
            ],
            dtype=np.int32,
        )
        mine = sid[r.tensor] >= 0  # tensors SRC lacks are "extra" (``_names``), not covered here
        every = bool(mine.all())
        t = r.tensor if every else r.tensor[mine]
        held[t] = True
        ids = np.frombuffer(kinds[0], np.int32)
        cols.append((t, group_ids[rl.pp, rl.ep], boxset[ids if every else ids[mine]]))
    if not cols:
        return not src
    if int(held.sum()) != len(src):
        return False  # "no rank holds it"
    ng, nb = max(1, len(group_ids)), max(1, len(box_ids))
    if n * ng * nb >= 2**62:
        return False
    codes = np.empty(sum(c[0].size for c in cols), dtype=np.int64)
    at = 0
    for t, gid, b in cols:
        part = codes[at : at + t.size]
        np.multiply(t, ng * nb, out=part)
        part += gid * nb
        part += b
        at += t.size
    del cols
    codes.sort()
    keep = np.empty(codes.size, dtype=bool)
    keep[:1] = True
    np.not_equal(codes[1:], codes[:-1], out=keep[1:])
    u = codes[keep]  # distinct (tensor, group, box set)
    del codes, keep
    tg, bb = np.divmod(u, nb)
    size = u.size
    del u
    bb = bb.astype(np.int32)  # box-set ids: few
    starts = np.flatnonzero(np.r_[True, tg[1:] != tg[:-1]])
    tg = tg[starts]  # the distinct (tensor, group) pairs; 800,000 rows at tp 8 held only here
    counts = np.diff(np.r_[starts, size])
    kinds_of = np.full((starts.size, int(counts.max()) + 1), -1, dtype=np.int32)
    kinds_of[:, 0] = sid[tg // ng]
    idx = np.dtype(np.int32 if size < 2**31 else np.int64)
    row = np.repeat(np.arange(starts.size, dtype=idx), counts)
    col: np.ndarray = np.arange(1, size + 1, dtype=idx)
    np.subtract(col, np.repeat(starts.astype(idx), counts), out=col)
    kinds_of[row, col] = bb
    del row, col, bb
    sets = list(box_ids)
    for row in kinds_of[dense(kinds_of)[1]].tolist():
        boxes = [box for k in row[1:] if k >= 0 for box in sets[k]]
        if _boxes_tile(shapes[row[0]], _norm_boxes(boxes)) is not None:
            return False  # a gap, an overlap, or experts packed over ep: worded by _coverage
    # ep groups: an expert in one, anything else in every ep group of each of its stages
    pp_of = np.array([pp for pp, _ in group_ids], dtype=np.int64)
    ep_of = np.array([ep for _, ep in group_ids], dtype=np.int64)
    tt, gg = tg // ng, tg % ng  # the distinct (tensor, group) pairs
    eps = int(ep_of.max()) + 1
    te = np.unique(tt * eps + ep_of[gg])  # distinct (tensor, ep)
    ep_count = np.bincount(te // eps, minlength=n)
    fqns = [x.fqn for x in table.tensors]
    # one search per name (a joined-text findall of this unanchored pattern measured slower)
    expert = np.fromiter((_EXPERT.search(f) is not None for f in fqns), dtype=bool, count=n)
    if (ep_count[expert & held] != 1).any():
        return False
    if mesh.ep > 1:
        stages = int(pp_of.max()) + 1
        tpe = np.unique((tt * stages + pp_of[gg]) * eps + ep_of[gg])  # distinct (t, pp, ep)
        tp_, per = np.unique(tpe // eps, return_counts=True)
        if (per[~expert[tp_ // stages]] != mesh.ep).any():
            return False
    return True


def _norm_boxes(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[Piece]:
    """Boxes as pieces, a 0-d tensor's as one element of a ``(1,)`` tensor."""
    return _norm([Piece(o, z, o) for o, z in boxes])


def _norm(pieces: list[Piece]) -> list[Piece]:
    """A 0-d tensor's piece as one element of a ``(1,)`` tensor."""
    return [p if p.sizes else Piece((0,), (1,), (0,)) for p in pieces]


def _tiles_over_ep(
    shape: tuple[int, ...],
    held: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]],
    pp: int,
    ep: int,
) -> bool:
    """True when every ep group of stage ``pp`` holds a part and together, with no two groups
    overlapping, they tile the tensor (experts packed in one tensor, split over ep on dim 0)."""
    groups = [
        {(p.offsets, p.sizes) for p in _norm_boxes(v)} for (s, _), v in held.items() if s == pp
    ]
    if ep < 2 or len(groups) != ep:
        return False
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            if a & b:
                return False
    union = [Piece(o, z, o) for g in groups for o, z in g]
    return _boxes_tile(shape, union) is None


def _stages(level: LevelResult, layout: Layout, dst: Destination) -> None:
    expect = 0
    for stage in layout.stages:
        if stage.layers is None:
            continue
        if stage.layers[0] != expect or stage.layers[1] < stage.layers[0]:
            level.fail(
                f"stage {stage.index} holds layers {list(stage.layers)}, expected to start at "
                f"{expect}: stages not contiguous"
            )
        expect = stage.layers[1] + 1
    layers = dst.config.get("num_hidden_layers") or dst.config.get("n_layer")
    if isinstance(layers, int) and layout.stages and expect != layers:
        level.fail(f"stages cover layers 0..{expect - 1} of {layers}")
    layer_of: dict[str, int | None] = {}  # an fqn's layer, once per fqn (tp ranks share it)
    record = getattr(dst, "record", None)  # a Destination, or anything with layout and config
    table = record.table if record is not None else None
    if table is not None and _stages_clean(layout, table, layers):
        return
    for i, rl in enumerate(layout.ranks):
        st = layout.stages[rl.pp] if rl.pp < len(layout.stages) else None
        if st is None or st.layers is None:
            continue
        # the names a rank holds: from the record's columns when it has them (no shard built)
        fqns = rt.rank_fqns(table, i) if table is not None else [s.fqn for s in rl.shards]
        for fqn in fqns:
            try:
                n = layer_of[fqn]
            except KeyError:
                m = _LAYER.match(fqn)
                n = layer_of[fqn] = int(m.group(1)) if m else None
            if n is not None:
                if isinstance(layers, int) and n >= layers:  # after the stack (MTP): last stage
                    if rl.pp != len(layout.stages) - 1:
                        level.fail(
                            f"layer {n} (after the {layers} decoder layers) on stage {rl.pp}, "
                            f"not the last",
                            fqn=fqn,
                            rank=i,
                        )
                    continue
                if not st.layers[0] <= n <= st.layers[1]:
                    level.fail(
                        f"layer {n} on stage {rl.pp} (layers {list(st.layers)})",
                        fqn=fqn,
                        rank=i,
                    )


def _stages_clean(layout: Layout, table: rt.RecordTable, layers: Any) -> bool:
    """True when every rank's layer tensors lie in its stage's layers (those after the stack
    on the last stage), decided on the record's columns: one name match per tensor, not one
    per shard. False: the loop in :func:`_stages` decides and words each finding."""
    if len(layout.ranks) != len(table.ranks):
        return False
    layer = _layer_numbers([t.fqn for t in table.tensors])
    last = len(layout.stages) - 1
    for rl, r in zip(layout.ranks, table.ranks, strict=True):
        st = layout.stages[rl.pp] if rl.pp < len(layout.stages) else None
        if st is None or st.layers is None:
            continue
        n = layer[r.tensor]
        n = n[n >= 0]
        if isinstance(layers, int):
            after = n >= layers  # after the decoder stack (MTP): the last stage's
            if after.any() and rl.pp != last:
                return False
            n = n[~after]
        if ((n < st.layers[0]) | (n > st.layers[1])).any():
            return False
    return True


def _source_identity(
    level: LevelResult, src_root: Path, src_files: list[Path], dst: Destination
) -> None:
    """G6: the record remembers the original's sizes and mtimes; say when they moved."""
    if dst.record is None:
        return
    source = dst.record.source
    try:
        same = os.path.realpath(str(source.get("path"))) == os.path.realpath(src_root)
    except (TypeError, ValueError):
        same = False
    if not same:
        level.figures["source_identity"] = "other path (not compared)"
        return
    now = {p.name: os.stat(p) for p in src_files}
    changed = []
    for f in source.get("files") or []:
        st = now.get(f.get("name"))
        if st is None:
            continue
        if st.st_size != f.get("size"):
            level.fail(
                f"original changed since reshard: size {st.st_size} B, the record says "
                f"{f.get('size')} B",
                file=f.get("name"),
            )
        elif st.st_mtime_ns != f.get("mtime_ns"):
            changed.append(f.get("name"))
    level.figures["source_identity"] = (
        f"original changed since reshard (mtime differs: {', '.join(changed)})"
        if changed
        else "unchanged"
    )
