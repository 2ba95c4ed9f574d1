"""Open a checkpoint directory safely: which files hold which tensors, and what travels along.

``open_checkpoint(root)`` reads only headers and the index, never tensor data, and refuses
(:class:`~shardctl.errors.InvalidInputError`, exit 3) before opening anything outside ``root``:

- an index (``model.safetensors.index.json``) above 10 MiB, not strict JSON (duplicate keys,
  ``NaN``, ``1e400``), or whose ``weight_map`` is not a string → string map (reliability case B5);
- a ``weight_map`` path that is empty, absolute, has a drive (``C:x``), a backslash, a NUL, or a
  ``.`` / ``..`` / empty component, or that resolves outside ``root`` (B1–B3); one that is not
  ``*.safetensors`` (B4: ``index references non-safetensors file``);
- a symlink (weight or carried file) whose target lies outside ``root`` (B6), unless
  ``follow_external_symlinks``. Allowed without it: targets inside ``root``, and the Hugging
  Face cache layout — ``root`` resolves to ``<repo>/snapshots/<rev>`` and the target is a file
  directly in ``<repo>/blobs/``;
- index and shards that disagree (A19): a tensor the index names but its shard lacks, a tensor
  in a shard the index does not name, a tensor in two shards, a file of the index's
  ``*-NNNNN-of-MMMMM.safetensors`` series that the index does not reference — all listed in one
  error. A wrong ``metadata.total_size`` (or ``total_parameters``) is only a *warning*: loaders
  ignore it, and its meaning drifted across transformers versions (4.x counted bool as 1/8 byte,
  some tools write other sums); transformers 5.23 writes the exact sum of tensor bytes, and the
  tensor-level checks above already catch every missing or extra byte;
- pickle weights (``.bin``/``.pt``/``.pth``/``.ckpt``/``.pkl``) with no safetensors beside them:
  :class:`PickleInputRefused` (``pickle input refused; pass --allow-pickle``), carrying the file
  list for the loader that will handle ``--allow-pickle``.

Without an index, ``model.safetensors`` is the checkpoint (or the only ``*.safetensors``).
A shardctl sharded layout (``shardctl.layout.json`` at the root) is reported as
``kind="shardctl"`` with its record path and no further checks: its reader validates it.
``ignore_layout_record=True`` reads such a directory as a plain HF checkpoint instead (for
shardctl's own HF-format outputs, which carry a record); the record is then listed in
``ignored`` and ``layout_record`` still points at it.

Carried files (``extra_files``): every regular top-level file that is not weights or an index —
config.json, generation_config.json, tokenizer files, chat templates, README, licence.
Not carried (listed in ``ignored`` with the reason): subdirectories (e.g. Llama's ``original/``
with Meta's consolidated ``.pth``), dotfiles (``.gitattributes``, ``.cache``), weights in other
formats (pickle, ``.h5``, ``.msgpack``, ``.gguf``, ``.onnx``), safetensors files outside the
index (e.g. Mistral's ``consolidated.safetensors``), and non-regular files (FIFO, device).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

from shardctl.checkpoint.hf_index import compare_index, read_index, unreferenced_series
from shardctl.checkpoint.paths import PathGuard
from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io.heap import give_back_heap
from shardctl.io.safetensors_header import (
    DEFAULT_MAX_HEADER_BYTES,
    HeaderEntry,
    SafetensorsHeader,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
LAYOUT_RECORD = "shardctl.layout.json"
MAX_LISTED = 20  # discrepancies spelled out in one error line; all are on the exception

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
OTHER_WEIGHT_SUFFIXES = (".h5", ".msgpack", ".gguf", ".onnx", ".npz")


class TensorLocation(NamedTuple):
    """Where one tensor's bytes lie: ``file.data_offset + entry.begin`` onwards in ``file.path``."""

    file: SafetensorsHeader
    entry: HeaderEntry

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def file_offset(self) -> int:
        return self.file.data_offset + self.entry.begin


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint directory, validated. Paths in ``extra_files``/``ignored`` are relative."""

    root: Path
    kind: str  # "hf" | "shardctl"
    files: tuple[SafetensorsHeader, ...]  # in index (file name) order
    index_path: Path | None = None
    index_metadata: Mapping[str, Any] | None = None
    extra_files: tuple[Path, ...] = ()
    ignored: tuple[tuple[Path, str], ...] = ()  # (relative path, why it is not carried)
    warnings: tuple[str, ...] = ()
    layout_record: Path | None = None  # kind == "shardctl": the record its reader validates
    pickle_files: tuple[Path, ...] = field(default=())

    @cached_property
    def locations(self) -> Mapping[str, TensorLocation]:
        """fqn -> location, in file then offset order. Built on first use: ``plan`` and
        ``inspect`` read the headers' entries only (at 90,000 tensors the map is ~20 ms).
        A name is in one file only (``open_checkpoint`` refuses one in two)."""
        return _locate(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(h.data_bytes for h in self.files)


class PickleInputRefused(InvalidInputError):
    """Only pickle weights were found; ``files`` are what an ``--allow-pickle`` loader reads."""

    def __init__(self, root: Path, files: tuple[Path, ...]):
        self.files = files
        names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        super().__init__(
            f"pickle input refused ({names}); no safetensors files found",
            where=str(root),
            hint="pass --allow-pickle to load it with torch.load(weights_only=True)",
        )


class IndexMismatch(InvalidInputError):
    """Index and shards disagree; ``discrepancies`` lists every one."""

    def __init__(self, where: str, discrepancies: list[str]):
        self.discrepancies = discrepancies
        shown = "; ".join(discrepancies[:MAX_LISTED])
        more = len(discrepancies) - MAX_LISTED
        if more > 0:
            shown += f"; and {more} more"
        super().__init__(
            f"index and shards disagree ({len(discrepancies)}): {shown}",
            where=where,
            hint="re-download the checkpoint or regenerate its index",
        )


def open_checkpoint(
    root: Path,
    *,
    follow_external_symlinks: bool = False,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ignore_layout_record: bool = False,
) -> CheckpointFiles:
    """Validate ``root`` (a directory, or one ``.safetensors`` file) and locate every tensor."""
    root = Path(root)
    if not root.exists():
        raise InvalidInputError("checkpoint not found", where=str(root))
    if root.is_file():
        header = read_header(root, max_header_bytes=max_header_bytes)
        return CheckpointFiles(root=root, kind="hf", files=(header,))
    if not root.is_dir():
        raise InvalidInputError("not a directory or a safetensors file", where=str(root))
    from shardctl.formats.megatron.layout import is_megatron  # engine formats (issue 16)

    if is_megatron(root):
        raise InvalidInputError(
            "a Megatron-Core torch_dist checkpoint: reshard and verify read it, this command "
            "reads HF checkpoints and shardctl layouts",
            where=str(root),
            hint=f"convert it first: shardctl reshard {root} OUT --format hf",
        )
    has_record = os.path.lexists(root / LAYOUT_RECORD)
    if has_record and not ignore_layout_record:
        return CheckpointFiles(
            root=root, kind="shardctl", files=(), layout_record=root / LAYOUT_RECORD
        )
    return _open_hf(root, follow_external_symlinks, max_header_bytes)


def _open_hf(root: Path, follow: bool, max_header_bytes: int) -> CheckpointFiles:
    guard = PathGuard(root, follow)
    listing = _list_dir(root)
    safetensors = sorted(n for n in listing.files if n.endswith(".safetensors"))
    pickles = tuple(Path(n) for n in sorted(listing.files) if n.endswith(PICKLE_SUFFIXES))
    index_path, index_metadata, weight_map = _index_of(root, listing, guard)
    if weight_map is not None:
        weight_names = sorted(set(weight_map.values()))
    else:
        weight_names = _unindexed_weights(root, safetensors, pickles, guard)

    # Every path is checked before any weight file is opened (B1–B3, B6).
    for name in weight_names:
        guard.check(name)
    missing = [n for n in weight_names if not os.path.lexists(root / n)]
    if missing:
        raise IndexMismatch(
            str(index_path or root),
            [f"shard {n} is listed in the index but missing" for n in missing],
        )
    headers = [read_header(root / n, max_header_bytes=max_header_bytes) for n in weight_names]
    give_back_heap()  # the header texts and their scan, dropped

    problems: list[str] = []
    warnings: list[str] = []
    if weight_map is not None:
        assert index_path is not None and index_metadata is not None
        problems, warnings = compare_index(weight_map, headers, index_metadata, root)
        problems += unreferenced_series(weight_names, safetensors)
    if problems:
        raise IndexMismatch(str(index_path), problems)

    used = set(weight_names) | ({index_path.name} if index_path else set())
    extras, ignored = _carried(listing, used, guard)
    return CheckpointFiles(
        root=root,
        kind="hf",
        files=tuple(headers),
        index_path=index_path,
        index_metadata=index_metadata,
        extra_files=extras,
        ignored=ignored,
        warnings=tuple(warnings),
        layout_record=root / LAYOUT_RECORD if LAYOUT_RECORD in listing.files else None,
        pickle_files=pickles,
    )


def _index_of(
    root: Path, listing: _Listing, guard: PathGuard
) -> tuple[Path | None, Mapping[str, Any] | None, dict[str, str] | None]:
    """``(path, metadata, weight_map)`` of the directory's index; all None without one."""
    indexes = sorted(n for n in listing.files if n.endswith(".safetensors.index.json"))
    if not indexes:
        return None, None, None
    name = INDEX_NAME if INDEX_NAME in indexes else indexes[0]
    if name != INDEX_NAME and len(indexes) > 1:
        raise InvalidInputError(
            f"several safetensors indexes ({', '.join(indexes)}) and no {INDEX_NAME}",
            where=str(root),
            hint="keep one index per checkpoint directory",
        )
    guard.check(name)
    metadata, weight_map = read_index(root / name)
    return root / name, metadata, weight_map


def _unindexed_weights(
    root: Path, safetensors: list[str], pickles: tuple[Path, ...], guard: PathGuard
) -> list[str]:
    """Without an index: ``model.safetensors``, or the only ``*.safetensors``; else refuse."""
    if SINGLE_NAME in safetensors:
        return [SINGLE_NAME]
    if len(safetensors) == 1:
        return safetensors
    if safetensors:
        raise InvalidInputError(
            f"{len(safetensors)} safetensors files and no {INDEX_NAME}",
            where=str(root),
            hint="add the index, or point at one .safetensors file",
        )
    if pickles:
        for p in pickles:  # the symlink rule of safetensors inputs, before any opt-in
            guard.check(str(p))
        raise PickleInputRefused(root, pickles)
    raise InvalidInputError(
        f"no safetensors weights found (expected model.safetensors or {INDEX_NAME} with its "
        "shards)",
        where=str(root),
    )


def _carried(
    listing: _Listing, used: set[str], guard: PathGuard
) -> tuple[tuple[Path, ...], tuple[tuple[Path, str], ...]]:
    """(files that travel with the output, files left behind with the reason)."""
    extras: list[Path] = []
    ignored: list[tuple[Path, str]] = [(Path(n), why) for n, why in listing.ignored]
    for name in sorted(listing.files):
        if name in used:
            continue
        why = _not_carried_reason(name)
        if why is not None:
            ignored.append((Path(name), why))
            continue
        guard.check(name)
        extras.append(Path(name))
    return tuple(extras), tuple(sorted(ignored))


# ---- directory listing -----------------------------------------------------------------


@dataclass
class _Listing:
    files: list[str]  # regular files (or symlinks to them), top level, not dotfiles
    ignored: list[tuple[str, str]]


def _list_dir(root: Path) -> _Listing:
    listing = _Listing([], [])
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except PermissionError as exc:
        raise EnvironmentFailure(f"cannot list: {exc.strerror}", where=str(root)) from None
    for e in entries:
        if e.name.startswith("."):
            listing.ignored.append((e.name, "dotfile"))
            continue
        try:
            st = os.stat(e.path)  # follows symlinks: what a reader would get
        except OSError:
            listing.ignored.append((e.name, "dangling symlink"))
            continue
        if stat.S_ISDIR(st.st_mode):
            listing.ignored.append((e.name, "subdirectory"))
        elif stat.S_ISREG(st.st_mode):
            listing.files.append(e.name)
        else:
            # A weight file that is a FIFO or device still fails loudly in read_header.
            if e.name.endswith(".safetensors"):
                listing.files.append(e.name)
            else:
                listing.ignored.append((e.name, "not a regular file"))
    return listing


def _not_carried_reason(name: str) -> str | None:
    if name == LAYOUT_RECORD:
        return "shardctl layout record (describes this directory, not a copy of it)"
    if name.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors file not referenced by the checkpoint's index"
    if name.endswith(PICKLE_SUFFIXES) or name.endswith(
        tuple(s + ".index.json" for s in PICKLE_SUFFIXES)
    ):
        return "pickle weights (the safetensors weights are used)"
    if name.endswith(OTHER_WEIGHT_SUFFIXES):
        return "weights in another format"
    return None


def _locate(headers: tuple[SafetensorsHeader, ...]) -> dict[str, TensorLocation]:
    # C-level maps (``tuple.__new__`` makes each NamedTuple without its Python ``__new__``):
    # at 90,000 tensors this is a fifth of opening the checkpoint otherwise
    out: dict[str, TensorLocation] = {}
    for h in headers:
        pairs = zip(repeat(h), h.tensors, strict=False)  # repeat(h): as long as h.tensors
        locations = map(tuple.__new__, repeat(TensorLocation), pairs)
        out.update(zip(map(_NAME, h.tensors), locations, strict=True))
    return out


_NAME = attrgetter("name")
