"""A manifest from a config or checkpoint plus command-line flags, as
``accelerate estimate-memory`` users expect::

    shardctl plan ./Llama-3-8B --tp 8 --gpu h100-sxm --batch 32 --seq 8192

The flags become manifest YAML (:func:`manifest_yaml`), which is then validated like any
manifest: one path, one set of checks, and ``--emit-manifest`` writes exactly that text, so
planning the written file gives the identical plan. The manifest stays the CI path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardctl.errors import OutputConflictError, UsageError
from shardctl.manifest.load import parse_manifest
from shardctl.manifest.model import Manifest


@dataclass(frozen=True)
class PlanFlags:
    """What the flags say; ``None`` = not given (the manifest's default applies)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    gpu: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    batch: int | None = None
    seq: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    only_weights: bool = False

    def model_flags(self) -> list[str]:
        """The flags that only make sense without a manifest (for the usage error)."""
        named = {
            "--gpu": self.gpu,
            "--nodes": self.nodes,
            "--gpus-per-node": self.gpus_per_node,
            "--batch": self.batch,
            "--seq": self.seq,
            "--dtype": self.dtype,
            "--quantization": self.quantization,
        }
        return [flag for flag, value in named.items() if value is not None]


def source_kind(source: Path) -> str:
    """``checkpoint`` (a directory), ``config`` (a ``.json`` file) or ``manifest``."""
    if source.is_dir():
        return "checkpoint"
    if source.suffix.lower() == ".json":
        return "config"
    return "manifest"


def _quoted(text: str | None) -> str | None:
    """A flag's text as a double-quoted YAML scalar: data, never YAML syntax."""
    return None if text is None else json.dumps(text)


def _flow(items: Mapping[str, object]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in items.items() if v is not None) + "}"


def manifest_yaml(source: Path, flags: PlanFlags) -> str:
    """The manifest the flags imply for ``source`` (a checkpoint directory or a config.json).

    ``hardware.nodes`` is derived when not given: enough nodes of ``gpus_per_node`` (8) for
    the mesh.
    """
    kind = source_kind(source)
    if kind == "manifest":
        raise UsageError(f"{source} is a manifest, not a config.json or checkpoint directory")
    path = json.dumps(str(source.resolve()))  # a double-quoted YAML scalar
    model: dict[str, object] = {kind: path, "dtype": _quoted(flags.dtype)}
    mesh = {"pp": flags.pp, "dp": flags.dp, "ep": flags.ep, "tp": flags.tp}
    world = 1
    for degree in mesh.values():
        world *= degree or 1
    per_node = flags.gpus_per_node or 8
    hardware = {
        "gpu": _quoted(flags.gpu),
        "gpus_per_node": per_node,
        "nodes": flags.nodes or -(-world // per_node),
    }
    lines = [
        f"# shardctl plan {source} with flags: the manifest they imply",
        f"model: {_flow(model)}",
        f"mesh: {_flow(mesh)}",
        f"hardware: {_flow(hardware)}",
    ]
    workload = {
        "mode": "weights-only" if flags.only_weights else None,
        "batch_size": flags.batch,
        "sequence_length": flags.seq,
    }
    if any(v is not None for v in workload.values()):
        lines.append(f"workload: {_flow(workload)}")
    if flags.quantization is not None:
        lines.append(f"quantization: {{method: {_quoted(flags.quantization)}}}")
    return "\n".join(lines) + "\n"


def manifest_from_flags(source: Path, flags: PlanFlags) -> tuple[Manifest, str]:
    """The validated manifest of :func:`manifest_yaml`, and its text for :func:`emit`."""
    text = manifest_yaml(source, flags)
    return parse_manifest(text, base_dir=Path.cwd(), source=f"{source} with flags"), text


def emit(path: Path, text: str) -> None:
    """Write the implied manifest (``--emit-manifest``); never over an existing file (exit 4)."""
    from shardctl.io.atomic import write_file

    try:
        write_file(path, text.encode())
    except FileExistsError:
        raise OutputConflictError(
            "already exists", where=str(path), hint="remove it or choose another path"
        ) from None
