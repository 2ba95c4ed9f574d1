"""Input checksums (RELIABILITY A15/A16): hash every input file whose digest is known, on the side.

A shardctl layout records a BLAKE3 (or sha256) digest per file; an HF-cache snapshot names each
LFS blob by its sha256. Either way a flipped bit or a zero-filled data region in the *input* is
invisible to the copy itself (it moves bytes, it does not judge them), so while the copy runs a
background thread reads each such file front to back with ``pread`` (no mmap: a truncated input
must not SIGBUS) and hashes it. BLAKE3 and hashlib release the GIL, so on a second core this
overlaps the copy. The run commits only if every digest matches; otherwise exit 3.

Inputs without a known digest (a plain HF directory) are accepted as they are: only a hash can
catch silent corruption, and the README says so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardctl.errors import EnvironmentFailure, InvalidInputError

_BLOCK = 2**20


@dataclass(frozen=True)
class Expected:
    path: Path
    size: int
    hash_name: str  # "blake3" | "sha256"
    digest: str
    origin: str  # where the digest comes from, for the error line


class InputCheck:
    """Hash ``files`` on one daemon thread; :meth:`result` raises on the first mismatch."""

    def __init__(self, files: Sequence[Expected]):
        self.files = list(files)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardctl-input-hash", daemon=True)
        self.bytes = sum(f.size for f in self.files)

    def start(self) -> InputCheck:
        if self.files:
            self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def result(self) -> None:
        """Wait for the hashes; raise InvalidInputError (exit 3) on a mismatch."""
        if self._thread.is_alive():
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            for f in self.files:
                if self._stop.is_set():
                    return
                got = hash_file(f.path, f.size, f.hash_name, self._stop)
                if got is None:
                    return
                if got != f.digest:
                    raise InvalidInputError(
                        f"input hash mismatch: {f.hash_name} is {got[:16]}…, "
                        f"{f.origin} says {f.digest[:16]}…",
                        where=str(f.path),
                        hint="the input was modified or corrupted after it was written; restore "
                        "it (or pass --no-verify-input to skip this check)",
                    )
        except BaseException as exc:  # reported by result() on the main thread
            self._error = exc


def hash_file(
    path: Path, size: int, hash_name: str, stop: threading.Event | None = None
) -> str | None:
    """Digest of ``path``'s first ``size`` bytes (None if stopped); exit 5 if it is shorter."""
    from shardctl.reshard.copy import new_hash

    h = new_hash(hash_name)
    buf = bytearray(_BLOCK)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        while pos < size:
            if stop is not None and stop.is_set():
                return None
            n = os.preadv(fd, [mv[: min(_BLOCK, size - pos)]], pos)
            if n == 0:
                raise EnvironmentFailure(
                    f"input changed during run (short read at byte {pos} of {size})",
                    where=str(path),
                    hint="rerun once the input is stable",
                )
            h.update(mv[:n])
            pos += n
    finally:
        os.close(fd)
    return str(h.hexdigest())
