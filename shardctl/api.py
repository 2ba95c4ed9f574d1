"""The public Python API: ``from shardctl import plan, search, reshard, verify, inspect, Mesh``.

Each function is what one ``shardctl`` command calls; the CLI only parses options and renders.
Every result is a typed object with ``to_json()`` (the command's ``--json`` document). Errors
are :class:`shardctl.ShardctlError` subclasses whose ``exit_code`` is the command's.

::

    from shardctl import Mesh, inspect, plan, reshard, verify

    p = plan("manifests/llama-3-8b-tp1.yaml", mesh={"tp": 2})  # per-rank memory, no torch
    p.fits, [r.total for r in p.ranks]
    out = reshard("Llama-3-8B", "llama-tp2", mesh=Mesh(tp=2))  # HF -> 2 rank files
    verify("Llama-3-8B", "llama-tp2", level="bitwise").ok      # True
    inspect("llama-tp2").mesh                                  # {"pp": 1, "dp": 1, ...}

Heavy modules (torch, the engines) load inside the function that needs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from shardctl.errors import UsageError
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec

if TYPE_CHECKING:
    from shardctl.checkpoint.summary import InspectResult
    from shardctl.manifest import Manifest
    from shardctl.plan.api import PlanResult
    from shardctl.plan.search import SearchResult
    from shardctl.reshard.result import ReshardResult
    from shardctl.verify.result import VerifyResult

PathLike: TypeAlias = "str | os.PathLike[str]"
ManifestLike: TypeAlias = "str | os.PathLike[str] | Manifest"  # a YAML path or a loaded one
MeshLike: TypeAlias = "Mesh | Mapping[str, int]"  # every axis, or some axes to override

AXES = ("pp", "dp", "ep", "tp")


def _overrides(mesh: MeshLike | None) -> dict[str, int]:
    """A Mesh (every axis) or a mapping of some axes -> the axes it sets."""
    if mesh is None:
        return {}
    axes = mesh.as_dict() if isinstance(mesh, Mesh) else dict(mesh)
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise UsageError(f"mesh: unknown axis {unknown[0]!r}", hint=f"use {', '.join(AXES)}")
    for axis, degree in axes.items():
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise UsageError(f"mesh.{axis}: expected a whole number >= 1, got {degree!r}")
    return axes


def _manifest(manifest: ManifestLike) -> Manifest:
    from shardctl.manifest import Manifest, load_manifest

    return manifest if isinstance(manifest, Manifest) else load_manifest(Path(manifest))


def plan(
    manifest: ManifestLike, *, mesh: MeshLike | None = None, only_weights: bool = False
) -> PlanResult:
    """Per-rank memory of the manifest's layout; never imports torch.

    ``manifest``: a YAML path or a loaded :class:`shardctl.manifest.Manifest`. ``mesh``: a
    :class:`Mesh` replaces the manifest's mesh; a mapping (``{"tp": 4}``) overrides those axes.
    ``only_weights``: no KV cache, no activations, on purpose (the result says so).
    The result's ``fits`` is the verdict the CLI's exit code uses (False -> exit 1).
    """
    from shardctl.plan.api import plan_manifest

    return plan_manifest(
        _manifest(manifest), mesh_overrides=_overrides(mesh), only_weights=only_weights
    )


def search(
    manifest: ManifestLike, *, gpus: int | None = None, only_weights: bool = False
) -> SearchResult:
    """Every layout of ``gpus`` devices (default: the manifest's hardware) that fits, best first.

    ``result.has_fit`` is False when none fits (the CLI exits 1).
    """
    from shardctl.plan.api import search_manifest

    if gpus is not None and gpus < 1:
        raise UsageError(f"gpus: expected a whole number >= 1, got {gpus}")
    return search_manifest(_manifest(manifest), gpus=gpus, only_weights=only_weights)


def reshard(
    src: PathLike,
    dst: PathLike,
    *,
    mesh: MeshLike | None = None,
    manifest: ManifestLike | None = None,
    format: str | None = None,
    max_shard_size: int | str = "5GB",
    workers: int | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    follow_external_symlinks: bool = False,
    verify_input: bool = True,
    resume: bool = True,
    progress: Callable[[int, int], None] | None = None,
    optimizer: bool = True,
) -> ReshardResult:
    """Split, merge or convert the checkpoint ``src`` into ``dst``: streaming, atomic.

    ``mesh``: the target layout (``Mesh(tp=4)``); with ``manifest`` (which supplies mesh,
    ``rules:`` and layout options) a mapping overrides some of its axes. No mesh, or one rank:
    whole tensors (``format="hf"``); otherwise per-rank files (``format="ranks"``).
    ``max_shard_size``: bytes, or a string like ``"5GB"`` / ``"500MiB"``. ``progress(done,
    total)`` is called with bytes as the copy advances. ``dst`` must not exist unless ``force``.
    ``format="dcp"`` or a DCP input (a dir with ``.metadata``): a training checkpoint with
    optimizer state, ``mesh={"dp": N}`` its FSDP world size; ``optimizer=False`` drops the
    optimizer state (:mod:`shardctl.formats.dcp`).
    """
    from shardctl.reshard.api import reshard as run_reshard
    from shardctl.units import parse_size

    if format is not None and format not in ("ranks", "hf", "dcp", "megatron", "vllm"):
        raise UsageError(f"--format: expected ranks, hf, dcp, megatron or vllm, got {format!r}")
    # (megatron first: a torch_dist directory is a DCP directory too)
    from shardctl.formats.megatron.layout import is_megatron

    megatron = format == "megatron" or is_megatron(Path(src))
    # --- dcp-optim: DCP training checkpoints (formats/dcp) ---
    from shardctl.formats.dcp.metadata import is_dcp
    from shardctl.formats.dcp.zero import is_zero

    if not megatron and (format == "dcp" or is_dcp(Path(src)) or is_zero(Path(src))):
        from shardctl.formats.dcp.convert import reshard_dcp

        if manifest is not None:
            raise UsageError("--manifest does not apply to DCP checkpoints; pass --dp N")
        axes = _overrides(mesh)
        return reshard_dcp(
            Path(src),
            Path(dst),
            fmt=format,
            mesh=Mesh(**axes) if axes else None,
            optimizer=optimizer,
            force=force,
            progress=progress,
        )
    # --- end dcp-optim ---
    size = (
        parse_size(max_shard_size, option="--max-shard-size")
        if isinstance(max_shard_size, str)
        else max_shard_size
    )
    target, rules, options = _reshard_target(mesh, manifest)
    # -- engine formats (issue 16): Megatron-Core torch_dist out (--format megatron) and in --
    if megatron:
        from shardctl.formats.megatron.api import reshard as megatron_reshard

        def forward(s: Path, d: Path, m: Mesh | None, f: str | None) -> ReshardResult:
            axes = None if m is None else {"tp": m.tp, "pp": m.pp, "ep": m.ep}
            return reshard(
                s,
                d,
                mesh=axes,
                manifest=manifest,
                format=f,
                max_shard_size=size,
                workers=workers,
                force=force,
            )

        return megatron_reshard(
            Path(src),
            Path(dst),
            fmt=format,
            mesh=target,
            max_shard_size=size,
            force=force,
            forward=forward,
        )
    # -- end engine formats: megatron --
    return run_reshard(
        Path(src),
        Path(dst),
        mesh=target,
        rules=rules,
        options=options,
        fmt=format,
        max_shard_size=size,
        workers=workers,
        force=force,
        allow_pickle=allow_pickle,
        follow_external_symlinks=follow_external_symlinks,
        progress=progress,
        verify_input=verify_input,
        resume=resume,
    )


def _reshard_target(
    mesh: MeshLike | None, manifest: ManifestLike | None
) -> tuple[Mesh | None, tuple[RuleSpec, ...], LayoutOptions]:
    axes = _overrides(mesh)
    if manifest is not None:
        m = _manifest(manifest)
        # a checkpoint holds one model replica: the manifest's dp does not multiply files
        return replace(m.mesh, **{"dp": 1, **axes}), m.rules, m.layout
    if not axes:
        return None, (), LayoutOptions()
    return Mesh(**axes), (), LayoutOptions()


def verify(
    src: PathLike,
    dst: PathLike,
    *,
    level: str = "forward",
    device: str = "auto",
    launcher: str = "local",
    seed: int = 0,
) -> VerifyResult:
    """Is ``dst`` the same model as ``src``? Levels are cumulative and stop at the first failure.

    ``level``: ``structure`` (headers, coverage), ``bitwise`` (every shard equals its region of
    SRC), ``forward`` (the sharded model's logits on torch.distributed match SRC's). ``result.ok``
    is the verdict (False -> exit 1); ``result.failed_level.findings`` name tensor, rank, file.
    """
    from shardctl.formats.megatron.api import as_hf  # engine formats (issue 16): megatron
    from shardctl.verify.api import verify as run_verify

    with as_hf(Path(src)) as src_path, as_hf(Path(dst)) as dst_path:
        result = run_verify(
            src_path, dst_path, level=level, device=device, launcher=launcher, seed=seed
        )
    return replace(result, src=str(src), dst=str(dst))


def inspect(path: PathLike) -> InspectResult:
    """A checkpoint directory, a ``*.safetensors`` file or a ``config.json`` at a glance.

    Reads headers and the layout record only, never tensor data.
    """
    from shardctl.checkpoint.summary import inspect_path

    return inspect_path(Path(path))


__all__ = ["Mesh", "inspect", "plan", "reshard", "search", "verify"]
