"""``reshard`` for DCP training checkpoints: DCP -> DCP (new FSDP world size), DCP -> HF
(+ optimizer sidecar), HF (+ sidecar) -> DCP. Atomic like every shardctl output: a staging
sibling under the output lock, fsynced, renamed into place last.

::

    reshard_dcp(Path("ckpt-200"), Path("ckpt-dp4"), fmt="dcp", mesh=Mesh(dp=4))  # 2 -> 4 ranks
    reshard_dcp(Path("ckpt-200"), Path("hf"), fmt="hf")        # + optimizer.safetensors sidecar
    reshard_dcp(Path("hf"), Path("ckpt-dp3"), fmt="dcp", mesh=Mesh(dp=3))        # and back
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from shardctl.errors import Interrupted, InvalidInputError, UsageError
from shardctl.formats.dcp.state import DcpState, TrainingState, open_state
from shardctl.formats.dcp.write_dcp import write_dcp
from shardctl.formats.dcp.write_hf import write_hf
from shardctl.formats.dcp.zero import ZeroState, listing
from shardctl.io import atomic
from shardctl.io.checksum import default_hash
from shardctl.io.lock import OutputLock
from shardctl.layout.types import Mesh
from shardctl.reshard.result import ReshardResult, peak_rss_bytes
from shardctl.reshard.safety import check_output, os_failure, preflight_space
from shardctl.reshard.signals import interrupts_raise

FORMATS = ("dcp", "hf")


def reshard_dcp(
    src: Path,
    dst: Path,
    *,
    fmt: str | None,
    mesh: Mesh | None = None,
    optimizer: bool = True,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReshardResult:
    """Convert ``src`` (a DCP dir, or HF with an optional sidecar) to ``fmt`` under ``dst``.

    ``mesh``: only ``dp`` may exceed 1 (the FSDP world size of a ``dcp`` output; default: the
    source's number of data files, 1 for HF). ``optimizer=False``: weights only.
    """
    t0 = time.monotonic()
    world = _world(fmt, mesh)
    dst = check_output(src, dst, force=force)
    state = open_state(src, optimizer=optimizer)
    try:
        fmt = fmt or ("dcp" if state.kind == "hf" else "hf")
        if fmt not in FORMATS:
            raise UsageError(
                f"--format {fmt}: a DCP checkpoint converts to dcp or hf",
                hint="convert to hf first, then reshard that to ranks",
            )
        if fmt == "hf" and state.kind == "hf":
            raise UsageError("the input is HF already; pass --format dcp to write DCP")
        if fmt == "hf" and "config.json" not in state.carried:
            raise InvalidInputError(
                "no config.json in the DCP checkpoint directory; HF output needs one",
                where=str(src),
                hint="copy the model's config.json into it (it travels to the output)",
            )
        if fmt == "dcp" and world is None:
            world = (
                len(state.md.files)
                if isinstance(state, DcpState)
                else state.world
                if isinstance(state, ZeroState)
                else 1
            )
        before = _stats(state, src)
        input_bytes = sum(size for size, _ in before.values())
        preflight_space(dst.parent, input_bytes)
        with interrupts_raise(), OutputLock(dst):
            atomic.recover(dst)
            staging = atomic.make_staging(dst)
            try:
                hash_name = default_hash()
                if fmt == "dcp":
                    assert world is not None
                    items = [i for i in state.items if optimizer or i.is_model]
                    planner = state.md.planner_data if isinstance(state, DcpState) else None
                    digests, tensor_bytes = write_dcp(
                        state,
                        staging,
                        world=world,
                        items=items,
                        hash_name=hash_name,
                        planner_data=planner,
                        progress=progress,
                    )
                else:
                    digests, tensor_bytes = write_hf(
                        state,
                        staging,
                        optimizer=optimizer,
                        hash_name=hash_name,
                        progress=progress,
                    )
                carried = _carry(state, staging)
                _check_unchanged(before, _stats(state, src), src)
                atomic.commit(staging, dst, replace=force)
            except (Interrupted, KeyboardInterrupt):
                raise
            except OSError as exc:
                raise os_failure(exc) from None
            finally:
                atomic.discard(staging)
    finally:
        state.close()
    total = sum(d.size for d in digests) + sum((dst / n).stat().st_size for n in carried)
    return ReshardResult(
        dst=dst,
        format=fmt,
        mesh=None if fmt == "hf" else Mesh(dp=world or 1),
        source_kind=state.kind,
        files=tuple(digests),
        tensor_bytes=tensor_bytes,
        total_bytes=total,
        seconds=time.monotonic() - t0,
        hash=hash_name,
        carried=tuple(carried),
        workers=1,
        src=src,
        peak_rss_bytes=peak_rss_bytes(),
    )


def _world(fmt: str | None, mesh: Mesh | None) -> int | None:
    if mesh is None:
        return None
    others = {a: d for a, d in mesh.as_dict().items() if a != "dp" and d != 1}
    if others:
        axis, degree = next(iter(others.items()))
        raise UsageError(
            f"--{axis} {degree}: DCP checkpoints are laid out for an FSDP mesh (dp) only",
            hint="pass --dp N for the FSDP world size; tensor/pipeline/expert parallel "
            "loaders reshard a DCP checkpoint at load time",
        )
    if fmt == "hf" and mesh.dp != 1:
        raise UsageError(f"--dp {mesh.dp}: an HF output holds whole tensors; drop --dp")
    return mesh.dp


def _input_files(state: TrainingState) -> list[str]:
    if isinstance(state, DcpState):
        return [".metadata", *state.md.files]
    if isinstance(state, ZeroState):
        tag = state.tag.relative_to(state.root)
        return [str(tag / n) for n in listing(state.tag) if n.endswith(".pt")]
    names = [p.name for p in state.root.iterdir() if p.name.endswith(".safetensors")]
    return names


def _carry(state: TrainingState, staging: Path) -> list[str]:
    names = []
    for name in state.carried:
        with open(state.root / name, "rb") as f:
            atomic.write_file(staging / name, f.read())
        names.append(name)
    return names


def _stats(state: TrainingState, src: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for name in _input_files(state):
        try:
            st = (src / name).stat()
        except FileNotFoundError:
            out[name] = (-1, -1)
            continue
        out[name] = (st.st_size, st.st_mtime_ns)
    return out


def _check_unchanged(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], src: Path
) -> None:
    """Data files are read by offset: a rewrite during the run would mix two checkpoints."""
    from shardctl.errors import EnvironmentFailure

    for name, was in before.items():
        if after.get(name) != was:
            raise EnvironmentFailure(
                "input changed during run", where=str(src / name), hint="rerun once it is stable"
            )
