"""Checksums of checkpoint files: the algorithms a layout record may name, and their hashers."""

from __future__ import annotations

from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError

# Checksum algorithms a layout record may name (the first is what reshard writes). XXH3-128 runs
# at ~27 GB/s on one core here against BLAKE3's 2.7 and sha256's ~1.5: hashing 4 GB costs ~0.15
# CPU-s instead of ~1.5, next to a copy's ~3. The record's checksums guard against accidental
# corruption (bit rot, torn or zero-filled writes), for which 128 non-cryptographic bits suffice;
# they cannot guard against tampering whatever the hash, since the record sits next to the data.
HASHES = ("xxh3-128", "blake3", "sha256")


def new_hash(name: str) -> Any:
    """A hasher for one of :data:`HASHES` (``update``/``hexdigest``); exit 5 if not installed."""
    try:
        if name == "xxh3-128":
            import xxhash

            return xxhash.xxh3_128()
        if name == "blake3":
            import blake3

            return blake3.blake3()
    except ImportError as exc:
        raise EnvironmentFailure(
            f"the {name} checksum needs the {exc.name} package, which is not installed",
            hint=f"pip install {exc.name}",
        ) from None
    if name != "sha256":
        raise InvalidInputError(
            f"unknown checksum algorithm {name!r}", hint=f"expected one of {', '.join(HASHES)}"
        )
    import hashlib

    return hashlib.sha256()


def default_hash() -> str:
    """XXH3-128 when xxhash is installed (a dependency), else sha256."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3-128"
