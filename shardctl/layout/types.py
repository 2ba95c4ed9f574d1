"""Layouts as plain frozen data: mesh, placement, shard, stage, per-rank layout.

Vocabulary (DESIGN.md): *axis* is a mesh dimension (``pp``, ``dp``, ``ep``, ``tp``); *dim* is a
tensor dimension. A *shard* is one rank's piece of one tensor, made of one or more rectangular
*pieces* of the global tensor placed at ``local_offsets`` inside the rank's local tensor.

- a plain ``S(0)`` shard of ``[8, 4]`` over tp=2, rank 1::

      Shard(fqn, global_shape=(8, 4), local_shape=(4, 4),
            pieces=(Piece(offsets=(4, 0), sizes=(4, 4), local_offsets=(0, 0)),))

- a fused ``[Q;K;V]`` (parts 8, 4, 4 rows) over tp=2, rank 1 holds three pieces, concatenated::

      pieces=(Piece((4, 0), (4, H), (0, 0)),    # its half of Q
              Piece((10, 0), (2, H), (4, 0)),   # its half of K
              Piece((14, 0), (2, H), (6, 0)))   # its half of V

- vocab padding: the local tensor is larger than the pieces; what no piece covers is zero
  padding (recorded in ``Layout.padded_shapes``, stripped on merge).

The mesh is ordered outer→inner ``pp, dp, ep, tp`` (TP ranks adjacent, as torchtitan and
Megatron lay them out). ``ep`` is its own axis: experts are split over it, everything else is
replicated over it (Megatron's expert-data-parallel: our ``dp × ep`` is Megatron's ``dp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardctl.dtypes import nbytes

AXES: tuple[str, ...] = ("pp", "dp", "ep", "tp")


@dataclass(frozen=True)
class Mesh:
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def model_parallel(self) -> int:
        """Ranks holding distinct pieces of the model (one dp replica): ``pp × ep × tp``."""
        return self.pp * self.ep * self.tp

    def coord(self, rank: int) -> dict[str, int]:
        """Global rank -> coordinate on each axis (``tp`` fastest)."""
        assert 0 <= rank < self.world
        tp = rank % self.tp
        rest = rank // self.tp
        ep = rest % self.ep
        rest //= self.ep
        dp = rest % self.dp
        pp = rest // self.dp
        return {"pp": pp, "dp": dp, "ep": ep, "tp": tp}

    def rank(self, *, pp: int = 0, dp: int = 0, ep: int = 0, tp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.ep + ep) * self.tp + tp

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "ep": self.ep}

    def __str__(self) -> str:
        return "×".join(f"{a.upper()}{getattr(self, a)}" for a in AXES)


@dataclass(frozen=True)
class Placement:
    """How a tensor sits on one axis: ``Shard(dim)`` (``S(0)``) or ``Replicate()`` (``R``)."""

    dim: int | None  # None = Replicate

    @property
    def is_replicate(self) -> bool:
        return self.dim is None

    def __str__(self) -> str:
        return "R" if self.dim is None else f"S({self.dim})"


REPLICATE = Placement(None)


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangular block of the global tensor and where it sits in the rank's local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A rank's local tensor of one fqn, made of ``pieces`` of the global tensor and stored at
    byte ``begin`` of a file — the one type behind reshard's source shards and target tensors
    and verify's DST shards (each adds only where its file is)::

        LocalTensor("model.layers.0.self_attn.q_proj.weight", "BF16", (2048, 4096),
                    (Piece((2048, 0), (2048, 4096), (0, 0)),), begin=8 + header_len)
    """

    fqn: str
    dtype: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    begin: int  # absolute byte offset in its file

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, math.prod(self.local_shape))

    @property
    def is_rectangular(self) -> bool:
        """One piece filling the local tensor (as :attr:`Shard.is_rectangular`)."""
        return _one_box(self.local_shape, self.pieces)


def _one_box(local_shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> bool:
    """``pieces`` is one piece filling a local tensor of ``local_shape`` from its origin."""
    if len(pieces) != 1:
        return False
    p = pieces[0]
    return p.sizes == local_shape and all(o == 0 for o in p.local_offsets)


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's piece of one tensor (DCP ``ChunkStorageMetadata`` generalized to fused parts)."""

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    placement: str  # resolved, printable: "S(0)", "R", "S(0)·parts[4096,1024,1024]", "E·S(1)"

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, math.prod(self.local_shape))

    @property
    def is_rectangular(self) -> bool:
        """True when DCP ``saved_offsets`` can express it: one piece filling the local tensor."""
        return _one_box(self.local_shape, self.pieces)

    @property
    def offsets(self) -> tuple[int, ...]:
        assert self.is_rectangular, f"{self.fqn}: not a rectangular shard"
        return self.pieces[0].offsets

    @property
    def sizes(self) -> tuple[int, ...]:
        assert self.is_rectangular, f"{self.fqn}: not a rectangular shard"
        return self.pieces[0].sizes

    def __str__(self) -> str:
        return f"{self.fqn} {self.placement} {list(self.local_shape)} of {list(self.global_shape)}"


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: decoder layers ``first..last`` inclusive (``None`` if it has none)."""

    index: int
    layers: tuple[int, int] | None

    @property
    def num_layers(self) -> int:
        return 0 if self.layers is None else self.layers[1] - self.layers[0] + 1


@dataclass(frozen=True)
class RankLayout:
    """What one model-parallel rank (``dp`` coordinate 0) holds."""

    pp: int
    ep: int
    tp: int
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclass(frozen=True)
class RuleSpec:
    """A user rule from a manifest or a preset: FQN glob → placement per axis.

    ``match`` is an ``fnmatch`` glob on the fqn (``model.layers.*.mlp.down_proj.weight``).
    ``tp`` is ``"S(0)"``, ``"S(1)"``, ``"R"``, ``"colwise"``, ``"rowwise"`` or ``"vocab"``.
    ``parts`` names fused sections along the sharded dim (sizes in elements, or ``"q"``,
    ``"kv"``, ``"intermediate"`` resolved from the config). ``heads`` says the dim is made of
    heads (``"q"`` or ``"kv"``), so ``tp > kv heads`` replicates whole heads instead of failing.
    ``stage`` pins a non-layer tensor to ``"first"``, ``"last"`` or ``"all"`` stages; a rule
    whose own ``tp`` and ``stage`` match a layer-numbered name takes it out of the decoder stack
    (a multimodal encoder's ``vision_model.model.layers.{i}``).
    ``groups`` (``"q"`` or ``"kv"``) says the ``parts`` are interleaved: the dim is one group of
    parts per q head (GPT-NeoX ``query_key_value``: per head ``[q; k; v]``) or per kv head
    (Falcon: per kv group ``[its q heads; k; v]``); named parts are then sizes per group.
    """

    match: str
    tp: str | None = None
    parts: tuple[int | str, ...] | None = None
    heads: str | None = None
    stage: str | None = None
    expert: bool = False
    groups: str | None = None


@dataclass(frozen=True)
class LayoutOptions:
    """Named choices where engines differ (DESIGN.md "Architectures are data")."""

    pipeline: str = "even"  # even | vllm | tensorrt-llm | megatron
    layers_per_stage: tuple[int, ...] | None = None
    vocab_padding: str = "tp"  # none | tp (pad to a multiple of tp when needed) | megatron (128·tp)
    uneven: str = "error"  # error | chunk (torch.chunk rule)


@dataclass(frozen=True)
class Layout:
    """Every model-parallel rank's shards, plus the stages and options that made them."""

    architecture: str
    mesh: Mesh
    options: LayoutOptions
    stages: tuple[Stage, ...]
    ranks: tuple[RankLayout, ...]  # ordered by (pp, ep, tp)
    # fqn -> padded global shape, for tensors whose local shards include zero padding
    padded_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def rank_layout(self, *, pp: int, ep: int, tp: int) -> RankLayout:
        m = self.mesh
        return self.ranks[(pp * m.ep + ep) * m.tp + tp]

    def for_rank(self, rank: int) -> RankLayout:
        """The shards of a global rank (dp replicas hold what dp=0 holds)."""
        c = self.mesh.coord(rank)
        return self.rank_layout(pp=c["pp"], ep=c["ep"], tp=c["tp"])

    def stage_of(self, rank: int) -> int:
        return self.mesh.coord(rank)["pp"]
