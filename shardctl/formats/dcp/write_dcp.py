"""Write training state as a DCP checkpoint chunked for an FSDP2 mesh of ``world`` ranks.

Rank ``r``'s file ``__r_0.distcp`` holds, for every tensor of rank >= 1, rows
``[r*c, min((r+1)*c, n))`` of dim 0 with ``c = ceil(n / world)`` — the local shard FSDP2's
``fully_shard`` gives rank ``r`` (``Shard(0)``, ``torch.chunk`` sizes; a rank past the end holds
nothing). Adam moments are chunked like their parameter. 0-d tensors (``step``) and objects
(``param_groups``) are written once, by rank 0, as DCP deduplicates replicated items. Each chunk
is ``torch.save``'d as DCP's ``FileSystemWriter`` does; ``.metadata`` (torch's own ``Metadata``
classes, pickled as DCP pickles them) is written last. Any DCP loader (``dcp.load``) reads the
result into any mesh.
"""

from __future__ import annotations

import io
import math
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardctl.checkpoint.record import FileDigest
from shardctl.formats.dcp.metadata import METADATA_NAME
from shardctl.formats.dcp.sink import HashedFile
from shardctl.formats.dcp.state import Item, TrainingState


def dim0_chunks(n: int, world: int) -> list[tuple[int, int]]:
    """``(start, rows)`` per rank, as ``torch.chunk`` + FSDP2 padding split ``n`` rows.

    >>> dim0_chunks(10, 4)
    [(0, 3), (3, 3), (6, 3), (9, 1)]
    """
    size = math.ceil(n / world) if n else 0
    out = []
    for r in range(world):
        start = min(r * size, n)
        out.append((start, min(start + size, n) - start))
    return out


def planner_path(key: str) -> tuple[Any, ...]:
    """The nested-dict path DCP's DefaultSavePlanner records for a flat key."""
    head, _, rest = key.partition(".")
    if head == "optimizer":
        section, _, tail = rest.partition(".")
        if section == "state":
            fqn, _, state = tail.rpartition(".")
            return ("optimizer", "state", fqn, state)
        if section == "param_groups":
            idx, _, name = tail.partition(".")
            return ("optimizer", "param_groups", int(idx) if idx.isdigit() else idx, name)
    return (head, rest) if rest else (head,)


def write_dcp(
    state: TrainingState,
    out: Path,
    *,
    world: int,
    items: list[Item],
    hash_name: str,
    planner_data: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[FileDigest], int]:
    """Write ``items`` of ``state`` under ``out``; returns (file digests, tensor bytes)."""
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    files = [HashedFile(out / f"__{r}_0.distcp", hash_name) for r in range(world)]
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    total = sum(math.prod(i.shape) * i.dtype.itemsize for i in items if i.shape is not None)
    done = 0
    try:
        for item in items:
            planner[item.key] = (planner_data or {}).get(item.key) or planner_path(item.key)
            if item.shape is None:
                buf = io.BytesIO()
                torch.save(state.obj(item.key), buf)
                storage[m.MetadataIndex(item.key)] = _put(files[0], buf, _StorageInfo)
                sd_meta[item.key] = m.BytesStorageMetadata()
                continue
            t = state.tensor(item.key).contiguous()
            pieces = (
                [(0, (), ())]
                if t.dim() == 0
                else [
                    (r, (start,) + (0,) * (t.dim() - 1), (rows, *t.shape[1:]))
                    for r, (start, rows) in enumerate(dim0_chunks(t.shape[0], world))
                    if rows > 0 or (r == 0 and t.shape[0] == 0)
                ]
            )
            chunks = []
            for idx, (rank, offsets, sizes) in enumerate(pieces):
                piece = t if t.dim() == 0 else t.narrow(0, offsets[0], sizes[0])
                buf = io.BytesIO()
                torch.save(piece.clone(), buf)  # clone: save this chunk, not the whole storage
                index = m.MetadataIndex(item.key, torch.Size(offsets), idx)
                storage[index] = _put(files[rank], buf, _StorageInfo)
                chunks.append(
                    m.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                )
            sd_meta[item.key] = m.TensorStorageMetadata(
                properties=m.TensorProperties.create_from_tensor(t),
                size=t.shape,
                chunks=chunks,
            )
            done += t.numel() * t.element_size()
            del t
            if progress is not None:
                progress(done, total)
        digests = [f.close() for f in files]
    except BaseException:
        for f in files:
            f.abort()
        raise
    metadata = m.Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner,
        storage_data=storage,
        storage_meta=m.StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4())),
        version=_dcp_version(),
    )
    meta = HashedFile(out / METADATA_NAME, hash_name)
    meta.write(pickle.dumps(metadata))
    digests.append(meta.close())
    return digests, done


def _put(f: HashedFile, buf: io.BytesIO, storage_info: Any) -> Any:
    begin = f.size
    data = buf.getbuffer()
    f.write(data)
    return storage_info(f.path.name, begin, len(data))


def _dcp_version() -> str:
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        return str(CURRENT_DCP_VERSION)
    except ImportError:  # older torch
        return "1.0.0"
