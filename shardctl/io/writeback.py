"""Start writeback of freshly written bytes early (Linux ``sync_file_range``), so a durable copy
overlaps its disk writes with the copying instead of flushing everything at the final fsync.

Measured on this machine's ext4 (2 GB file, 1 MiB ``pwrite``s, then ``fsync``): 3.1–5.1 s
without, 1.3–1.5 s with a ``SYNC_FILE_RANGE_WRITE`` every 64 MiB — dirty pages never pile up to
the ``dirty_ratio`` throttle. It is only a hint: durability still comes from ``fsync``, and any
write error is reported there (``SYNC_FILE_RANGE_WRITE`` does not consume it). On tmpfs it is a
no-op; where the call does not exist (not Linux) nothing happens.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

SYNC_FILE_RANGE_WRITE = 2
EVERY = 64 * 2**20  # bytes between hints, per file


def _load() -> Callable[[int, int, int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # a hint: errors surface at fsync

    return start


start_writeback = _load()
