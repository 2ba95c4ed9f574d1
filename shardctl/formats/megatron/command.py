"""``plan`` with ``workload.engine: megatron``: the exact ``shardctl reshard`` command that writes
the planned layout as a Megatron-Core torch_dist checkpoint (or why Megatron cannot load it).

Imports no torch (``plan`` never does)::

    shardctl reshard ./Llama-3-8B ./Llama-3-8B-megatron-tp4-pp2 --format megatron --tp 4 --pp 2
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from shardctl.errors import ShardctlError
from shardctl.formats.megatron.spec import load_flags, spec_from_config


def _config(model: Any) -> tuple[dict[str, Any] | None, Path | None]:
    """(config dict, HF checkpoint directory) of a manifest's ``model`` section."""
    ckpt = model.checkpoint if model.checkpoint is not None else None
    cfg_path = None
    if ckpt is not None:
        cfg_path = Path(ckpt) / "config.json"
    elif model.config is not None:
        cfg_path = Path(model.config)
        ckpt = cfg_path.parent if cfg_path.name == "config.json" else None
    if cfg_path is None:
        inline = model.config_dict()
        return (inline or None), None
    try:
        data = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None, ckpt
    return (data if isinstance(data, dict) else None), ckpt


def reshard_command(manifest: Any, mesh: Any) -> dict[str, Any]:
    """``{"engine": "megatron", "command": str | None, "refused": str | None, "load_flags":
    str | None}`` for the plan."""
    cfg, ckpt = _config(manifest.model)
    src = str(ckpt) if ckpt is not None else "HF_CHECKPOINT_DIR"
    name = Path(src).name if ckpt is not None else "model"
    axes = [("tp", mesh.tp), ("pp", mesh.pp), ("ep", mesh.ep)]
    suffix = "-".join(f"{a}{n}" for a, n in axes if n > 1)
    dst = f"{name}-megatron" + (f"-{suffix}" if suffix else "")
    flags = None
    if cfg is not None:
        try:
            spec = spec_from_config(cfg, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep)
        except ShardctlError as exc:
            return {"engine": "megatron", "command": None, "refused": exc.message}
        flags = load_flags(spec)
    parts = ["shardctl", "reshard", src, str(Path(src).parent / dst) if ckpt else dst]
    parts += ["--format", "megatron"]
    for a, n in axes:
        if n > 1:
            parts += [f"--{a}", str(n)]
    return {
        "engine": "megatron",
        "command": shlex.join(parts),
        "refused": None,
        "load_flags": flags,  # the Megatron-LM arguments that build the matching model
    }
