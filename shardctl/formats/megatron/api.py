"""The reshard and verify entry points for Megatron-Core ``torch_dist`` (called by
:mod:`shardctl.api` when ``format="megatron"`` or when SRC is a torch_dist checkpoint).

- HF -> megatron: :func:`shardctl.formats.megatron.write.to_megatron` (streaming, atomic).
- megatron -> HF: :func:`shardctl.formats.megatron.read.to_hf` (byte-identical to the HF
  source for a checkpoint shardctl wrote).
- megatron -> ranks (or any other format): megatron -> HF into a private temporary directory,
  then the ordinary reshard of that HF checkpoint (the temporary copy costs one model of disk).
- shardctl ranks -> megatron: merged to HF in a temporary directory first, the same way.
- verify: a torch_dist side is presented as the HF checkpoint it holds (converted into a
  temporary directory), so structure, bitwise and forward run unchanged on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardctl.checkpoint.record import FileDigest
from shardctl.errors import UsageError
from shardctl.formats.megatron.layout import is_megatron
from shardctl.layout.types import Mesh
from shardctl.reshard.result import ReshardResult, peak_rss_bytes

TMP_PREFIX = "shardctl-megatron-"


def reshard(
    src: Path,
    dst: Path,
    *,
    fmt: str | None,
    mesh: Mesh | None,
    max_shard_size: int,
    force: bool,
    forward: Any,
) -> ReshardResult:
    """``fmt == "megatron"``: write DST as torch_dist; else SRC is torch_dist and is read.

    ``forward(src, dst, mesh, fmt)`` is :func:`shardctl.api.reshard` for the legs that go
    through an HF checkpoint in a temporary directory."""
    from shardctl.reshard.safety import os_failure
    from shardctl.reshard.signals import interrupts_raise

    # SIGINT/SIGTERM become Interrupted (130/143) and clean the staging; an OSError (disk full,
    # permission) is one exit-5 line, as in every reshard
    with interrupts_raise():
        try:
            return _reshard(src, dst, fmt, mesh, max_shard_size, force, forward)
        except OSError as exc:
            raise os_failure(exc) from None


def _reshard(
    src: Path,
    dst: Path,
    fmt: str | None,
    mesh: Mesh | None,
    max_shard_size: int,
    force: bool,
    forward: Any,
) -> ReshardResult:
    from shardctl.formats.megatron import read, write

    t0 = time.monotonic()
    m = mesh or Mesh()
    if fmt == "megatron":
        if m.dp != 1:
            raise UsageError(f"--format megatron holds one model replica; got dp {m.dp}")
        if is_megatron(src):
            raise UsageError(
                "SRC is already a Megatron torch_dist checkpoint; Megatron reshards it at load",
                hint="pass the TP/PP/EP degrees to Megatron, or convert to hf first",
            )
        from shardctl.checkpoint.hf import open_checkpoint

        kind = open_checkpoint(src).kind
        if kind == "shardctl" and _is_ranks(src):
            with _tempdir() as tmp:
                forward(src, tmp / "hf", None, "hf")
                out = write.to_megatron(tmp / "hf", dst, tp=m.tp, pp=m.pp, ep=m.ep, force=force)
        else:
            out = write.to_megatron(src, dst, tp=m.tp, pp=m.pp, ep=m.ep, force=force)
        return _result(src, out["dst"], "megatron", m, "hf", t0)
    wants_hf = fmt == "hf" or (fmt is None and (mesh is None or mesh.model_parallel == 1))
    if wants_hf:
        if mesh is not None and mesh.model_parallel > 1:
            raise UsageError(f"format hf holds whole tensors; mesh {mesh} needs format ranks")
        out_dst = read.to_hf(src, dst, force=force, max_shard_size=max_shard_size)
        return _result(src, out_dst, "hf", None, "megatron", t0)
    with _tempdir() as tmp:
        read.to_hf(src, tmp / "hf", max_shard_size=max_shard_size)
        result: ReshardResult = forward(tmp / "hf", dst, mesh, fmt)
    from dataclasses import replace

    return replace(result, src=src, source_kind="megatron", seconds=time.monotonic() - t0)


@contextmanager
def as_hf(path: Path) -> Iterator[Path]:
    """``path`` itself, or for a torch_dist checkpoint the HF checkpoint it holds (temporary)."""
    if not is_megatron(path):
        yield path
        return
    from shardctl.formats.megatron import read

    with _tempdir() as tmp:
        yield read.to_hf(path, tmp / "hf")


def _is_ranks(src: Path) -> bool:
    from shardctl.checkpoint import record

    return record.read(src).layout is not None


@contextmanager
def _tempdir() -> Iterator[Path]:
    from shardctl.io.tempdirs import owned_tempdir

    with owned_tempdir(TMP_PREFIX) as tmp:
        yield tmp


def _result(
    src: Path, dst: Path, fmt: str, mesh: Mesh | None, kind: str, t0: float
) -> ReshardResult:
    files: list[FileDigest] = []
    tensor_bytes = 0
    total = 0
    for dirpath, _, names in os.walk(dst):
        for n in sorted(names):
            p = Path(dirpath) / n
            size = p.stat().st_size
            total += size
            rel = str(p.relative_to(dst))
            if n.endswith((".distcp", ".safetensors")):
                tensor_bytes += size
            files.append(FileDigest(rel, size, ""))
    return ReshardResult(
        dst=dst,
        format=fmt,
        mesh=mesh,
        source_kind=kind,
        files=tuple(files),
        tensor_bytes=tensor_bytes,
        total_bytes=total,
        seconds=time.monotonic() - t0,
        hash="",
        carried=(),
        workers=1,
        src=src,
        peak_rss_bytes=peak_rss_bytes(),
    )
