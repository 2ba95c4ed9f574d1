"""Split one tensor over ``tp`` ranks: which pieces each rank holds, and its local shape.

A tensor is cut along one dim, made of one or more *parts* (``[Q; K; V]``, ``[gate; up]``, or a
single part). Each part is split on its own, then each rank's pieces are concatenated in part
order — never a plain chunk of the fused dim (the trap of DESIGN.md). gpt-fast's ``shard_qkv``
does the same on tensors; here it is done on index ranges only, so ``plan`` never needs torch.

Per part, along the split dim (length ``L``), rank ``r`` of ``tp`` gets:

- whole heads (``heads = n``, head size ``L / n``): ``n / tp`` heads each when ``tp <= n``;
  when ``tp > n`` and the part may be replicated (K/V), head ``r // (tp / n)`` (vLLM's
  ``num_kv_head_replicas``, TRT-LLM's ``dup_kv_weight``): neighbouring ranks share a head;
- vocab padding (``padded = P``, a multiple of ``tp``): rows ``[r·P/tp, (r+1)·P/tp)``, of which
  only those ``< L`` are real; the rank's local tensor still has ``P/tp`` rows (zeros below);
- otherwise ``L / tp`` each, or with the ``chunk`` rule ``torch.chunk``'s: ceil-sized chunks,
  the last smaller, trailing ranks possibly empty.

*Grouped* (interleaved) parts: the dim is ``G`` repeats of one group of parts, e.g. GPT-NeoX's
``query_key_value`` = per head ``[q; k; v]`` (``G`` = heads) or Falcon's = per KV group
``[q heads of the group; k; v]`` (``G`` = kv heads). With ``tp <= G`` rank ``r`` holds whole
groups ``[r·G/tp, (r+1)·G/tp)`` (one contiguous piece); with ``tp > G`` the ``tp / G`` ranks of
group ``r // (tp / G)`` split that group's parts as above (q heads split, the k/v head
replicated), so every rank's local tensor is again groups of ``[q; k; v]``, the layout its
model computes with at its local head counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardctl.layout.types import Piece


class SplitError(Exception):
    """A split that cannot be made; the engine adds the fqn and raises ``LayoutError``."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Part:
    """One section along the split dim. ``heads > 0``: made of that many whole heads."""

    size: int
    heads: int = 0
    heads_name: str = ""  # "num_attention_heads" / "num_key_value_heads", for messages
    replicable: bool = False  # K/V: tp > heads replicates heads instead of failing
    q_heads: int = 0  # num_attention_heads, for the remedy of a K/V part


@dataclass(frozen=True)
class SplitSpec:
    """How one tensor is split over tp. ``dim is None``: replicated on every tp rank."""

    shape: tuple[int, ...]
    dim: int | None
    parts: tuple[Part, ...] = ()
    padded: int | None = None  # vocab: the padded length of ``dim`` (single part)
    chunk: bool = False  # allow torch.chunk's uneven rule
    groups: int = 1  # > 1: ``dim`` is ``groups`` repeats of ``parts`` (interleaved per group)
    # A quantized member (shardctl/quant/groups.py): ``parts`` are in units of the logical
    # weight's dim (length ``logical``); one stored index covers ``factor`` logical ones, and
    # every rank boundary must be a multiple of ``align`` (the group's coarsest int32 packing,
    # quantization group or scale block), named ``what`` in the refusal.
    factor: int = 1
    align: int = 1
    logical: int = 0
    what: str = ""


# Per tp rank: its pieces (in local order) and its local shape.
RankSplit = tuple[tuple[Piece, ...], tuple[int, ...]]


@lru_cache(maxsize=4096)
def split(spec: SplitSpec, tp: int) -> tuple[RankSplit, ...]:
    """Every tp rank's pieces of a tensor; cached, since layers repeat the same shapes."""
    shape = spec.shape
    if spec.dim is None:
        whole = ((Piece((0,) * len(shape), shape, (0,) * len(shape)),), shape)
        return (whole,) * tp
    d = spec.dim
    if spec.groups > 1:
        return _grouped(spec, tp)
    ranges = _ranges(spec, tp)
    out: list[RankSplit] = []
    for r in range(tp):
        pieces: list[Piece] = []
        local = 0
        for rr in ranges:
            start, size, local_size = rr[r]
            pieces.append(
                Piece(
                    offsets=_at(shape, d, start, 0),
                    sizes=_at(shape, d, size, None),
                    local_offsets=_at(shape, d, local, 0),
                )
            )
            local += local_size
        out.append((tuple(pieces), _at(shape, d, local, None)))
    return tuple(out)


def _ranges(spec: SplitSpec, tp: int) -> list[list[tuple[int, int, int]]]:
    """Per part, per rank: (start along the dim, size, local size incl. padding), in the
    stored tensor's units."""
    assert spec.dim is not None
    length = spec.logical or spec.shape[spec.dim]
    parts = spec.parts or (Part(length),)
    out = []
    offset = 0
    for p in parts:
        rr = _part_ranges(p, tp, spec.padded, spec.chunk)
        out.append([(offset + a, b, c) for a, b, c in rr])
        offset += p.size
    if spec.logical:
        return [[_stored(spec, tp, r, a, b) for r, (a, b, _) in enumerate(rr)] for rr in out]
    return out


def _stored(spec: SplitSpec, tp: int, rank: int, start: int, size: int) -> tuple[int, int, int]:
    """A logical range of a quantized member → its stored range; refused when a boundary
    falls inside an int32, a quantization group or a scale block."""
    end, length, align = start + size, spec.logical, spec.align
    for edge in (start, end):
        if edge % align and edge != length:
            where = f"{size} per rank" if size % align else f"rank {rank} would start at {start}"
            raise SplitError(
                f"{spec.what} {length} with tp {tp}: {where}, which is not a multiple of {align}",
                f"use tp in {_aligned_divisors(length, align)}",
            )
    s0, s1 = start // spec.factor, -(-end // spec.factor)
    return (s0, s1 - s0, s1 - s0)


def _aligned_divisors(length: int, align: int) -> str:
    ok = [
        t for t in range(1, min(length, 4096) + 1) if length % t == 0 and (length // t) % align == 0
    ]
    return "{" + ", ".join(map(str, ok[:12])) + "}"


def local_numels(spec: SplitSpec, tp: int) -> tuple[int, ...]:
    """Elements of each tp rank's local tensor (padding included), without building pieces."""
    return _local_numels(spec, tp)


@lru_cache(maxsize=4096)
def _local_numels(spec: SplitSpec, tp: int) -> tuple[int, ...]:
    if spec.dim is None:
        return (math.prod(spec.shape),) * tp
    if spec.groups > 1:
        return tuple(math.prod(local) for _, local in split(spec, tp))
    d = spec.dim
    other = math.prod(_at(spec.shape, d, 1, None))  # elements per index along dim d
    ranges = _ranges(spec, tp)
    return tuple(other * sum(rr[r][2] for rr in ranges) for r in range(tp))


def _grouped(spec: SplitSpec, tp: int) -> tuple[RankSplit, ...]:
    """Interleaved groups of parts (see the module docstring): whole groups per rank, or one
    group's parts split over the ``tp / G`` ranks that share it."""
    assert spec.dim is not None
    d, n = spec.dim, spec.groups
    group = sum(p.size for p in spec.parts)
    if tp <= n:
        if n % tp:
            raise SplitError(
                f"tp={tp} does not divide the {n} interleaved head groups",
                f"use tp in {_grouped_tp(spec)}",
            )
        per = (n // tp) * group
        return tuple(
            (
                (
                    Piece(
                        _at(spec.shape, d, r * per, 0),
                        _at(spec.shape, d, per, None),
                        (0,) * len(spec.shape),
                    ),
                ),
                _at(spec.shape, d, per, None),
            )
            for r in range(tp)
        )
    if tp % n:
        raise SplitError(
            f"tp={tp} is above the {n} interleaved head groups but not a multiple of {n}",
            f"use tp in {_grouped_tp(spec)}",
        )
    share = tp // n  # ranks per group
    one = SplitSpec(_at(spec.shape, d, group, None), d, spec.parts, None, spec.chunk)
    try:
        inner = split(one, share)
    except SplitError as err:
        raise SplitError(
            f"tp={tp} puts {share} ranks on each of the {n} interleaved head groups: {err.message}",
            f"use tp in {_grouped_tp(spec)}",
        ) from None
    out: list[RankSplit] = []
    for r in range(tp):
        pieces, local = inner[r % share]
        shift = (r // share) * group
        moved = tuple(
            Piece(_at(p.offsets, d, p.offsets[d] + shift, None), p.sizes, p.local_offsets)
            for p in pieces
        )
        out.append((moved, local))
    return tuple(out)


def _grouped_tp(spec: SplitSpec) -> str:
    """The tp degrees a grouped tensor allows (the first 12)."""
    n = spec.groups

    def fits(share: int) -> bool:  # one group's parts over ``share`` ranks
        for p in spec.parts:
            if p.heads:
                if p.heads % share and not (p.replicable and share % p.heads == 0):
                    return False
            elif p.size % share and not spec.chunk:
                return False
        return True

    limit = n * max(p.heads or p.size for p in spec.parts)
    ok = [t for t in range(1, limit + 1) if (n % t == 0) or (t % n == 0 and fits(t // n))]
    return "{" + ", ".join(map(str, ok[:12])) + ("" if len(ok) <= 12 else ", …") + "}"


def _at(shape: tuple[int, ...], d: int, value: int, fill: int | None) -> tuple[int, ...]:
    """``shape`` with dim ``d`` set to ``value`` and the others ``fill`` (or kept, if None)."""
    return tuple(value if i == d else (s if fill is None else fill) for i, s in enumerate(shape))


def _part_ranges(
    part: Part, tp: int, padded: int | None, chunk: bool
) -> list[tuple[int, int, int]]:
    length = part.size
    if part.heads:
        return _head_ranges(part, tp)
    if padded is not None:
        per = padded // tp
        out = []
        for r in range(tp):
            # a rank past the real rows holds only padding: an empty piece at the end
            start = min(r * per, length)
            out.append((start, min(length, (r + 1) * per) - start, per))
        return out
    if length % tp == 0:
        per = length // tp
        return [(r * per, per, per) for r in range(tp)]
    if chunk:
        c = -(-length // tp)
        out = []
        for r in range(tp):
            start = min(r * c, length)
            size = max(0, min(c, length - r * c))
            out.append((start, size, size))
        return out
    raise SplitError(
        f"size {length} is not divisible by tp={tp}",
        f"use tp in {_divisors(length)}, or layout.uneven: chunk (torch.chunk rule)",
    )


def _head_ranges(part: Part, tp: int) -> list[tuple[int, int, int]]:
    n = part.heads
    head = part.size // n
    if tp <= n or not part.replicable:
        if n % tp:
            raise SplitError(
                f"tp={tp} does not divide {part.heads_name}={n}",
                f"use tp in {_valid_tp(part)}",
            )
        per = (n // tp) * head
        return [(r * per, per, per) for r in range(tp)]
    if tp % n:
        raise SplitError(
            f"tp={tp} is above {part.heads_name}={n} but not a multiple of it, so K/V heads "
            f"cannot be replicated evenly (each head on tp/{n} ranks)",
            f"use tp in {_valid_tp(part)}",
        )
    replicas = tp // n
    return [((r // replicas) * head, head, head) for r in range(tp)]


def _valid_tp(part: Part) -> str:
    if part.replicable and part.q_heads:
        # divisors of n_kv, and multiples of n_kv that still divide the query heads
        n, q = part.heads, part.q_heads
        ok = [t for t in range(1, q + 1) if q % t == 0 and (n % t == 0 or t % n == 0)]
        return "{" + ", ".join(map(str, ok)) + "}"
    return _divisors(part.heads)


def _divisors(n: int, limit: int = 12) -> str:
    ds = [d for d in range(1, min(n, 4096) + 1) if n % d == 0][:limit]
    return "{" + ", ".join(map(str, ds)) + ("" if len(ds) < limit else ", …") + "}"
