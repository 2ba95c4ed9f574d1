"""Source windows: small tensors are copied out of a few large reads, not one ``pread`` each.

A checkpoint of 90,000 tensors of 4 KiB read one ``pread`` per target tensor costs ~150,000
system calls and as many trips through the read path (input checksum feed included). The copy
walks tensors in source-file order, so the small tensors it needs from one input file lie in a
forward-moving stretch of it: one read of ``WINDOW`` bytes serves every small tensor inside it
(and every ``tp`` target of it), and the next read starts where the next tensor starts.

A window is kept per input file (a merge reads its ranks' files side by side), at most
``MAX_WINDOWS`` of them, least recently used dropped first: memory ``MAX_WINDOWS × WINDOW``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

WINDOW = 2 * 2**20
MAX_WINDOWS = 8


class Windows:
    """The window half of :class:`~shardctl.reshard.copy.Executor` (which sets these)."""

    input_paths: list[Path]
    windows: OrderedDict[int, tuple[int, int, bytearray]]  # file -> (start, length, buffer)
    sizes: dict[int, int]  # input file -> its size (fstat once)

    def _read(self, file: int, offset: int, mv: memoryview) -> None:
        raise NotImplementedError  # gather.Gather._read

    def _fd(self, file: int) -> int:
        raise NotImplementedError  # gather.Gather._fd

    def window_size(self) -> int:
        return WINDOW

    def _window(self, file: int, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of input ``file`` (``length <= WINDOW``), from
        the window holding them or a fresh window read starting at ``offset``."""
        got = self.windows.get(file)
        if got is not None:
            start, n, buf = got
            if start <= offset and offset + length <= start + n:
                self.windows.move_to_end(file)
                return memoryview(buf)[offset - start : offset - start + length]
            del self.windows[file]
        else:
            buf = (
                self.windows.popitem(last=False)[1][2]
                if len(self.windows) >= MAX_WINDOWS
                else bytearray(self.window_size())
            )
        size = self.sizes.get(file)
        if size is None:
            size = self.sizes[file] = os.fstat(self._fd(file)).st_size
        n = max(length, min(len(buf), size - offset))
        self._read(file, offset, memoryview(buf)[:n])  # short read: exit 5, input changed
        self.windows[file] = (offset, n, buf)
        return memoryview(buf)[:length]
