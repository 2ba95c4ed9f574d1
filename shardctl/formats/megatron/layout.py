"""The Megatron-LM checkpoint directory and shardctl's sidecar in it.

::

    DST/
      latest_checkpointed_iteration.txt     "release" (Megatron asserts iteration > 0 or release)
      release/                              the torch_dist checkpoint (mcore dist_checkpointing)
        metadata.json                       {"sharded_backend": "torch_dist", ...}
        common.pt                           non-sharded state (mcore's loader requires the file)
        .metadata  __0_0.distcp             torch DCP
      shardctl.megatron.json                the HF tensors (order, shapes, dtypes) and the spec
      config.json, tokenizer files ...      carried from the HF source (Megatron ignores them)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
SIDECAR = "shardctl.megatron.json"
MCORE_METADATA = "metadata.json"
COMMON = "common.pt"
SIDECAR_SCHEMA = "shardctl.megatron/1"
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def is_megatron(path: Path) -> bool:
    """A Megatron torch_dist checkpoint: a save root (tracker file) or an iteration directory."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / TRACKER).is_file():
        return True
    return (p / MCORE_METADATA).is_file() and (p / ".metadata").is_file()


def locate(path: Path) -> tuple[Path, Path]:
    """``(root, ckpt)``: the save root (carried files, sidecar) and the torch_dist directory."""
    p = Path(path)
    if (p / TRACKER).is_file():
        text = (p / TRACKER).read_text(errors="replace").strip()
        if text == RELEASE:
            sub = RELEASE
        elif text.isdigit() and int(text) > 0:
            sub = f"iter_{int(text):07d}"
        else:
            raise InvalidInputError(
                f"{TRACKER}: expected 'release' or an iteration > 0, got {text[:40]!r}",
                where=str(p / TRACKER),
            )
        ckpt = p / sub
        if not (ckpt / MCORE_METADATA).is_file():
            raise InvalidInputError(
                f"{TRACKER} names {sub!r} but {sub}/{MCORE_METADATA} is missing",
                where=str(ckpt),
                hint="the checkpoint is incomplete",
            )
        return p, ckpt
    return (p.parent if (p.parent / SIDECAR).is_file() else p), p


def check_backend(ckpt: Path) -> None:
    try:
        meta = json.loads((ckpt / MCORE_METADATA).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(
            f"unreadable {MCORE_METADATA} ({type(exc).__name__})", where=str(ckpt)
        ) from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise InvalidInputError(
            f"{MCORE_METADATA}: sharded_backend {backend!r} is not supported (expected "
            "'torch_dist')",
            where=str(ckpt / MCORE_METADATA),
            hint="re-save with --ckpt-format torch_dist",
        )


def read_sidecar(root: Path) -> dict[str, Any] | None:
    path = root / SIDECAR
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(
            f"unreadable sidecar ({type(exc).__name__})", where=str(path)
        ) from None
    if not isinstance(data, dict) or data.get("schema") != SIDECAR_SCHEMA:
        raise InvalidInputError(
            f"sidecar schema: expected {SIDECAR_SCHEMA!r}, got "
            f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}",
            where=str(path),
        )
    return data


def read_config(root: Path, ckpt: Path) -> dict[str, Any]:
    for d in (root, ckpt):
        path = d / "config.json"
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidInputError(
                    f"unreadable config.json ({type(exc).__name__})", where=str(path)
                ) from None
            if isinstance(cfg, dict):
                return cfg
    raise InvalidInputError(
        "torch_dist checkpoint without the model's HF config.json",
        where=str(root),
        hint="copy the model's config.json into the checkpoint directory",
    )
