"""An output file that hashes what it writes and is fsynced on close."""

from __future__ import annotations

import os
from pathlib import Path

from shardctl.checkpoint.record import FileDigest
from shardctl.io.checksum import new_hash


class HashedFile:
    def __init__(self, path: Path, hash_name: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self._hash = new_hash(hash_name)
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> FileDigest:
        os.fsync(self._fd)
        os.close(self._fd)
        return FileDigest(self.path.name, self.size, self._hash.hexdigest())

    def abort(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
