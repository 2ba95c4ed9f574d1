"""The forward level's reference: an HF checkpoint transformers loads as the unsharded model.

An HF SRC is loaded as it is. A SRC that is itself a shardctl layout (``verify TP2 TP4``) is
first reassembled into a temporary HF directory — ``config.json`` (and
``generation_config.json``) copied, every global tensor written to one ``model.safetensors``,
block by block, through the same reassembly the bitwise level compares with (``bitwise.plan.
fill_image``), not through ``reshard``: verify does not build its reference with the code it
checks, and works the same under ``torchrun``, where ``reshard`` would split its work among
the ranks.

Cost: constant memory for the merge (one block, ``bitwise.plan.BLOCK_BYTES``), disk for one copy of
SRC's tensors in the temporary directory (``tempfile``: ``$TMPDIR``, else ``/tmp``), removed as
soon as transformers has loaded the model. The reference forward itself then holds the whole
model, as for an HF SRC: its weights in their dtype, then upcast to float64 (about 5× the BF16
size at the peak) — the forward level is for models that fit one host's memory.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from shardctl.checkpoint.source import Source, open_source
from shardctl.dtypes import nbytes
from shardctl.errors import EnvironmentFailure
from shardctl.io.tempdirs import owned_tempdir
from shardctl.verify.bitwise import plan as bitwise_plan
from shardctl.verify.boxes import FdCache, Scratch, pread_into, uint_of

CARRIED = ("config.json", "generation_config.json")


@contextmanager
def hf_reference(root: Path, figures: dict[str, Any] | None = None) -> Iterator[Path]:
    """An HF directory for ``root``: itself when it is one, else a temporary merge of it."""
    source = open_source(root)
    if source.kind == "hf":
        if figures is not None:
            figures["reference"] = "hf"
        yield root
        return
    t0 = time.perf_counter()
    with owned_tempdir("shardctl-verify-reference-") as out:  # reaped if this run is killed
        try:
            size = write_merged(source, out)
        except OSError as exc:
            raise EnvironmentFailure(
                f"could not write the reference model (SRC's shards merged) to {out}: "
                f"{exc.strerror or exc}",
                hint="set TMPDIR to a directory with room for one copy of SRC",
            ) from None
        if figures is not None:
            figures.update(
                reference="merged from SRC's shards",
                reference_merge_s=time.perf_counter() - t0,
                reference_merge_bytes=size,
            )
        yield out


def write_merged(source: Source, out: Path) -> int:
    """Write SRC's global tensors as ``out/model.safetensors`` plus its config; the tensor bytes."""
    for name in CARRIED:
        if (source.root / name).is_file():
            shutil.copyfile(source.root / name, out / name)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in source.model.tensors:
        n = nbytes(t.dtype, math.prod(t.shape))
        header[t.fqn] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fds = FdCache()
    image, copy = Scratch(), Scratch()

    def read(path: Path, buf: memoryview, offset: int) -> None:
        pread_into(fds(path), buf, offset, path)

    try:
        with open(out / "model.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for t in source.model.tensors:
                _write_tensor(f, source, t.fqn, t.dtype, t.shape, image, copy, read)
            f.flush()
            os.fsync(f.fileno())
    finally:
        fds.close()
    return at


def _write_tensor(
    f: Any,
    source: Source,
    fqn: str,
    dtype: str,
    shape: tuple[int, ...],
    image: Scratch,
    copy: Scratch,
    read: Any,
) -> None:
    kind = uint_of(dtype)
    if kind is None:  # sub-byte: only a tensor one SRC piece holds whole
        shards = source.shards[fqn]
        if len(shards) != 1 or shards[0].local_shape != shape:
            raise EnvironmentFailure(
                f"could not build the reference: {fqn} is {dtype} (sub-byte) and split",
                hint="verify against an HF checkpoint of the model instead",
            )
        buf = image.get(nbytes(dtype, math.prod(shape)))
        read(source.files[shards[0].file].path, buf, shards[0].begin)
        f.write(buf)
        return
    item = np.dtype(kind).itemsize
    full = shape or (1,)
    if math.prod(full) == 0:
        return
    k = bitwise_plan.block_dim(full, item)
    parts = bitwise_plan.src_parts(source, fqn, full, k)
    row = math.prod(full[k + 1 :])
    rows_per = max(1, bitwise_plan.BLOCK_BYTES // max(1, row * item))
    for lead in itertools.product(*(range(n) for n in full[:k])):
        for a in range(0, full[k], rows_per):
            b = min(full[k], a + rows_per)
            raw = image.get((b - a) * row * item)
            got, filled = bitwise_plan.fill_image(
                parts, kind, full, k, (lead, a, b), raw, read, copy
            )
            if filled != got.size:
                raise EnvironmentFailure(
                    f"could not build the reference: SRC's pieces cover {filled} of {got.size} "
                    f"elements of a block of {fqn}"
                )
            f.write(raw)
