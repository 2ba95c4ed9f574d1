"""Input checksums (reliability cases A15/A16): hash every input file whose digest is known.

A shardctl layout records an XXH3-128 (or BLAKE3, sha256) digest per file; an HF-cache snapshot
names each LFS blob by its sha256. Either way a flipped bit or a zero-filled data region in the
*input* is invisible to the copy itself (it moves bytes, it does not judge them), so each such
file is hashed during the copy, and the run commits only if every digest matches (else exit 3).

- **From the copy's own reads** (XXH3-128, ~27 GB/s: cheap enough for the reading thread): each
  byte the copy reads is fed to its file's hash as it goes by, so a merge or an any-to-any run
  reads its input once, not twice. Bytes the copy does not read (headers, replicas it takes from
  another rank) are read when the copy passes them: any gap before the copy's first read of the
  file (a merge of an ``--ep`` split takes the replicated tensors at the front of ranks 1..n's
  files from rank 0: ~135 MB each on DeepSeek-V3's shape), a small one after it. A file read out
  of order (a big gap after its first read: e.g. an ``S(0)`` split that reads each quarter in
  lockstep) is handed to
- **a background thread**, which reads the file front to back with ``pread`` (no mmap: a
  truncated input must not SIGBUS) and hashes it on a second core. Slower hashes (sha256 of an
  HF-cache blob, BLAKE3) go there from the start.

Inputs without a known digest (a plain HF directory) are accepted as they are: only a hash can
catch silent corruption, and the README says so.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io.checksum import new_hash

_BLOCK = 2**20
# Hashes fast enough to run on the copy's reading thread (the rest go to the background thread).
INLINE = ("xxh3-128",)
# A gap in a file's reads up to this size is read on the spot; a larger one (after the copy's
# first read of the file) means the copy reads the file out of order, and the background thread
# hashes the whole file instead. The gap before the first read is always read on the spot: it
# costs no more bytes than hashing the whole file would.
GAP_MAX = 4 * 2**20


@dataclass(frozen=True)
class Expected:
    path: Path
    size: int
    hash_name: str  # one of shardctl.io.checksum.HASHES
    digest: str
    origin: str  # where the digest comes from, for the error line


class _Feed:
    """One file's hash, fed in file order from the copy's reads."""

    def __init__(self, f: Expected):
        self.f = f
        self.hasher: Any = new_hash(f.hash_name)
        self.pos = 0  # bytes [0, pos) hashed
        self.fed = False  # the copy has read from this file

    def take(self, offset: int, data: memoryview) -> bool:
        """Hash ``data`` (read at ``offset``); False if the file is being read out of order."""
        end = min(offset + len(data), self.f.size)
        if end <= self.pos:
            return True  # read again (a one-entry cache miss): already hashed
        if offset > self.pos:
            if offset - self.pos > GAP_MAX and self.fed:
                return False
            self.read_to(offset)
        self.fed = True
        self.hasher.update(data[self.pos - offset : end - offset])
        self.pos = end
        return True

    def read_to(self, end: int) -> None:
        fd = os.open(self.f.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.pos = _hash_range(fd, self.f.path, self.hasher, self.pos, end, None)
        finally:
            os.close(fd)

    def digest(self) -> str:
        self.read_to(self.f.size)
        return str(self.hasher.hexdigest())


class InputCheck:
    """Check ``files``' digests during a copy; :meth:`result` raises on the first mismatch.

    The copy calls :meth:`take` with every read (one thread); files with an :data:`INLINE`
    hash are fed from it, the others (and any read out of order) are hashed by a daemon thread.
    """

    def __init__(self, files: Sequence[Expected]):
        self.files = list(files)
        self.feeds = {f.path: _Feed(f) for f in self.files if f.hash_name in INLINE}
        self._todo: queue.SimpleQueue[Expected | None] = queue.SimpleQueue()
        for f in self.files:
            if f.path not in self.feeds:
                self._todo.put(f)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardctl-input-hash", daemon=True)

    def start(self) -> InputCheck:
        if self.files:
            self._thread.start()
        return self

    def take(self, path: Path, offset: int, data: memoryview) -> None:
        """The copy read ``data`` at ``offset`` of ``path``."""
        feed = self.feeds.get(path)
        if feed is not None and not feed.take(offset, data):
            del self.feeds[path]  # out of order: the background thread hashes it whole
            self._todo.put(feed.f)

    def cancel(self) -> None:
        self._stop.set()
        self._join()

    def result(self) -> None:
        """Finish the hashes; raise InvalidInputError (exit 3) on a mismatch."""
        for path, feed in list(self.feeds.items()):
            if feed.pos == 0:  # never read by this copy (another worker's share): hash it whole
                del self.feeds[path]
                self._todo.put(feed.f)
        try:
            for feed in self.feeds.values():  # the tails the copy did not read, if any
                if self._error is not None:
                    break
                _compare(feed.f, feed.digest())
        except BaseException:
            self.cancel()
            raise
        self._join()
        if self._error is not None:
            raise self._error

    def _join(self) -> None:
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def _run(self) -> None:
        try:
            while (f := self._todo.get()) is not None:
                if self._stop.is_set():
                    return
                got = hash_file(f.path, f.size, f.hash_name, self._stop)
                if got is None:
                    return
                _compare(f, got)
        except BaseException as exc:  # reported by result() on the main thread
            self._error = exc


def _compare(f: Expected, got: str) -> None:
    if got != f.digest:
        raise InvalidInputError(
            f"input hash mismatch: {f.hash_name} is {got[:16]}…, {f.origin} says {f.digest[:16]}…",
            where=str(f.path),
            hint="the input was modified or corrupted after it was written; restore "
            "it (or pass --no-verify-input to skip this check)",
        )


def hash_file(
    path: Path, size: int, hash_name: str, stop: threading.Event | None = None
) -> str | None:
    """Digest of ``path``'s first ``size`` bytes (None if stopped); exit 5 if it is shorter."""
    h = new_hash(hash_name)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _hash_range(fd, path, h, 0, size, stop) < size:
            return None
    finally:
        os.close(fd)
    return str(h.hexdigest())


def _hash_range(
    fd: int, path: Path, h: Any, pos: int, end: int, stop: threading.Event | None
) -> int:
    """Feed bytes ``[pos, end)`` of ``fd`` to ``h``; returns where it stopped (``end`` unless
    ``stop`` was set); exit 5 on a short read."""
    buf = bytearray(min(_BLOCK, max(0, end - pos)))
    mv = memoryview(buf)
    while pos < end:
        if stop is not None and stop.is_set():
            return pos
        n = os.preadv(fd, [mv[: min(len(buf), end - pos)]], pos)
        if n == 0:
            raise EnvironmentFailure(
                f"input changed during run (short read at byte {pos} of {end})",
                where=str(path),
                hint="rerun once the input is stable",
            )
        h.update(mv[:n])
        pos += n
    return pos
