"""Resuming a run that was killed hard (``kill -9``, the OOM killer, preemption, power loss).

A run that fails or is interrupted cleanly (an error, Ctrl-C, SIGTERM) removes its staging
directory. One that dies without cleaning up leaves it behind, and the next run for the same
output (under the lock) finds it. If that directory was written by an identical run — same
tool version, same input files (names, sizes, mtimes), same output files with the same headers,
same checksum algorithm — its finished files are kept and only the rest is written::

    .out.shardctl-staging-<pid>-<rand>/
      .shardctl-run.json     {"id": ...}: the run's identity, written and fsynced first
      .shardctl-journal      one JSON line per finished file {"name", "size", "digest"}, appended
                             and fsynced after the file itself was fsynced and closed
      rank-00000-of-00004.safetensors ...

A journaled file is reused only if its size matches and it hashes to its journaled digest again
(one read, no write); everything else in the directory (a half-written file, carried files) is
removed and rewritten. Any other stale staging directory is removed as before (reliability case E3).
Under ``torchrun`` a restart is always clean (the workers' shares may differ).

What resume trusts (README, ``reshard --help``): input bytes are **not** re-hashed to decide
reuse. An input counts as unchanged when its name, size and mtime match the killed run's, and
— for inputs without a known digest — its device, inode and ctime too: any write to a file
moves its ctime, which ``touch`` cannot set back, so content rewritten in place never mixes
with reused output. Inputs with known digests (a shardctl layout record, HF-cache blob names)
are hashed in full, reused or not. ``--no-resume`` always starts clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardctl import __version__
from shardctl.checkpoint.input_check import hash_file
from shardctl.errors import EnvironmentFailure
from shardctl.io import atomic

if TYPE_CHECKING:
    from shardctl.checkpoint.source import Source
    from shardctl.reshard.target import Plan

IDENT = ".shardctl-run.json"
JOURNAL = ".shardctl-journal"


def run_id(source: Source, the_plan: Plan, hash_name: str) -> str:
    """What makes two runs write the same bytes: inputs, output files and headers, hash.

    A header counts by its deflated bytes (what the plan holds; the same header deflates to
    the same bytes under one zlib, and another zlib only costs a resume): inflating and hashing
    every header was ~0.3 s at 100,000 tensors on tp 8 (100 MB of header)."""
    files = [[f.name, f.size, hashlib.sha256(f.header_z).hexdigest()] for f in the_plan.files]
    what = {
        "version": __version__,
        "source": source.identity(),
        # inode and ctime of inputs whose digest is unknown (those with one are hashed in
        # full anyway): a rewrite that keeps size and mtime (``touch -d``) still moves ctime,
        # which no user can set back; such an input never resumes (no mixed output)
        "inputs": [_stamp(f.path) for f in source.files if f.recorded is None and f.sha256 is None],
        "fmt": the_plan.fmt,
        "files": files,
        "hash": hash_name,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def start(staging: Path, ident: str) -> None:
    """Mark a fresh staging directory as resumable by an identical run."""
    atomic.write_file(staging / IDENT, json.dumps({"id": ident}).encode())
    atomic.fsync_dir(staging)


def finish(staging: Path) -> None:
    """Before the commit: the bookkeeping is not part of the output."""
    for name in (IDENT, JOURNAL):
        (staging / name).unlink(missing_ok=True)


def adopt(dst: Path, ident: str, hash_name: str) -> tuple[Path | None, dict[str, str]]:
    """Under the lock: a stale staging directory of an identical run, and its finished files
    (``name -> digest``) that still hash to their digests; ``(None, {})`` if there is none."""
    found = [p for p in atomic.siblings(dst, atomic.staging_prefix(dst)) if p.is_dir()]
    for cand in sorted(found, key=_mtime, reverse=True):
        if _ident(cand) != ident:
            continue
        done = _journal(cand)
        keep: dict[str, str] = {}
        for name, (size, digest) in done.items():
            path = cand / name
            try:
                ok = path.is_file() and path.stat().st_size == size
                if ok and hash_file(path, size, hash_name) == digest:
                    keep[name] = digest
            except (OSError, EnvironmentFailure):
                continue  # unreadable or shrinking: written again
        for p in cand.iterdir():
            if p.name not in keep and p.name not in (IDENT, JOURNAL):
                atomic.discard(p)
        lines = b"".join(
            json.dumps({"name": n, "size": done[n][0], "digest": d}).encode() + b"\n"
            for n, d in keep.items()
        )
        atomic.write_file(cand / JOURNAL, lines, exclusive=False)
        atomic.fsync_dir(cand)
        return cand, keep
    return None, {}


class Journal:
    """Appends one line per finished file (thread-safe: writer threads finish files)."""

    def __init__(self, staging: Path):
        self.fd = os.open(
            staging / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666
        )
        self.lock = threading.Lock()

    def done(self, name: str, size: int, digest: str) -> None:
        line = json.dumps({"name": name, "size": size, "digest": digest}).encode() + b"\n"
        with self.lock:
            os.write(self.fd, line)
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _ident(staging: Path) -> str | None:
    try:
        data: Any = json.loads((staging / IDENT).read_bytes())
    except (OSError, ValueError):
        return None
    return data.get("id") if isinstance(data, dict) else None


def _journal(staging: Path) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    try:
        lines = (staging / JOURNAL).read_bytes().splitlines()
    except OSError:
        return out
    for line in lines:  # a torn last line (killed mid-append) does not parse: skipped
        try:
            entry = json.loads(line)
            name, size, digest = str(entry["name"]), int(entry["size"]), str(entry["digest"])
        except (ValueError, KeyError, TypeError):
            continue
        if "/" not in name and name not in ("", ".", "..", IDENT, JOURNAL):
            out[name] = (size, digest)
    return out


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
