"""Megatron-Core ``torch_dist`` -> HF safetensors (and, through HF, -> shardctl ranks).

The HF files are planned first (``checkpoint.plan_files.hf_files``: the same headers and
offsets every shardctl HF output has), then filled unit by unit: one mcore chunk set (a layer's
``linear_qkv``, an expert's ``linear_fc1``) is read, split back into its HF tensors, and each is
written at its planned offset. Memory: one unit. For a checkpoint shardctl wrote, the sidecar
gives the original HF tensor order, dtypes and file split (names, tensors per file, index
bytes), so HF -> megatron -> HF is byte-identical (an explicit ``max_shard_size`` other than
the default re-splits); for
one Megatron wrote, the HF names are sorted and the model's ``config.json`` must be present.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shardctl.checkpoint import plan_files
from shardctl.checkpoint.hf import INDEX_NAME
from shardctl.errors import InvalidInputError
from shardctl.formats.megatron import dcp_io, layout, names
from shardctl.formats.megatron.spec import MegatronSpec, spec_from_config
from shardctl.io import atomic
from shardctl.io.lock import OutputLock
from shardctl.model.types import TensorInfo
from shardctl.reshard.safety import check_output, preflight_space
from shardctl.reshard.target import DEFAULT_MAX_SHARD_SIZE

_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class MegatronCheckpoint:
    """A torch_dist checkpoint presented as HF-named global tensors (read one unit at a time)."""

    hf_files: list[list[Any]] | None = None  # the original HF split: [[name, [fqn, ...]], ...]
    hf_index: str | None = None

    def __init__(self, path: Path):
        self.root, self.ckpt = layout.locate(Path(path))
        layout.check_backend(self.ckpt)
        self.reader = dcp_io.DcpReader(self.ckpt)
        side = layout.read_sidecar(self.root)
        tensors = self.reader.tensors()
        emb = tensors.get("embedding.word_embeddings.weight")
        if emb is None:
            raise InvalidInputError(
                "torch_dist checkpoint without embedding.word_embeddings.weight (not a GPT "
                "model, or saved with a key prefix)",
                where=str(self.ckpt),
            )
        if side is not None:
            self.spec, self.hf = _from_sidecar(side, self.root / layout.SIDECAR)
            layers = _layers_held(tensors)
            if layers != self.spec.layers:  # before anything is sized from the sidecar
                raise InvalidInputError(
                    f"sidecar says {self.spec.layers} layers, the checkpoint holds {layers}",
                    where=str(self.root / layout.SIDECAR),
                )
            self.hf_files = side.get("hf_files")
            self.hf_index = side.get("hf_index")
        else:
            cfg = layout.read_config(self.root, self.ckpt)
            cfg = {**cfg, "tie_word_embeddings": "output_layer.weight" not in tensors}
            if any(k.startswith("mtp.layers.") for k in tensors):
                cfg["include_mtp_layers"] = True  # shardctl's key: count the MTP layers
            spec = spec_from_config(cfg, where=str(self.root / "config.json"))
            self.spec = replace(spec, padded_vocab=int(emb.size[0]))
            self.hf = self._derive_tensors(tensors)
        self._check_shapes(tensors)

    def _derive_tensors(self, tensors: dict[str, Any]) -> list[TensorInfo]:
        out: list[TensorInfo] = []
        for u in names.units(self.spec):
            meta = tensors.get(u.key)
            if meta is None:
                continue  # reported by _check_shapes
            dtype = _NAMES.get(meta.properties.dtype)
            if dtype is None:
                raise InvalidInputError(
                    f"tensor {u.key!r} has dtype {meta.properties.dtype}",
                    where=str(self.ckpt),
                    hint="expected bfloat16, float16 or float32",
                )
            fake = torch.empty(u.chunk_shape, dtype=meta.properties.dtype, device="meta")
            for fqn, t in names.unpack(u, self.spec, fake).items():
                out.append(TensorInfo(fqn, tuple(t.shape), dtype))
        return sorted(out, key=lambda t: t.fqn)

    def _check_shapes(self, tensors: dict[str, Any]) -> None:
        want: dict[str, tuple[int, ...]] = {}
        for u in names.units(self.spec):
            want[u.key] = u.global_shape
        for key, shape in want.items():
            meta = tensors.get(key)
            got = None if meta is None else tuple(meta.size)
            if got != shape:
                raise InvalidInputError(
                    f"tensor {key!r}: expected global shape {list(shape)} for this "
                    f"{self.spec.model_type} config, got {list(got) if got else 'missing'}",
                    where=str(self.ckpt),
                    hint="the config.json does not describe this checkpoint",
                )
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise InvalidInputError(
                f"torch_dist tensors shardctl cannot map to HF: {extra[:3]}",
                where=str(self.ckpt),
                hint="only model weights of the GPT specs shardctl writes are supported",
            )

    def carried(self) -> list[Path]:
        skip = {layout.TRACKER, layout.SIDECAR}
        if self.root == self.ckpt:
            skip |= {layout.MCORE_METADATA, layout.COMMON}
        return [
            self.root / n
            for n in sorted(os.listdir(self.root))
            if n not in skip
            and not n.startswith(".")
            and not n.endswith(".distcp")
            and (self.root / n).is_file()
            and not (self.root / n).is_symlink()
        ]

    def iter_units(self) -> Any:
        """``(unit, {hf fqn: tensor})`` for every unit, reading one chunk set at a time."""
        for u in names.units(self.spec):
            yield u, names.unpack(u, self.spec, self.reader.read_box(u.key, u.index))


def _layers_held(tensors: dict[str, Any]) -> int | None:
    """How many decoder layers the checkpoint holds: the leading axis of a stacked
    ``decoder.layers.X``, or one more than the highest ``decoder.layers.{i}.``."""
    most = -1
    for key, meta in tensors.items():
        if not key.startswith("decoder.layers."):
            continue
        head = key.split(".")[2]
        if head.isdigit():
            most = max(most, int(head))
        elif meta.size:
            return int(meta.size[0])
    return most + 1 if most >= 0 else None


_INT_FIELDS = ("layers", "hidden", "heads", "groups", "head_dim", "ffn", "vocab", "padded_vocab")


def _from_sidecar(side: dict[str, Any], where: Path) -> tuple[MegatronSpec, list[TensorInfo]]:
    """The spec and HF tensor list a sidecar records, validated (hostile input: exit 3)."""
    try:
        fields = dict(side["spec"])
        for key in ("moe_layers", "hf_expert"):
            if isinstance(fields.get(key), list):
                fields[key] = tuple(fields[key])
        spec = MegatronSpec(**fields)
        extra = [spec.experts, spec.topk, spec.moe_ffn, spec.shared_ffn, spec.q_lora_rank]
        extra += [spec.kv_lora_rank, spec.qk_nope, spec.qk_rope, spec.v_head_dim, spec.mtp_layers]
        ints = [getattr(spec, f) for f in _INT_FIELDS] + list(extra)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints) or not all(
            ints[: len(_INT_FIELDS)]
        ):
            raise ValueError("dimensions must be positive integers")
        if any(not isinstance(i, int) or not 0 <= i < spec.layers for i in spec.moe_layers or ()):
            raise ValueError("moe_layers must be layer indices")
        if len(spec.hf_expert) != 3 or not all(isinstance(x, str) for x in spec.hf_expert):
            raise ValueError("hf_expert must be three names")
        if spec.heads % spec.groups or spec.experts > 2**16 or spec.mtp_layers > 64:
            raise ValueError("inconsistent heads/groups/experts")
        hf = [
            TensorInfo(str(f), tuple(int(x) for x in shape), str(d))
            for f, shape, d in side["tensors"]
        ]
        if any(t.dtype not in _NAMES.values() for t in hf):
            raise ValueError("unknown dtype")
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidInputError(
            f"sidecar is malformed ({type(exc).__name__}: {str(exc)[:80]})",
            where=str(where),
            hint="remove it to read the checkpoint from config.json",
        ) from None
    return spec, hf


def to_hf(src: Path, dst: Path, *, force: bool = False, max_shard_size: int = 5 * 10**9) -> Path:
    """Write the torch_dist checkpoint ``src`` as an HF checkpoint at ``dst``."""
    ck = MegatronCheckpoint(src)
    inputs = [ck.ckpt / n for n in os.listdir(ck.ckpt)]
    dst = check_output(src, dst, force=force, input_files=inputs)
    if ck.hf_files and max_shard_size == DEFAULT_MAX_SHARD_SIZE:
        files, index = original_split(ck)
    else:
        files, index = plan_files.hf_files(ck.hf, max_shard_size)
    preflight_space(dst.parent, sum(f.size for f in files) + 2**20)
    lock = OutputLock(dst)
    lock.acquire()
    staging: Path | None = None
    try:
        atomic.recover(dst)
        staging = atomic.make_staging(dst)
        write_hf_into(staging, ck, files, index)
        atomic.commit(staging, dst, replace=force)
        staging = None
    finally:
        atomic.discard(staging)
        lock.release()
    return dst


def original_split(ck: MegatronCheckpoint) -> tuple[list[plan_files.OutputFile], bytes | None]:
    """The HF files the source had (names, tensors per file, index bytes), from the sidecar."""
    where = str(ck.root / layout.SIDECAR)
    by_name = {t.fqn: t for t in ck.hf}
    files: list[plan_files.OutputFile] = []
    seen: list[str] = []
    for entry in ck.hf_files or []:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
        name = entry[0] if ok else ""
        if (
            not ok
            or Path(name).name != name
            or name.startswith(".")
            or not name.endswith(".safetensors")
        ):
            raise InvalidInputError(f"sidecar hf_files: bad entry {str(entry)[:80]}", where=where)
        fqns = [f for f in entry[1] if isinstance(f, str)]
        if len(fqns) != len(entry[1]) or any(f not in by_name for f in fqns):
            raise InvalidInputError(f"sidecar hf_files {name}: unknown tensors", where=where)
        planned, _ = plan_files.hf_files([by_name[f] for f in fqns], 2**62)
        if len(planned) != 1:
            raise InvalidInputError(f"sidecar hf_files {name}: too many tensors", where=where)
        files.append(replace(planned[0], name=name))
        seen += fqns
    if sorted(seen) != sorted(by_name) or len({f.name for f in files}) != len(files):
        raise InvalidInputError(
            "sidecar hf_files do not list every tensor exactly once", where=where
        )
    index = None if ck.hf_index is None else ck.hf_index.encode("utf-8")
    if index is not None:
        try:
            weight_map = json.loads(index).get("weight_map")
        except (ValueError, AttributeError):
            weight_map = None
        if weight_map != {t.fqn: f.name for f in files for t in f.tensors}:
            raise InvalidInputError("sidecar hf_index does not match its hf_files", where=where)
    return files, index


def write_hf_into(
    staging: Path, ck: MegatronCheckpoint, files: list[plan_files.OutputFile], index: bytes | None
) -> None:
    where: dict[str, tuple[int, int, int, str]] = {}  # fqn -> (file, begin, nbytes, dtype)
    for i, f in enumerate(files):
        for t in f.tensors:
            where[t.fqn] = (i, t.begin, t.nbytes, t.dtype)
    fds = []
    try:
        for f in files:
            fd = os.open(staging / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fds.append(fd)
            os.ftruncate(fd, f.size)
            os.pwrite(fd, f.header, 0)
        done: set[str] = set()
        for _, tensors in ck.iter_units():
            for fqn, t in tensors.items():
                if fqn not in where:
                    raise InvalidInputError(
                        f"sidecar does not list HF tensor {fqn!r}", where=str(ck.root)
                    )
                i, begin, n, dtype = where[fqn]
                if _NAMES.get(t.dtype) != dtype:
                    raise InvalidInputError(
                        f"tensor {fqn!r}: checkpoint dtype {t.dtype} differs from the sidecar's "
                        f"{dtype}",
                        where=str(ck.ckpt),
                    )
                raw = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
                if raw.nbytes != n:
                    raise InvalidInputError(
                        f"tensor {fqn!r}: {raw.nbytes} bytes, expected {n}", where=str(ck.ckpt)
                    )
                while raw.nbytes:  # no copy of the tensor's bytes
                    wrote = os.pwrite(fds[i], raw, begin)
                    raw, begin = raw[wrote:], begin + wrote
                done.add(fqn)
        missing = sorted(set(where) - done)
        if missing:
            raise InvalidInputError(
                f"sidecar lists HF tensors the checkpoint does not hold: {missing[:3]}",
                where=str(ck.root),
            )
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    if index is not None:
        atomic.write_file(staging / INDEX_NAME, index)
    for p in ck.carried():
        with open(p, "rb") as fh:
            atomic.write_file(staging / p.name, fh.read())
