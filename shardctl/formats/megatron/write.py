"""HF checkpoint -> Megatron-Core ``torch_dist`` (``shardctl reshard SRC DST --format megatron``).

Streaming: DCP's own writer asks for one chunk at a time (one layer's ``linear_qkv``, one
expert's ``linear_fc1``), built from the HF tensors it needs (read with ``safe_open``, mmap).
Atomic: everything goes into a staging sibling of DST, fsynced, renamed into place last.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from shardctl.checkpoint.hf import INDEX_NAME
from shardctl.checkpoint.source import Source, open_source
from shardctl.errors import InvalidInputError, OutputConflictError
from shardctl.formats.megatron import dcp_io, layout, names
from shardctl.formats.megatron.spec import MegatronSpec, load_flags, spec_from_config
from shardctl.io import atomic
from shardctl.io.lock import OutputLock
from shardctl.reshard.safety import check_output, preflight_space

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def hf_spec(source: Source, *, tp: int, pp: int, ep: int) -> MegatronSpec:
    """The spec of an HF source, with every HF tensor accounted for (refusals name them)."""
    cfg_path = source.root / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(
            f"format megatron needs config.json ({type(exc).__name__})",
            where=str(cfg_path),
            hint="an HF checkpoint directory has one",
        ) from None
    if not isinstance(cfg, dict):
        raise InvalidInputError("config.json is not a JSON object", where=str(cfg_path))
    present = {t.fqn for t in source.model.tensors}
    cfg = {**cfg, "tie_word_embeddings": "lm_head.weight" not in present}
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and any(n.startswith(f"model.layers.{layers}.") for n in present):
        cfg["include_mtp_layers"] = True  # shardctl's key: the inventory counts MTP layers
    spec = spec_from_config(cfg, tp=tp, pp=pp, ep=ep, where=str(cfg_path))
    needed = {n for u in names.units(spec) for n in u.hf}
    extra = sorted(present - needed)
    if extra:
        raise InvalidInputError(
            f"format megatron: no mcore tensor for {extra[:3]}"
            + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""),
            where=str(source.root),
            hint="write --format ranks or hf for this checkpoint",
        )
    missing = sorted(needed - present)
    if missing:
        raise InvalidInputError(
            f"format megatron: checkpoint lacks {missing[:3]} that {spec.model_type} needs",
            where=str(source.root),
        )
    for t in source.model.tensors:
        if t.dtype not in _DTYPES:
            raise InvalidInputError(
                f"format megatron: tensor {t.fqn!r} has dtype {t.dtype}; expected BF16, F16 or F32",
                where=str(source.root),
            )
    return spec


def to_megatron(
    src: Path, dst: Path, *, tp: int = 1, pp: int = 1, ep: int = 1, force: bool = False
) -> dict[str, Any]:
    """Write the HF checkpoint ``src`` as a Megatron torch_dist checkpoint at ``dst``."""
    source = open_source(src)
    if source.kind != "hf":
        raise InvalidInputError(
            "format megatron reads an HF checkpoint; this is a shardctl ranks layout",
            where=str(src),
            hint="merge it first: shardctl reshard SRC MERGED --format hf",
        )
    spec = hf_spec(source, tp=tp, pp=pp, ep=ep)
    dst = _check_dst(src, dst, force, [f.path for f in source.files])
    preflight_space(dst.parent, sum(f.size for f in source.files) + 2**20)
    lock = OutputLock(dst)
    lock.acquire()
    staging: Path | None = None
    try:
        atomic.recover(dst)
        staging = atomic.make_staging(dst)
        _write_into(staging, source, spec)
        source.check_unchanged()
        atomic.commit(staging, dst, replace=force)
        staging = None
    finally:
        atomic.discard(staging)
        lock.release()
    return {"spec": spec, "dst": dst, "files": _sizes(dst)}


def _check_dst(src: Path, dst: Path, force: bool, inputs: list[Path]) -> Path:
    """``check_output``; ``--force`` also replaces a previous megatron output of shardctl
    (recognized by its sidecar; ``check_replaceable`` knows only layout records)."""
    d = Path(dst)
    if force and d.is_dir() and not d.is_symlink() and (d / layout.SIDECAR).is_file():
        try:
            return check_output(src, dst, force=False, input_files=inputs)
        except OutputConflictError as exc:
            if exc.message != "output exists":
                raise
            return Path(os.path.realpath(Path(os.path.abspath(d)).parent)) / d.name
    return check_output(src, dst, force=force, input_files=inputs)


def _write_into(staging: Path, source: Source, spec: MegatronSpec) -> None:
    fds: dict[int, int] = {}

    def get(fqn: str) -> torch.Tensor:
        # pread into a fresh buffer, not an mmap: resident memory stays one unit's tensors
        # (a mapped file's touched pages would count against this process up to its size)
        shard = source.shards[fqn][0]
        if shard.file not in fds:
            fds[shard.file] = os.open(source.files[shard.file].path, os.O_RDONLY)
        t = torch.empty(shard.local_shape, dtype=_DTYPES[shard.dtype])
        view = memoryview(t.view(-1).view(torch.uint8).numpy().data).cast("B")
        got = 0
        while got < shard.nbytes:
            n = os.preadv(fds[shard.file], [view[got:]], shard.begin + got)
            if n <= 0:
                raise InvalidInputError(
                    f"tensor {fqn!r}: file ends early", where=str(source.files[shard.file].path)
                )
            got += n
        return t

    dtypes = {t.fqn: _DTYPES[t.dtype] for t in source.model.tensors}
    chunks = [
        dcp_io.Chunk(
            u.key,
            u.global_shape,
            u.offsets,
            u.chunk_shape,
            dtypes[u.hf[0]],
            (lambda u=u: names.pack(u, spec, get)),  # type: ignore[misc]
        )
        for u in names.units(spec)
    ]
    none = io.BytesIO()
    torch.save([None], none)
    blobs = [dcp_io.Blob(k, none.getvalue()) for k, _ in names.extra_state_keys(spec)]
    ckpt = staging / layout.RELEASE
    os.mkdir(ckpt)
    try:
        dcp_io.write(ckpt, chunks, blobs)
    finally:
        for fd in fds.values():
            os.close(fd)
    common = io.BytesIO()
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, common)
    atomic.write_file(ckpt / layout.COMMON, common.getvalue())
    atomic.write_file(ckpt / layout.MCORE_METADATA, json.dumps(layout.BACKEND).encode())
    atomic.write_file(staging / layout.TRACKER, (layout.RELEASE + "\n").encode())
    for rel in source.carried:
        with open(source.root / rel, "rb") as f:
            atomic.write_file(staging / rel.name, f.read())
    sidecar = {
        "schema": layout.SIDECAR_SCHEMA,
        "spec": spec.to_json(),
        "tensors": [[t.fqn, list(t.shape), t.dtype] for t in source.model.tensors],
        **_hf_split(source),
        "load_flags": load_flags(spec),
    }
    atomic.write_file(
        staging / layout.SIDECAR, (json.dumps(sidecar, indent=1) + "\n").encode("utf-8")
    )
    atomic.fsync_dir(ckpt)


def _hf_split(source: Source) -> dict[str, Any]:
    """The source's HF file split (names, tensors per file in order) and its index bytes, so
    that megatron -> HF rebuilds the same files."""
    if len(source.files) < 2 or not (source.root / INDEX_NAME).is_file():
        return {}
    groups: list[list[str]] = [[] for _ in source.files]
    order = sorted(source.shards.items(), key=lambda kv: (kv[1][0].file, kv[1][0].begin))
    for fqn, shards in order:
        groups[shards[0].file].append(fqn)
    return {
        "hf_files": [[f.path.name, g] for f, g in zip(source.files, groups, strict=True)],
        "hf_index": (source.root / INDEX_NAME).read_text(encoding="utf-8"),
    }


def _sizes(dst: Path) -> list[tuple[str, int]]:
    out = []
    for dirpath, _, files in os.walk(dst):
        for n in sorted(files):
            p = Path(dirpath) / n
            out.append((str(p.relative_to(dst)), p.stat().st_size))
    return out
