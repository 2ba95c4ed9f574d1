"""Read a rectangular box of a tensor stored row-major in a file, as an integer array.

Integers, never floats: ``torch.equal`` is false on identical NaNs and ``allclose`` misses a
flipped sign bit; comparing ``uint16`` views of BF16 is exact on every bit. Reads go through
``os.pread`` (no mmap: a file truncated under us is an error, not SIGBUS).

A box ``[offsets, offsets + sizes)`` of a ``shape`` tensor is made of contiguous runs: from the
first dim ``j`` after which the box spans whole dims, each run is ``sizes[j] × prod(shape[j+1:])``
elements. Few long runs: one pread each. Many short runs (narrow columns): one pread of the
span and a strided slice, so no run costs a syscall of a few bytes.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np

from shardctl.dtypes import DTYPE_BITS

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
MIN_RUN_BYTES = 4096


def uint_of(dtype: str) -> type[np.unsignedinteger] | None:
    bits = DTYPE_BITS[dtype]
    if bits % 8:
        return None  # sub-byte (F4, F6): compared as whole-tensor bytes only
    return UINT.get(bits // 8)  # type: ignore[return-value]


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise OSError(f"short read: {len(data)} of {n} bytes at {offset}")
        data += more
    return data


def read_box(
    fd: int,
    begin: int,
    shape: tuple[int, ...],
    kind: type[np.unsignedinteger],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
) -> np.ndarray:
    """The box as a ``sizes``-shaped array of ``kind`` (a fresh, owned array)."""
    if not shape:
        return np.frombuffer(_pread(fd, np.dtype(kind).itemsize, begin), dtype=kind).copy()
    if math.prod(sizes) == 0:
        return np.zeros(sizes, dtype=kind)
    item = np.dtype(kind).itemsize
    nd = len(shape)
    j = nd - 1
    while j > 0 and offsets[j] == 0 and sizes[j] == shape[j]:
        j -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = sizes[j] * strides[j]
    if j == 0 or run * item >= MIN_RUN_BYTES:
        out = np.empty(math.prod(sizes), dtype=kind)
        at = 0
        for idx in itertools.product(*(range(offsets[d], offsets[d] + sizes[d]) for d in range(j))):
            start = sum(i * strides[d] for d, i in enumerate(idx)) + offsets[j] * strides[j]
            out[at : at + run] = np.frombuffer(_pread(fd, run * item, begin + start * item), kind)
            at += run
        return out.reshape(sizes)
    # Narrow runs: read rows offsets[0]..+sizes[0] whole, slice the box out.
    rows = np.frombuffer(
        _pread(fd, sizes[0] * strides[0] * item, begin + offsets[0] * strides[0] * item), kind
    ).reshape((sizes[0], *shape[1:]))
    inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
    return rows[(slice(None), *inner)].copy()
