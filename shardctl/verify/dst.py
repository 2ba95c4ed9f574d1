"""The checkpoint under test (DST), opened tolerantly: disagreements become findings, not errors.

``reshard``'s own reader refuses a layout whose files disagree with its record (exit 3: it must
not copy from it). ``verify`` is asked exactly whether they agree, so it reads the record (a
malformed record is still exit 3), then every file header, and lists what differs:
a recorded shard missing from its file, another dtype or shape, tensors no record mentions,
files no record mentions, a file whose header metadata says it belongs to another rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardctl.checkpoint import record as rec
from shardctl.checkpoint.source import open_source
from shardctl.checkpoint.strict_json import read_json_strict
from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import SafetensorsHeader, read_header
from shardctl.layout.types import Layout, LocalTensor
from shardctl.model.types import TensorInfo
from shardctl.verify.result import Finding


@dataclass(frozen=True, slots=True)
class DstShard(LocalTensor):
    """One local tensor of DST, in file ``path``, held by ``rank`` (None for an HF checkpoint)."""

    path: Path
    rank: int | None


@dataclass
class Destination:
    root: Path
    kind: str  # "ranks" | "hf"
    tensors: dict[str, TensorInfo]  # the global tensors DST claims to hold
    shards: dict[str, list[DstShard]]
    files: list[Path]
    config: dict[str, Any]
    record: rec.LayoutRecord | None = None
    problems: list[Finding] = field(default_factory=list)

    @property
    def layout(self) -> Layout | None:
        return self.record.layout if self.record is not None else None

    def rank_files(self) -> dict[int, tuple[Path, ...]]:
        out: dict[int, set[Path]] = {}
        for shards in self.shards.values():
            for s in shards:
                out.setdefault(s.rank or 0, set()).add(s.path)
        return {r: tuple(sorted(p)) for r, p in sorted(out.items())}


def _config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        return {}
    # the one strict reader: size cap, depth (RecursionError -> exit 3), no duplicate keys
    data = read_json_strict(path, max_bytes=16 * 2**20, what="config.json")
    return data if isinstance(data, dict) else {}


def open_destination(root: Path) -> Destination:
    root = Path(root)
    # ---- engine format: vLLM sharded_state (branch vllm) ----
    from shardctl.formats.vllm.read import is_vllm_dir

    if is_vllm_dir(root):
        from shardctl.formats.vllm.destination import vllm_destination

        return vllm_destination(root)
    # ---- end vllm ----
    record_path = root / rec.RECORD_NAME
    # gaps/overlaps in DST's record are structure findings (exit 1), not refusals
    record = rec.read(root, exact_tiling=False) if record_path.is_file() else None
    if record is None or record.layout is None:
        return _hf(root, record)
    return _ranks(root, record)


def _hf(root: Path, record: rec.LayoutRecord | None) -> Destination:
    src = open_source(root)
    shards: dict[str, list[DstShard]] = {}
    for fqn, ss in src.shards.items():
        shards[fqn] = [
            DstShard(
                fqn,
                s.dtype,
                s.local_shape,
                s.pieces,
                s.begin,
                path=src.files[s.file].path,
                rank=None,
            )
            for s in ss
        ]
    tensors = {t.fqn: t for t in src.model.tensors}
    return Destination(
        root, "hf", tensors, shards, [f.path for f in src.files], _config(root), record
    )


def _ranks(root: Path, record: rec.LayoutRecord) -> Destination:
    layout = record.layout
    assert layout is not None
    dest = Destination(
        root, "ranks", {t.fqn: t for t in record.tensors}, {}, [], _config(root), record
    )
    headers: dict[str, SafetensorsHeader] = {}
    owner: dict[str, set[int]] = {}
    for (rank, _fqn), name in record.shard_files.items():
        owner.setdefault(name, set()).add(rank)
    for f in record.files:
        path = root / f.name
        if not f.name.endswith(".safetensors"):
            continue
        if path.is_symlink() or not path.is_file():
            dest.problems.append(Finding("recorded file missing", file=f.name))
            continue
        dest.files.append(path)
        size = os.stat(path).st_size
        if size != f.size:
            dest.problems.append(Finding(f"size {size} B, the record says {f.size} B", file=f.name))
        try:
            headers[f.name] = read_header(path)
        except InvalidInputError as exc:
            dest.problems.append(Finding(f"unreadable header: {exc.message}", file=f.name))
            continue
        _check_owner(dest, headers[f.name], f.name, owner.get(f.name, set()))
    recorded = {f.name for f in record.files}
    for name in sorted(os.listdir(root)):
        if name.endswith(".safetensors") and name not in recorded:
            dest.problems.append(Finding("file not in the layout record", file=name))
    # name -> entry per file: a linear search per shard was quadratic (200 s at 90k tensors)
    entries = {name: {e.name: e for e in h.tensors} for name, h in headers.items()}
    seen: dict[str, set[str]] = {}
    paths = {name: root / name for name in headers}  # one Path per file, not per shard
    shard_files = record.shard_files
    for i, rl in enumerate(layout.ranks):
        for s in rl.shards:
            name = shard_files[(i, s.fqn)]
            names = seen.get(name)
            if names is None:
                names = seen[name] = set()
            names.add(s.fqn)
            header = headers.get(name)
            if header is None:
                continue
            entry = entries[name].get(s.fqn)
            if entry is None:
                dest.problems.append(Finding("missing from its file", fqn=s.fqn, rank=i, file=name))
                continue
            if entry.dtype != s.dtype or entry.shape != s.local_shape:
                dest.problems.append(
                    Finding(
                        f"file holds {list(entry.shape)} {entry.dtype}, the record says "
                        f"{list(s.local_shape)} {s.dtype}",
                        fqn=s.fqn,
                        rank=i,
                        file=name,
                    )
                )
                continue
            held = dest.shards.get(s.fqn)
            if held is None:
                held = dest.shards[s.fqn] = []
            held.append(
                DstShard(
                    s.fqn,
                    s.dtype,
                    s.local_shape,
                    s.pieces,
                    header.data_offset + entry.begin,
                    path=paths[name],
                    rank=i,
                )
            )
    for name, header in headers.items():
        for e in header.tensors:
            if e.name not in seen.get(name, set()):
                dest.problems.append(
                    Finding("tensor in the file but not in the record", fqn=e.name, file=name)
                )
    return dest


def _check_owner(dest: Destination, header: SafetensorsHeader, name: str, ranks: set[int]) -> None:
    """A rank file repeats its part of the record: a renamed/swapped file names another rank."""
    meta = (header.metadata or {}).get("shardctl")
    if meta is None:
        return
    try:
        claimed = json.loads(meta).get("rank")
    except (ValueError, AttributeError, RecursionError):
        dest.problems.append(Finding("unreadable shardctl metadata in its header", file=name))
        return
    if isinstance(claimed, int) and ranks and claimed not in ranks:
        dest.problems.append(
            Finding(
                f"file holds rank {claimed}'s shards (its header says so) but the record assigns "
                f"it to rank {min(ranks)}: rank files renamed or swapped",
                file=name,
            )
        )
