"""``plan`` with ``workload.engine: vllm``: the exact ``shardctl reshard`` command that writes
the planned layout as vLLM ``sharded_state`` (and the ``vllm serve`` flags that load it).

No torch here (``plan`` must not import it)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def reshard_command(manifest: Any, mesh: Any, model: Any = None) -> dict[str, Any]:
    """``{"engine": "vllm", "command": "shardctl reshard SRC SRC-vllm-tp4 --tp 4 --format vllm",
    "refused": None, "load_flags": "vllm serve DST --load-format sharded_state …"}``, or with
    ``command`` None and the reason in ``refused``.

    SRC is the manifest's ``model.checkpoint``, else the directory of its ``model.config``, else
    the placeholder ``HF_CHECKPOINT`` (an inline or counted model names no files)."""
    if mesh.pp > 1 or mesh.ep > 1:
        axis = "pp" if mesh.pp > 1 else "ep"
        why = (
            f"vLLM sharded_state holds tensor-parallel ranks only ({axis} "
            f"{getattr(mesh, axis)}); plan with pp 1 and ep 1, or use --format ranks"
        )
        return {"engine": "vllm", "command": None, "refused": why, "load_flags": None}
    if model is not None and model.tensors and model.dims is not None:
        # what ``--format vllm`` would refuse for this family / config / tp (one line)
        from shardctl.errors import ShardctlError
        from shardctl.formats.vllm.names import check_supported

        try:
            check_supported(model, mesh.tp)
        except ShardctlError as e:
            why = e.message
            return {"engine": "vllm", "command": None, "refused": why, "load_flags": None}
    spec = manifest.model
    src: Path | None = spec.checkpoint
    if src is None and spec.config is not None:
        src = Path(spec.config).parent
    src_text = str(src) if src is not None else "HF_CHECKPOINT"
    base = src.name if src is not None and src.name else "model"
    dst = (src.parent if src is not None else Path()) / f"{base}-vllm-tp{mesh.tp}"
    words = ["shardctl", "reshard", src_text, str(dst), "--tp", str(mesh.tp), "--format", "vllm"]
    return {
        "engine": "vllm",
        "command": " ".join(shlex.quote(w) for w in words),
        "refused": None,
        "load_flags": serve_hint(mesh),
    }


def serve_hint(mesh: Any) -> str:
    return f"vllm serve DST --load-format sharded_state --tensor-parallel-size {mesh.tp}"
