"""Output side of the copy: one open output file's state and the threads that write them.

A :class:`Writer` hashes each buffer and ``pwrite``s it in queue order, so the digest is of the
bytes actually written and every output file is written sequentially; it fsyncs and closes a
file once its last byte is in.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardctl.checkpoint.plan_files import OutputFile
from shardctl.io import faults, writeback
from shardctl.io.checksum import new_hash
from shardctl.io.writeback import start_writeback


class OutFile:
    def __init__(self, path: Path, f: OutputFile, hash_name: str, writer: Writer):
        self.path = path
        self.writer = writer
        self.file = f
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.hasher = new_hash(hash_name)
        self.pos = 0
        self.flushed = 0  # bytes handed to writeback so far
        self.digest = ""
        # Small tensors batched into one buffer (see batching.Batching._small): the buffer, the file
        # offset of its first byte, bytes filled, and the source reads still to issue into it.
        self.pend: bytearray | None = None
        self.pend_at = 0
        self.pend_len = 0
        self.pend_reads: list[list[int]] = []  # [file, src offset, buffer offset, length]
        self.started = False  # its header handed to the writer (``Batching._started``)


class Lease:
    """A buffer several queued writes share (``reshard.columnar``'s chunk: a stretch for each
    of its files): back to ``home`` once the last of them is done (``home`` None: dropped)."""

    def __init__(self, home: queue.Queue[Any] | None, buf: Any, writes: int) -> None:
        self.home, self.buf, self.left = home, buf, writes
        self.lock = threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.left -= 1
            done = self.left == 0
        if done and self.home is not None:
            self.home.put(self.buf)


class Writer(threading.Thread):
    """Hashes and writes buffers in queue order; fsyncs and closes finished files.

    Every output file belongs to one writer, so its bytes are hashed and written in file order;
    several writers let the kernel's page-cache copies (the cost that ``cp`` pays too) of
    different files run on different cores.
    """

    def __init__(
        self,
        pool: queue.Queue[bytearray],
        i: int,
        on_done: Callable[[str, int, str], None] | None = None,
    ):
        super().__init__(name=f"shardctl-writer-{i}", daemon=True)
        self.on_done = on_done
        self.q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self.pool = pool
        self.error: BaseException | None = None
        self.stop = False

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                if self.error is None and not self.stop:
                    self._do(item)
            except BaseException as exc:
                self.error = exc
            finally:
                if item[0] == "data" and item[4] is not None:
                    if isinstance(item[4], Lease):
                        item[4].release()
                    else:
                        self.pool.put(item[4])

    def _do(self, item: tuple[Any, ...]) -> None:
        if item[0] == "header":  # inflated here, a piece at a time
            out = item[1]
            assert out.pos == 0, (out.path, out.pos)
            for piece in out.file.header_pieces():
                self._do(("data", out, out.pos, memoryview(piece), None))
        elif item[0] == "data":
            _, out, offset, mv, _buf = item
            assert offset == out.pos, (out.path, offset, out.pos)
            out.hasher.update(mv)  # the very bytes handed to pwrite, in file order
            done = 0
            while done < len(mv):
                done += os.pwrite(out.fd, mv[done:], offset + done)
            out.pos += len(mv)
            if start_writeback is not None and out.pos - out.flushed >= writeback.EVERY:
                start_writeback(out.fd, out.flushed, out.pos - out.flushed)
                out.flushed = out.pos
            if offset == 0:
                faults.point("shard_started")
        else:
            out = item[1]
            if out.pos != out.file.size:
                raise AssertionError(f"{out.path}: wrote {out.pos} of {out.file.size} bytes")
            out.digest = out.hasher.hexdigest()
            faults.point("shard_written")
            os.fsync(out.fd)
            faults.point("shard_fsynced")
            fd, out.fd = out.fd, -1
            os.close(fd)  # may report a deferred write error (NFS, quotas): still fatal
            if self.on_done is not None:
                self.on_done(out.file.name, out.file.size, out.digest)
