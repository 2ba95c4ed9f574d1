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


class Scratch:
    """A reusable read buffer: reading into fresh memory page-faults on every page, which
    costs more than the read itself when the data is in the page cache."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> memoryview:
        if self._buf.size < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.size), dtype=np.uint8)
        return memoryview(self._buf.data)[:nbytes]


def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` (exactly; a short file is an error, never garbage)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read: {done} of {len(buf)} bytes at {offset}")
        done += n


def read_box(
    fd: int,
    begin: int,
    shape: tuple[int, ...],
    kind: type[np.unsignedinteger],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    scratch: Scratch | None = None,
) -> np.ndarray:
    """The box as a ``sizes``-shaped array of ``kind``: a view into ``scratch`` when given
    (valid until its next use), else a fresh array."""
    scratch = scratch or Scratch()
    item = np.dtype(kind).itemsize
    if not shape:
        buf = scratch.get(item)
        pread_into(fd, buf, begin)
        return np.frombuffer(buf, dtype=kind)
    if math.prod(sizes) == 0:
        return np.zeros(sizes, dtype=kind)
    nd = len(shape)
    j = nd - 1
    while j > 0 and offsets[j] == 0 and sizes[j] == shape[j]:
        j -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = sizes[j] * strides[j]
    if j == 0 or run * item >= MIN_RUN_BYTES:
        buf = scratch.get(math.prod(sizes) * item)
        at = 0
        for idx in itertools.product(*(range(offsets[d], offsets[d] + sizes[d]) for d in range(j))):
            start = sum(i * strides[d] for d, i in enumerate(idx)) + offsets[j] * strides[j]
            pread_into(fd, buf[at : at + run * item], begin + start * item)
            at += run * item
        return np.frombuffer(buf, dtype=kind).reshape(sizes)
    # Narrow runs: read rows offsets[0]..+sizes[0] whole, slice the box out (a strided view).
    buf = scratch.get(sizes[0] * strides[0] * item)
    pread_into(fd, buf, begin + offsets[0] * strides[0] * item)
    rows = np.frombuffer(buf, dtype=kind).reshape((sizes[0], *shape[1:]))
    inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
    return rows[(slice(None), *inner)]


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality; contiguous arrays are compared 8 bytes at a time."""
    if a.flags.c_contiguous and b.flags.c_contiguous and a.nbytes == b.nbytes:
        if a.nbytes % 8 == 0:
            return bool(
                np.array_equal(a.reshape(-1).view(np.uint64), b.reshape(-1).view(np.uint64))
            )
        return bool(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))
    return bool(np.array_equal(a, b))
