"""Entry points: a manifest file or text → a validated :class:`Manifest` (or exit 3)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardctl.errors import EnvironmentFailure, ManifestError
from shardctl.manifest.model import Manifest
from shardctl.manifest.validate import build_manifest
from shardctl.manifest.yamlstrict import MAX_BYTES, check_size, decode, parse


def load_manifest(path: Path) -> Manifest:
    """Read, check and validate the manifest at ``path``.

    Relative paths inside it resolve against its folder. Raises :class:`ManifestError`
    (exit 3) for anything invalid or unsafe, :class:`EnvironmentFailure` (exit 5) when the
    file exists but cannot be read.
    """
    source = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ManifestError(
            "manifest not found", where=source, hint="check the path; manifests/ holds examples"
        ) from None
    except OSError as exc:
        raise EnvironmentFailure(f"cannot read manifest: {exc.strerror}", where=source) from None
    if not stat.S_ISREG(info.st_mode):
        # Never open a FIFO or device: opening a FIFO blocks until a writer appears.
        raise ManifestError(
            "not a regular file", where=source, hint="give the path of a .yaml manifest"
        )
    check_size(info.st_size, source=source)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise EnvironmentFailure(f"cannot read manifest: {exc.strerror}", where=source) from None
    text = decode(data, source=source)
    resolved = Path(path).resolve()
    return build_manifest(
        parse(text, source=source), base_dir=resolved.parent, source=source, path=resolved
    )


def parse_manifest(text: str, *, base_dir: Path, source: str = "<string>") -> Manifest:
    """Validate manifest ``text``; relative paths resolve against ``base_dir``."""
    return build_manifest(
        parse(text, source=source), base_dir=Path(base_dir).resolve(), source=source
    )
