"""Bitwise level, the threads: tasks run on up to ``MAX_THREADS`` threads, each DST file's
record hash fed in file order (``Feed``) by whichever thread finds the hashing free."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardctl.checkpoint.source import Source
from shardctl.verify.bitwise import plan
from shardctl.verify.bitwise.compare import (
    Buffers,
    Out,
    Worker,
    check_padding,
    compare_block,
    compare_raw,
)
from shardctl.verify.bitwise.spans import compare_span

MAX_THREADS = 4
# Bytes no task reads (headers: 3.4 MB per rank file at 90,000 tensors, alignment) are hashed
# in chunks of this size: a buffer per thread, so kept small (2 MiB each was ~8 MiB at 4).
GAP_BYTES = 256 * 2**10
THREADS_ENV = "SHARDCTL_VERIFY_THREADS"


def threads() -> int:
    """Worker threads: ``SHARDCTL_VERIFY_THREADS`` or the usable CPUs, at most ``MAX_THREADS``."""
    env = os.environ.get(THREADS_ENV, "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


class Feed:
    """One DST file's hash, fed in file order; gaps between the blocks' reads are read here."""

    def __init__(self, path: Path, name: str) -> None:
        from shardctl.io.checksum import new_hash

        self.path = path
        self.name = name
        self.hasher = new_hash(name)
        self.pos = 0
        self.in_order = True
        self.rehashed = False  # its blocks came out of file order: hashed again from the start

    def feed(self, offset: int, data: memoryview, w: Worker) -> None:
        if not self.in_order:
            return
        if offset < self.pos:
            self.in_order = False  # hashed again from the start at the end
            return
        if offset > self.pos:
            self._read(w, offset)
        self.hasher.update(data)
        self.pos = offset + len(data)

    def _read(self, w: Worker, end: int | None) -> None:
        """Hash from ``pos`` to ``end`` (None: to the end of the file)."""
        fd = w.fds(self.path)
        while end is None or self.pos < end:
            chunk = min(GAP_BYTES, plan.BLOCK_BYTES)  # tests shrink BLOCK_BYTES
            want = chunk if end is None else min(chunk, end - self.pos)
            buf = w.gap.get(want)
            n = os.preadv(fd, [buf], self.pos)
            if n <= 0:
                if end is None:
                    return
                raise OSError(0, "short read (the file changed during the run)", str(self.path))
            self.hasher.update(buf[:n])
            self.pos += n

    def hexdigest(self, w: Worker) -> str:
        if not self.in_order:
            from shardctl.io.checksum import new_hash

            self.hasher, self.pos, self.in_order = new_hash(self.name), 0, True
            self.rehashed = True
        self._read(w, None)
        return str(self.hasher.hexdigest())


class _Stopped(Exception):
    """Another thread failed: stop quietly, its error is the one reported."""


class _Pipeline:
    """Buffer sets shared by the threads, and the hashing of their DST bytes in task order.

    A thread takes a free set *before* it takes a task number, reads and compares into it, and
    posts it. Whoever posts then *drains*: if no other thread is hashing, it feeds the posted
    sets' DST bytes to their files' hashes, in task order from the first not yet hashed,
    freeing each set — usually its own task's bytes, still in its cache. A thread never waits
    for its turn: it goes on to the next task, and waits only when every set is posted and
    another thread is hashing them.
    """

    def __init__(self, sets: int, feeds: dict[Path, Feed]) -> None:
        self.cv = threading.Condition()
        self.hashing = threading.Lock()
        self.feeds = feeds
        self.free = [Buffers() for _ in range(sets)]
        self.posted: dict[int, tuple[list[tuple[Path, int, memoryview]], Buffers]] = {}
        self.next = 0
        self.error: BaseException | None = None

    def take(self, w: Worker) -> Buffers:
        while True:
            with self.cv:
                if self.error is not None:
                    raise _Stopped
                if self.free:
                    return self.free.pop()
            if not self.drain(w, wait=True):
                with self.cv:
                    if not self.free and self.error is None:
                        self.cv.wait(0.05)

    def give(self, bufs: Buffers) -> None:
        with self.cv:
            self.free.append(bufs)
            self.cv.notify_all()

    def post(self, i: int, reads: list[tuple[Path, int, memoryview]], bufs: Buffers) -> None:
        with self.cv:
            self.posted[i] = (reads, bufs)

    def drain(self, w: Worker, *, wait: bool = False) -> bool:
        """Hash what is posted, in order, unless another thread is at it; True if it hashed."""
        did = False
        while True:
            with self.cv:
                if self.next not in self.posted:
                    return did
            if not self.hashing.acquire(blocking=wait):
                return did
            try:
                while True:
                    with self.cv:
                        if self.error is not None:
                            raise _Stopped
                        item = self.posted.pop(self.next, None)
                    if item is None:
                        break
                    for path, offset, data in item[0]:
                        feed = self.feeds.get(path)
                        if feed is not None:
                            feed.feed(offset, data, w)
                    did = True
                    with self.cv:
                        self.next += 1
                        self.free.append(item[1])
                        self.cv.notify_all()
            finally:
                self.hashing.release()
            wait = False  # loop: a set posted while this thread held the lock is hashed too

    def stop(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()


def run_tasks(
    tasks: Iterator[tuple[Any, ...]], src: Source, feeds: dict[Path, Feed]
) -> tuple[list[Worker], list[tuple[int, tuple[Any, ...], dict[str, Any], str, int, Any]]]:
    """Run the tasks on ``threads()`` threads (this one included); findings tagged by task
    number. Returns the workers (byte counts)."""
    lock = threading.Lock()
    numbered = enumerate(tasks)
    n = threads()
    pipe = _Pipeline(n + 1, feeds)  # one set hashing while each thread fills one
    results: list[tuple[int, tuple[Any, ...], dict[str, Any], str, int, Any]] = []
    workers = [Worker() for _ in range(n)]

    def work(w: Worker) -> None:
        try:
            while True:
                w.bufs = pipe.take(w)
                with lock:
                    nxt = next(numbered, None) if pipe.error is None else None
                if nxt is None:
                    pipe.give(w.bufs)
                    return
                i, task = nxt
                out = Out()
                if task[0] == "block":
                    compare_block(task[1], task[2], task[3], task[4], w, out)
                elif task[0] == "blocks":
                    at = 0
                    for t, lead, a, b in task[1]:
                        at = compare_block(t, lead, a, b, w, out, at)
                elif task[0] == "span":
                    compare_span(task[1], w, out)
                elif task[0] == "padding":
                    check_padding(task[1], task[2], w, out)
                else:
                    compare_raw(task[1], src, w, out)
                if out.findings:
                    with lock:
                        results.extend((i, *f) for f in out.findings)
                if feeds:
                    pipe.post(i, out.hash_reads, w.bufs)
                    pipe.drain(w)
                else:
                    pipe.give(w.bufs)
        except _Stopped:
            return
        except BaseException as exc:
            pipe.stop(exc)
            raise

    errors: list[BaseException] = []

    def thread(w: Worker) -> None:
        try:
            work(w)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    helpers = [threading.Thread(target=thread, args=(w,), daemon=True) for w in workers[1:]]
    for h in helpers:
        h.start()
    try:
        work(workers[0])
    except BaseException as exc:
        pipe.stop(exc)
        raise
    finally:
        for h in helpers:
            h.join()
    if errors:
        raise errors[0]
    if feeds:
        pipe.drain(workers[0], wait=True)  # whatever the last threads posted
    return workers, results
