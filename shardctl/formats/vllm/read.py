"""A vLLM ``sharded_state`` directory read as HF-named global tensors (``Source``) or as a
sharded destination (``verify``) — headers and ``config.json`` only, no tensor data.

The directory holds ``model-rank-{r}-part-{p}.safetensors`` and ``config.json``; the TP degree
is the number of ranks. ``names.rank_tensors`` (the table the writer uses) says which HF box sits
where in each vLLM tensor; every such box is one contiguous byte run of its file (a row range of
a dim-0 fused tensor, one expert of ``w13``/``w2``), so each becomes an ordinary source shard of
the HF tensor and the copy engine, ``verify``'s structure and bitwise levels run unchanged.
Vocab padding rows are no HF tensor's and are never read. Anything that is not exactly what
vLLM writes for this config is refused (exit 3) with one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from shardctl.blocks import flat_index, is_contiguous
from shardctl.checkpoint.hf import INDEX_NAME, LAYOUT_RECORD, SINGLE_NAME
from shardctl.checkpoint.source import InputFile, Source, SourceShard
from shardctl.dtypes import itemsize
from shardctl.errors import InvalidInputError
from shardctl.formats.vllm.names import SCALE_NAME, attention_scales, hf_order, rank_tensors
from shardctl.io.safetensors_header import HeaderEntry, read_header
from shardctl.layout.types import Layout, LayoutOptions, Mesh, Piece, RankLayout, Shard, Stage
from shardctl.model.archs import tensors_from_config
from shardctl.model.inventory import from_tensors, read_config
from shardctl.model.types import ModelInfo, TensorInfo

RANK_FILE = re.compile(r"^model-rank-(\d{1,6})-part-(\d{1,6})\.safetensors$")
MAX_LISTED = 5


def is_vllm_dir(root: Path) -> bool:
    """A directory of vLLM rank files and no HF weights, index or shardctl record."""
    if not root.is_dir() or any(
        (root / n).exists() for n in (SINGLE_NAME, INDEX_NAME, LAYOUT_RECORD)
    ):
        return False
    return any(RANK_FILE.match(n) for n in os.listdir(root))


@dataclass
class VllmCheckpoint:
    root: Path
    tp: int
    model: ModelInfo  # HF tensors, in the order safetensors' save_file lays them out
    files: list[Path]
    # per rank: (HF fqn, its source shard in this rank's files)
    shards: list[list[tuple[str, SourceShard]]] = field(default_factory=list)
    carried: tuple[Path, ...] = ()


def _bad(message: str, where: Path | str, hint: str | None = None) -> InvalidInputError:
    return InvalidInputError(f"vLLM sharded_state: {message}", where=str(where), hint=hint)


def read_vllm(root: Path) -> VllmCheckpoint:
    """Validate ``root`` against what vLLM writes for its config; locate every HF box."""
    root = Path(root)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise _bad("no config.json beside the rank files", root, "copy the model's config.json in")
    config = read_config(config_path)
    by_rank: dict[int, dict[int, str]] = {}
    others: list[str] = []
    for name in sorted(os.listdir(root)):
        m = RANK_FILE.match(name)
        if m:
            path = root / name
            if path.is_symlink() or not path.is_file():
                raise _bad("rank file is not a regular file", path)
            by_rank.setdefault(int(m.group(1)), {})[int(m.group(2))] = name
        elif name.endswith(".safetensors"):
            others.append(name)
    if others:
        raise _bad(f"other safetensors files beside the rank files: {others[:MAX_LISTED]}", root)
    tp = len(by_rank)
    if sorted(by_rank) != list(range(tp)):
        raise _bad(f"ranks {sorted(by_rank)}, expected 0..{tp - 1}", root)
    files: list[Path] = []
    headers: list[dict[str, tuple[int, HeaderEntry, int]]] = []  # name -> (file, entry, offset)
    for r in range(tp):
        parts = by_rank[r]
        if sorted(parts) != list(range(len(parts))):
            raise _bad(f"rank {r} has parts {sorted(parts)}, expected 0..{len(parts) - 1}", root)
        entries: dict[str, tuple[int, HeaderEntry, int]] = {}
        for p in range(len(parts)):
            path = root / parts[p]
            header = read_header(path)
            files.append(path)
            for e in header.tensors:
                if e.name in entries:
                    raise _bad(f"tensor {e.name!r} in two parts of rank {r}", path)
                entries[e.name] = (len(files) - 1, e, header.data_offset + e.begin)
        headers.append(entries)
    first = next((v for n, v in headers[0].items() if not SCALE_NAME.search(n)), None)
    if first is None:
        raise _bad("rank 0 holds no tensors", root)
    guess = from_tensors(root, tensors_from_config(config, first[1].dtype, where=str(config_path)))
    ranks = rank_tensors(guess, tp)
    scales = set(attention_scales(guess))
    dtypes: dict[str, str] = {}
    for r, (vts, entries) in enumerate(zip(ranks, headers, strict=True)):
        want = {v.name for v in vts}
        missing = sorted(want - set(entries))
        # vLLM's attention scale buffers belong to no HF tensor: tolerated (not required)
        extra = sorted(set(entries) - want - scales)
        if missing or extra:
            raise _bad(
                f"rank {r} does not hold what vLLM writes for this config: missing "
                f"{missing[:MAX_LISTED]}, unexpected {extra[:MAX_LISTED]}",
                root,
                "the config.json or the tensor-parallel degree does not match the files",
            )
        for v in vts:
            e = entries[v.name][1]
            if e.shape != v.local_shape:
                raise _bad(
                    f"{v.name} of rank {r} is {list(e.shape)}, vLLM's layout for tp {tp} "
                    f"is {list(v.local_shape)}",
                    files[entries[v.name][0]],
                )
            for part in v.parts:
                if dtypes.setdefault(part.hf, e.dtype) != e.dtype:
                    raise _bad(f"{part.hf} stored as {dtypes[part.hf]} and {e.dtype}", root)
    tensors = tuple(hf_order([TensorInfo(t.fqn, t.shape, dtypes[t.fqn]) for t in guess.tensors]))
    model = from_tensors(root, tensors)
    shards: list[list[tuple[str, SourceShard]]] = []
    for vts, entries in zip(ranks, headers, strict=True):
        mine: list[tuple[str, SourceShard]] = []
        for v in vts:
            file, e, begin = entries[v.name]
            for part in v.parts:
                sizes = part.local_sizes()
                assert is_contiguous(sizes, v.local_shape), (v.name, part)
                at = begin + flat_index(part.dst_lo, v.local_shape) * itemsize(e.dtype)
                z = (0,) * len(part.sizes)
                piece = Piece(part.src_lo, part.sizes, z)
                mine.append(
                    (part.hf, SourceShard(part.hf, e.dtype, part.sizes, (piece,), at, file))
                )
        shards.append(mine)
    carried = tuple(
        Path(n)
        for n in sorted(os.listdir(root))
        if not n.startswith(".")
        and not n.endswith(".safetensors")
        and (root / n).is_file()
        and not (root / n).is_symlink()
    )
    return VllmCheckpoint(root, tp, model, files, shards, carried)


def open_vllm_source(root: Path) -> Source:
    """The directory as a reshard input: HF-named global tensors (replicas: any rank's copy)."""
    ck = read_vllm(root)
    shards: dict[str, list[SourceShard]] = {t.fqn: [] for t in ck.model.tensors}
    for mine in ck.shards:
        for fqn, s in mine:
            shards[fqn].append(s)
    inputs = []
    for path in ck.files:
        st = os.stat(path)
        inputs.append(InputFile(path, st.st_size, st.st_mtime_ns))
    return Source(
        ck.root,
        "vllm",
        ck.model,
        {k: tuple(v) for k, v in shards.items()},
        tuple(inputs),
        ck.carried,
    )


def vllm_layout(ck: VllmCheckpoint) -> Layout:
    """The directory's layout in shardctl's terms (TP ranks of HF-named shards), for verify."""
    glob = {t.fqn: t for t in ck.model.tensors}
    ranks = tuple(
        RankLayout(
            0,
            0,
            r,
            tuple(
                Shard(fqn, s.dtype, glob[fqn].shape, s.local_shape, s.pieces, "vllm")
                for fqn, s in mine
            ),
        )
        for r, mine in enumerate(ck.shards)
    )
    layers = ck.model.dims.num_layers if ck.model.dims else 1
    return Layout(
        architecture=ck.model.architecture,
        mesh=Mesh(tp=ck.tp),
        options=LayoutOptions(),
        stages=(Stage(0, (0, layers - 1)),),
        ranks=ranks,
    )
