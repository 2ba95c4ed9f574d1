"""Low-level pieces of the bitwise level: integer views, reused buffers, exact reads, compares.

Integers, never floats: ``torch.equal`` is false on identical NaNs and ``allclose`` misses a
flipped sign bit; comparing ``uint16`` views of BF16 is exact on every bit. Reads go through
``os.preadv`` into reused buffers (no mmap: a file truncated under us is an error, not SIGBUS).
Contiguous regions are compared with ``memcmp`` (through ctypes, which releases the GIL, so
two threads compare at once); strided ones with numpy on the widest integer view the rows
allow (``uint64`` when a row segment is a multiple of 8 bytes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardctl.dtypes import DTYPE_BITS

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
            # its own mapping, not the C heap: given back whole when dropped, where a heap
            # block freed by one thread stays in that thread's arena (~15 MiB a thread)
            size = max(nbytes, 2 * self._buf.size)
            self._buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        return memoryview(self._buf.data)[:nbytes]


def pread_into(fd: int, buf: memoryview, offset: int, path: Path | None = None) -> None:
    """Fill ``buf`` from ``offset`` (exactly; a short file is an error, never garbage)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(
                0,
                f"short read: {done} of {len(buf)} bytes at offset {offset} "
                "(the file changed during the run)",
                str(path) if path else None,
            )
        done += n


class FdCache:
    """Open files by path, at most ``limit`` at once (least recently used closed first), so a
    checkpoint of thousands of files never runs out of descriptors. One per thread."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._fds: OrderedDict[Path, int] = OrderedDict()

    def __call__(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        if len(self._fds) >= self.limit:
            os.close(self._fds.popitem(last=False)[1])
        fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    try:
        if sys.platform == "win32":
            lib = ctypes.cdll.msvcrt
        else:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = lib.memcmp
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_MEMCMP = _load_memcmp()


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _widest(a: np.ndarray) -> np.ndarray:
    """``a`` viewed with the widest unsigned integer its contiguous rows allow."""
    if a.ndim == 0 or a.strides[-1] != a.itemsize:
        return a
    row = a.shape[-1] * a.itemsize
    for width in (8, 4, 2):
        if width > a.itemsize and row % width == 0:
            try:
                return a.view(UINT[width])
            except ValueError:
                return a
    return a


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality of two same-shaped integer arrays."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.flags.c_contiguous and b.flags.c_contiguous:
        if a.nbytes == 0:
            return True
        if _MEMCMP is not None:
            return _MEMCMP(_address(a), _address(b), a.nbytes) == 0
        return bool(np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))
    wa, wb = _widest(a), _widest(b)
    if wa.dtype != wb.dtype:
        wa, wb = a, b
    return bool(np.array_equal(wa, wb))
