"""Write training state as HF safetensors: ``model.safetensors`` (+ ``optimizer.safetensors``).

``model.safetensors`` holds every ``model.<fqn>`` tensor under ``<fqn>``, in the order and with
the header ``safetensors.torch.save_file`` (and so transformers' ``save_pretrained``) writes:
dtypes widest first, then names in byte order; ``__metadata__`` ``{"format": "pt"}`` — so HF ->
DCP -> HF gives back the same bytes. A tied ``lm_head.weight`` (config
``tie_word_embeddings``) is left out as transformers leaves it out.

The sidecar ``optimizer.safetensors`` holds every other tensor under its full DCP key
(``optimizer.state.<fqn>.exp_avg``, ``optimizer.state.<fqn>.step``, ...), and every
non-tensor item (``optimizer.param_groups.0.lr``, ...) as JSON in its ``__metadata__``
(``shardctl.dcp.objects``; tuples tagged ``{"__tuple__": [...]}``), with
``format: shardctl.dcp-sidecar/1``. transformers ignores it; shardctl reads it back into DCP.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardctl.checkpoint.record import FileDigest
from shardctl.errors import InvalidInputError
from shardctl.formats.dcp.sink import HashedFile
from shardctl.formats.dcp.state import (
    MODEL_PREFIX,
    OBJECTS_KEY,
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    Item,
    TrainingState,
    encode_objects,
)
from shardctl.io.safetensors_header import HeaderEntry, header_bytes

# safetensors' Dtype enum order; save_file puts wider (later) dtypes first
_DTYPE_ORDER = "BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64".split()


def st_name(dtype: Any) -> str:
    from shardctl.dtypes import TORCH_NAMES

    torch_name = str(dtype).removeprefix("torch.")
    for st, tn in TORCH_NAMES.items():
        if tn == torch_name:
            return st
    raise InvalidInputError(f"dtype {torch_name} cannot be stored in safetensors")


# input embedding names whose table a tied ``lm_head.weight`` shares (Llama-likes, GPT-2)
EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight")


def tied_lm_head(root: Path, carried: tuple[str, ...]) -> bool:
    """config.json (carried) says ``tie_word_embeddings``: transformers saves no lm_head."""
    if "config.json" not in carried:
        return False
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def write_safetensors(
    state: TrainingState,
    path: Path,
    named: list[tuple[str, Item]],
    metadata: dict[str, str],
    hash_name: str,
    tick: Callable[[int], None],
) -> FileDigest:
    """``named``: (name in the file, item); written in save_file's order, one at a time."""
    named = sorted(named, key=lambda p: (-_DTYPE_ORDER.index(st_name(p[1].dtype)), p[0]))
    entries, cursor = [], 0
    for name, item in named:
        assert item.shape is not None and item.dtype is not None
        n = _nbytes(item)
        entries.append(HeaderEntry(name, st_name(item.dtype), item.shape, cursor, cursor + n))
        cursor += n
    import torch

    f = HashedFile(path, hash_name)
    try:
        f.write(header_bytes(entries, metadata))
        for _, item in named:
            t = state.tensor(item.key).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            tick(_nbytes(item))
            del t
        return f.close()
    except BaseException:
        f.abort()
        raise


def _nbytes(item: Item) -> int:
    import math

    assert item.shape is not None
    return math.prod(item.shape) * item.dtype.itemsize


def write_hf(
    state: TrainingState,
    out: Path,
    *,
    optimizer: bool,
    hash_name: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[FileDigest], int]:
    model = [i for i in state.items if i.is_model]
    objects = [i for i in model if i.shape is None]
    if objects:
        raise InvalidInputError(
            f"model entry {objects[0].key!r} is not a tensor; HF weights hold tensors only",
            where=str(state.root),
        )
    named = [(i.key[len(MODEL_PREFIX) :], i) for i in model]
    if tied_lm_head(state.root, state.carried) and any(n in EMBEDDINGS for n, _ in named):
        named = [(n, i) for n, i in named if n != "lm_head.weight"]
    rest = [i for i in state.items if not i.is_model] if optimizer else []
    total = sum(_nbytes(i) for _, i in named) + sum(_nbytes(i) for i in rest if i.shape)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    digests = [
        write_safetensors(
            state, out / "model.safetensors", named, {"format": "pt"}, hash_name, tick
        )
    ]
    if rest:
        objs = {i.key: state.obj(i.key) for i in rest if i.shape is None}
        meta = {
            "format": SIDECAR_FORMAT,
            OBJECTS_KEY: encode_objects(objs, str(out / SIDECAR_NAME)),
        }
        tensors = [(i.key, i) for i in rest if i.shape is not None]
        digests.append(write_safetensors(state, out / SIDECAR_NAME, tensors, meta, hash_name, tick))
    return digests, done
