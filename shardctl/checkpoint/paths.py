"""Path safety of a checkpoint directory: names the index lists, symlinks, the HF cache.

An index path must be a plain relative POSIX name (no drive, no ``..``, no NUL or backslash)
and resolve inside the checkpoint directory — or, for the Hugging Face cache layout
(``<repo>/snapshots/<rev>/<file> -> ../../blobs/<sha>``), to a file directly in ``blobs/``.
"""

from __future__ import annotations

import os
from pathlib import Path, PureWindowsPath

from shardctl.errors import InvalidInputError


class PathGuard:
    """Index paths and symlinks must stay inside ``root`` (or the HF cache's ``blobs/``)."""

    def __init__(self, root: Path, follow: bool):
        self.root = root
        self.real_root = os.path.realpath(root)
        self.follow = follow
        # HF cache: <repo>/snapshots/<rev>/<file> -> ../../blobs/<sha>
        parent = os.path.dirname(self.real_root)
        self.blobs = (
            os.path.join(os.path.dirname(parent), "blobs")
            if os.path.basename(parent) == "snapshots"
            else None
        )

    def check_syntax(self, rel: str, where: str) -> None:
        """The HF-hub rule: a plain relative POSIX path, no drive, no traversal."""
        bad = None
        if rel == "":
            bad = "empty path"
        elif "\x00" in rel:
            bad = "NUL byte in path"
        elif "\\" in rel:
            bad = "backslash in path"
        elif rel.startswith("/") or PureWindowsPath(rel).anchor:
            bad = "absolute path or drive"
        elif any(part in ("", ".", "..") for part in rel.split("/")):
            bad = "'.', '..' or empty component"
        if bad:
            raise InvalidInputError(
                f"unsafe path {rel!r} ({bad})",
                where=where,
                hint="weight_map values must be file names inside the checkpoint directory",
            )

    def check(self, rel: str) -> None:
        """``root/rel`` must resolve inside ``root`` (or the HF blobs dir, or ``follow``)."""
        real = os.path.realpath(os.path.join(self.root, rel))
        if inside(real, self.real_root) or self.follow:
            return
        if self.blobs is not None and os.path.dirname(real) == self.blobs:
            return
        raise InvalidInputError(
            f"{rel!r} resolves to {real}, outside the checkpoint directory",
            where=str(self.root),
            hint="pass --follow-external-symlinks if you trust that target",
        )


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
