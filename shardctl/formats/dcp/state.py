"""Training state as flat DCP keys, read one item at a time, from a DCP or an HF directory.

Both inputs present the same face (:class:`TrainingState`): ``items`` (every key with its
global shape and dtype, or ``None`` for a non-tensor object), ``tensor(key)``, ``obj(key)``.
An HF directory maps ``model.safetensors`` tensors to ``model.<fqn>`` and its optional sidecar
``optimizer.safetensors`` (written by :mod:`shardctl.formats.dcp.hf_out`) back to the keys it
came from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardctl.errors import InvalidInputError
from shardctl.formats.dcp.metadata import METADATA_NAME, SUFFIX, read_metadata
from shardctl.formats.dcp.read import DcpReader

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer."
SIDECAR_NAME = "optimizer.safetensors"
SIDECAR_FORMAT = "shardctl.dcp-sidecar/1"
OBJECTS_KEY = "shardctl.dcp.objects"  # sidecar __metadata__: {key: tagged JSON value}


@dataclass(frozen=True)
class Item:
    key: str
    shape: tuple[int, ...] | None  # None: a non-tensor object
    dtype: Any = None  # torch.dtype

    @property
    def is_model(self) -> bool:
        return self.key.startswith(MODEL_PREFIX)


class TrainingState(Protocol):
    root: Path
    kind: str  # "dcp" | "hf" | "zero"
    items: tuple[Item, ...]
    carried: tuple[str, ...]  # top-level non-checkpoint files that travel (config.json, ...)

    def tensor(self, key: str) -> Any: ...

    def obj(self, key: str) -> Any: ...

    def close(self) -> None: ...


def carried_files(root: Path, skip: set[str], skip_suffixes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(
        n
        for n in sorted(os.listdir(root))
        if not n.startswith(".")
        and n not in skip
        and not n.endswith(skip_suffixes)
        and (root / n).is_file()
        and not (root / n).is_symlink()
    )


class DcpState:
    kind = "dcp"

    def __init__(self, root: Path):
        self.root = root
        self.md = read_metadata(root)
        self._reader = DcpReader(self.md)
        self.items = tuple(
            [Item(k, t.shape, t.dtype) for k, t in self.md.tensors.items()]
            + [Item(k, None) for k in self.md.objects]
        )
        if not any(i.is_model for i in self.items):
            raise InvalidInputError(
                "no model.<fqn> keys in this DCP checkpoint",
                where=str(root / METADATA_NAME),
                hint='expected dcp.save({"model": ..., "optimizer": ...}) as get_state_dict '
                "returns them (torchtitan's flattened model keys are not supported)",
            )
        self.carried = carried_files(root, set(self.md.files), (SUFFIX,))

    def tensor(self, key: str) -> Any:
        return self._reader.tensor(key)

    def obj(self, key: str) -> Any:
        return self._reader.obj(key)

    def close(self) -> None:
        self._reader.close()


class HfState:
    """An HF checkpoint (any shardctl-readable one) plus the optional optimizer sidecar."""

    kind = "hf"

    def __init__(self, root: Path, *, optimizer: bool = True):
        from shardctl.checkpoint.hf import open_checkpoint
        from shardctl.io.safetensors_header import read_header

        self.root = root
        if (root / "shardctl.layout.json").is_file():
            from shardctl.checkpoint import record as rec

            if rec.read(root).layout is not None:
                raise InvalidInputError(
                    "a shardctl per-rank layout cannot be converted to DCP directly",
                    where=str(root),
                    hint="merge it first (shardctl reshard SRC MERGED --format hf), then "
                    "convert MERGED with --format dcp",
                )
        ck = open_checkpoint(root, ignore_layout_record=True)
        # key -> (file, byte offset, byte length): read with pread, never mmap (RSS stays one
        # tensor; an mmap'd file counts every page touched)
        self._where: dict[str, tuple[Path, int, int]] = {}
        items: list[Item] = []
        for fqn, loc in ck.locations.items():
            e = loc.entry
            items.append(Item(MODEL_PREFIX + fqn, e.shape, _torch_dtype(e.dtype)))
            self._where[MODEL_PREFIX + fqn] = (loc.path, loc.file_offset, e.nbytes)
        self._objects: dict[str, Any] = {}
        sidecar = root / SIDECAR_NAME
        if optimizer and sidecar.is_file() and not sidecar.is_symlink():
            header = read_header(sidecar)
            meta = header.metadata or {}
            if meta.get("format") != SIDECAR_FORMAT:
                raise InvalidInputError(
                    f"not a shardctl optimizer sidecar (format {meta.get('format')!r}, "
                    f"expected {SIDECAR_FORMAT!r})",
                    where=str(sidecar),
                    hint="rename it, or pass --no-optimizer to convert the weights only",
                )
            for e in header.tensors:
                if e.name.startswith(MODEL_PREFIX):
                    raise InvalidInputError(
                        f"sidecar tensor {e.name!r} claims a model key; model weights live in "
                        "model.safetensors",
                        where=str(sidecar),
                        hint="pass --no-optimizer to ignore the sidecar",
                    )
                items.append(Item(e.name, e.shape, _torch_dtype(e.dtype)))
                self._where[e.name] = (sidecar, header.data_offset + e.begin, e.nbytes)
            self._objects = _decode_objects(meta.get(OBJECTS_KEY, "{}"), str(sidecar))
            items.extend(Item(k, None) for k in self._objects)
        self.carried = tuple(str(p) for p in ck.extra_files)
        self._tie(items)
        self.items = tuple(items)
        self._shapes = {i.key: (i.shape, i.dtype) for i in items if i.shape is not None}
        self._fds: dict[Path, int] = {}

    def _tie(self, items: list[Item]) -> None:
        """A tied checkpoint has no ``lm_head.weight`` on disk; the model's state dict (and so
        FSDP2's DCP checkpoint, which ``dcp.load`` must find every key of) has it: the table."""
        from shardctl.formats.dcp.write_hf import EMBEDDINGS, tied_lm_head

        head = MODEL_PREFIX + "lm_head.weight"
        if head in self._where or not tied_lm_head(self.root, self.carried):
            return
        for name in EMBEDDINGS:
            emb = next((i for i in items if i.key == MODEL_PREFIX + name), None)
            if emb is not None:
                items.insert(items.index(emb) + 1, Item(head, emb.shape, emb.dtype))
                self._where[head] = self._where[emb.key]
                return

    def tensor(self, key: str) -> Any:
        import torch

        path, begin, length = self._where[key]
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        buf = bytearray(length)
        view, at = memoryview(buf), 0
        while at < length:
            n = os.preadv(fd, [view[at:]], begin + at)
            if n == 0:
                raise InvalidInputError(f"{key!r}: file ends early", where=str(path))
            at += n
        shape, dtype = self._shapes[key]
        if length == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def obj(self, key: str) -> Any:
        return self._objects[key]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def open_state(root: Path, *, optimizer: bool = True) -> TrainingState:
    from shardctl.formats.dcp.metadata import is_dcp
    from shardctl.formats.dcp.zero import ZeroState, is_zero

    if is_dcp(root):
        return DcpState(root)
    if is_zero(root):
        return ZeroState(root)
    return HfState(root, optimizer=optimizer)


def _torch_dtype(name: str) -> Any:
    import torch

    from shardctl.dtypes import TORCH_NAMES

    torch_name = TORCH_NAMES.get(name)
    dtype = getattr(torch, torch_name or "", None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInputError(f"dtype {name} has no torch equivalent")
    return dtype


# ---- non-tensor objects (param_groups) as JSON: tuples tagged so they come back as tuples ----


def encode_objects(objects: dict[str, Any], where: str) -> str:
    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, tuple):
            return {"__tuple__": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {"__dict__": {k: enc(x) for k, x in v.items()}}
        raise InvalidInputError(
            f"cannot store a {type(v).__name__} in the optimizer sidecar",
            where=where,
            hint="pass --no-optimizer to convert the weights only",
        )

    return json.dumps({k: enc(v) for k, v in objects.items()}, allow_nan=True)


def _decode_objects(text: str, where: str) -> dict[str, Any]:
    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if isinstance(v, dict) and set(v) == {"__tuple__"}:
            return tuple(dec(x) for x in v["__tuple__"])
        if isinstance(v, dict) and set(v) == {"__dict__"}:
            return {k: dec(x) for k, x in v["__dict__"].items()}
        return v

    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"{OBJECTS_KEY} is not JSON ({exc})", where=where) from None
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{OBJECTS_KEY} must be a JSON object", where=where)
    return {k: dec(v) for k, v in raw.items()}
