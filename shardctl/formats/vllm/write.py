"""``--format vllm``: the output files of a vLLM ``sharded_state`` checkpoint, decided up front.

Files ``model-rank-{r}-part-{p}.safetensors`` (vLLM's ``DEFAULT_PATTERN``, parts from 0, a new
part when the next tensor would pass ``max_shard_size``, default 5 GiB as vLLM's saver), no
``__metadata__`` (vLLM's ``save_file`` writes none), no shardctl record (vLLM's loader reads
only its own files; ``shardctl`` reads the directory back from ``config.json`` and the file
headers, ``read.py``).

The copy engine fills one output tensor from the source shards of *one* fqn. A fused vLLM
tensor draws on several HF tensors, so each vLLM name gets a *virtual global tensor* (the
unsplit fused tensor, ``[Q; K; V]`` or ``[E, 2I, H]``) and every source shard of its HF members
is presented as a piece of it, shifted by the member's origin (``names.Part.origin``; a leading
dim of 1 for the expert index). Bytes do not move: only coordinates are relabelled.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from shardctl.checkpoint.plan_files import OutputFile, _file, _parts
from shardctl.checkpoint.source import Source, SourceShard
from shardctl.errors import UsageError
from shardctl.formats.vllm.names import VTensor, attention_scales, rank_tensors
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.layout.types import Mesh, Piece
from shardctl.model.types import TensorInfo

PATTERN = "model-rank-{rank}-part-{part}.safetensors"  # ShardedStateLoader.DEFAULT_PATTERN
VLLM_MAX_PART = 5 * 2**30  # vllm examples/offline_inference/save_sharded_state.py


@dataclass(frozen=True)
class VllmFiles:
    files: tuple[OutputFile, ...]
    sources: Mapping[str, tuple[SourceShard, ...]]  # vLLM name -> virtual source shards
    order: dict[str, int]
    extra_files: tuple[tuple[str, bytes], ...]  # (name, bytes): each rank's scale-buffer part


def check_mesh(mesh: Mesh | None) -> int:
    """The TP degree; pp/ep/dp > 1 refused with one line each."""
    mesh = mesh or Mesh()
    if mesh.pp > 1:
        raise UsageError(
            f"--format vllm: pp {mesh.pp} — vLLM's sharded_state holds tensor-parallel ranks "
            "only (its loader reads model-rank-{tp_rank}-part-*.safetensors, no pipeline stages)",
            hint="drop --pp (vLLM splits pipeline stages itself when it loads), or use --format "
            "ranks",
        )
    if mesh.ep > 1:
        raise UsageError(
            f"--format vllm: ep {mesh.ep} — shardctl writes vLLM's tensor-parallel MoE layout "
            "(every rank holds every expert, each cut by tp)",
            hint="drop --ep; vLLM's --enable-expert-parallel needs vLLM's own saver",
        )
    if mesh.dp > 1:
        raise UsageError("--format vllm: dp replicas hold nothing new", hint="drop --dp")
    return mesh.tp


def vllm_files(source: Source, mesh: Mesh | None, max_shard_size: int) -> VllmFiles:
    """Every output file and header, and the relabelled sources the copy engine reads."""
    tp = check_mesh(mesh)
    ranks = rank_tensors(source.model, tp)
    names = [v.name for v in ranks[0]]
    order = {n: i for i, n in enumerate(names)}
    files: list[OutputFile] = []
    for r, tensors in enumerate(ranks):
        runs = _parts([v.nbytes for v in tensors], max_shard_size) if tensors else [(0, 0)]
        for k, (a, b) in enumerate(runs):
            items = [(TensorInfo(v.name, v.local_shape, v.dtype), _pieces(v)) for v in tensors[a:b]]
            # vLLM's save_file passes no metadata: no ``__metadata__`` key at all
            files.append(_file(PATTERN.format(rank=r, part=k), items, cast(Any, None), r))
    extra: list[tuple[str, bytes]] = []
    scales = _scales_file(attention_scales(source.model))
    for r in range(tp):
        parts = sum(1 for f in files if f.rank == r)
        extra.append((PATTERN.format(rank=r, part=parts), scales))
    return VllmFiles(tuple(files), _virtual_sources(source, ranks[0]), order, tuple(extra))


def _scales_file(names: list[str]) -> bytes:
    """A safetensors file of the attention scale buffers: float32 scalars, all 1.0."""
    one = struct.pack("<f", 1.0)
    entries = [HeaderEntry(n, "F32", (), 4 * i, 4 * i + 4) for i, n in enumerate(names)]
    return header_bytes(entries, None) + one * len(names)


def _pieces(v: VTensor) -> tuple[Piece, ...]:
    return tuple(Piece(p.virtual_offsets(), p.local_sizes(), p.dst_lo) for p in v.parts)


def _virtual_sources(source: Source, rank0: list[VTensor]) -> dict[str, tuple[SourceShard, ...]]:
    """vLLM name -> every source shard of its HF members, as pieces of the virtual tensor."""
    out: dict[str, tuple[SourceShard, ...]] = {}
    for v in rank0:
        seen: dict[str, tuple[int, ...]] = {}
        for p in v.parts:
            seen.setdefault(p.hf, p.origin)
        if not v.parts:  # a rank with only vocab padding: no member on rank 0 cannot happen
            continue
        shards: list[SourceShard] = []
        lead = len(v.local_shape) - len(source.shards[v.parts[0].hf][0].local_shape)
        for fqn, origin in seen.items():
            for s in source.shards[fqn]:
                pad = (0,) * lead
                pieces = tuple(
                    Piece(
                        tuple(o + x for o, x in zip(origin, pad + q.offsets, strict=True)),
                        (1,) * lead + q.sizes,
                        pad + q.local_offsets,
                    )
                    for q in s.pieces
                )
                shards.append(
                    SourceShard(
                        v.name, s.dtype, (1,) * lead + s.local_shape, pieces, s.begin, s.file
                    )
                )
        out[v.name] = tuple(shards)
    return out
