"""``shardctl reshard``: options → one :func:`shardctl.reshard.api.reshard` call → summary."""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from shardctl.errors import UsageError
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.units import parse_size


def reshard(
    src: Annotated[Path, typer.Argument(help="Input: an HF checkpoint dir or a shardctl layout.")],
    dst: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).")],
    tp: Annotated[int | None, typer.Option(help="Target tensor-parallel degree.", min=1)] = None,
    pp: Annotated[int | None, typer.Option(help="Target pipeline-parallel degree.", min=1)] = None,
    ep: Annotated[int | None, typer.Option(help="Target expert-parallel degree.", min=1)] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="Take mesh, rules and layout options from this manifest (flags override its mesh)."
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="ranks (per-rank files) or hf (whole tensors). Default: "
            "ranks when the target has more than one rank, else hf.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option(help="Split output files above this size (5GB = 5·10⁹ B, 5GiB = 2³⁰).")
    ] = "5GB",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Writer threads (each output file has one); default: usable cores, at most 4.",
            min=1,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing DST atomically.")
    ] = False,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle",
            help="Accept .bin/.pt input, loaded only with torch.load(weights_only=True).",
        ),
    ] = False,
    follow_external_symlinks: Annotated[
        bool,
        typer.Option(
            "--follow-external-symlinks", help="Accept shard symlinks that point outside SRC."
        ),
    ] = False,
    no_verify_input: Annotated[
        bool,
        typer.Option(
            "--no-verify-input",
            help="Skip hashing inputs whose digests are known (layout record, HF-cache blob).",
        ),
    ] = False,
    no_resume: Annotated[
        bool,
        typer.Option(
            "--no-resume",
            help="Start clean: do not reuse the finished files of an identical killed run.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress, no summary.")] = False,
) -> None:
    """Split, merge or convert a checkpoint: streaming, constant memory, atomic.

    Examples:
    [bold]shardctl reshard ./Llama-3-8B ./llama-tp4 --tp 4[/bold] (HF → per-rank shards);
    [bold]shardctl reshard ./llama-tp4 ./llama-tp2 --tp 2[/bold] (any-to-any);
    [bold]shardctl reshard ./llama-tp4 ./merged --format hf[/bold] (back to HF).
    """

    run_reshard(
        src,
        dst,
        tp=tp,
        pp=pp,
        ep=ep,
        manifest=manifest,
        fmt=fmt,
        max_shard_size=max_shard_size,
        workers=workers,
        force=force,
        allow_pickle=allow_pickle,
        follow_external_symlinks=follow_external_symlinks,
        verify_input=not no_verify_input,
        resume=not no_resume,
        as_json=as_json,
        quiet=quiet,
    )


def _target(
    tp: int | None, pp: int | None, ep: int | None, manifest: Path | None
) -> tuple[Mesh | None, tuple[RuleSpec, ...], LayoutOptions]:
    flags = {k: v for k, v in {"tp": tp, "pp": pp, "ep": ep}.items() if v is not None}
    if manifest is not None:
        from shardctl.manifest import load_manifest

        m = load_manifest(manifest)
        return replace(m.mesh, dp=1, **flags), m.rules, m.layout
    if not flags:
        return None, (), LayoutOptions()
    return Mesh(**flags), (), LayoutOptions()


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(
        *progress_columns(),
        transient=True,
        console=_stderr_console(),
    ) as bar:
        task = bar.add_task("resharding", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def progress_columns() -> tuple[Any, ...]:
    """The bar's columns, counting in binary units (MiB, GiB) as the summary line does."""
    from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.text import Text

    from shardctl.plan.render import fmt_bytes

    class BinarySpeedColumn(TransferSpeedColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            shown = "?" if speed is None else f"{fmt_bytes(int(speed))}/s"
            return Text(shown, style="progress.data.speed")

    return (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        BinarySpeedColumn(),
        TimeRemainingColumn(),
    )


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def run_reshard(
    src: Path,
    dst: Path,
    *,
    tp: int | None,
    pp: int | None,
    ep: int | None,
    manifest: Path | None,
    fmt: str | None,
    max_shard_size: str,
    workers: int | None,
    force: bool,
    allow_pickle: bool,
    follow_external_symlinks: bool,
    as_json: bool,
    verify_input: bool = True,
    resume: bool = True,
    quiet: bool,
) -> None:
    from shardctl.reshard.api import reshard

    if fmt is not None and fmt not in ("ranks", "hf"):
        raise UsageError(f"--format: expected ranks or hf, got {fmt!r}")
    mesh, rules, options = _target(tp, pp, ep, manifest)
    size = parse_size(max_shard_size, option="--max-shard-size")
    show = not quiet and not as_json and sys.stderr.isatty()
    with _progress(show) as progress:
        result = reshard(
            src,
            dst,
            mesh=mesh,
            rules=rules,
            options=options,
            fmt=fmt,
            max_shard_size=size,
            workers=workers,
            force=force,
            allow_pickle=allow_pickle,
            follow_external_symlinks=follow_external_symlinks,
            progress=progress,
            verify_input=verify_input,
            resume=resume,
        )
    peak = peak_rss_bytes()
    reused = sum(f.size for f in result.files if f.name in result.resumed)
    written = max(0, result.tensor_bytes - reused)  # a resumed run's rate: what it wrote
    rate = written / result.seconds if result.seconds > 0 else 0.0
    if as_json:
        doc = {
            "schema": "shardctl.reshard/1",
            "src": str(src),
            "dst": str(result.dst),
            "format": result.format,
            "mesh": None if result.mesh is None else result.mesh.as_dict(),
            "source_kind": result.source_kind,
            "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in result.files],
            "hash": result.hash,
            "carried": list(result.carried),
            "tensor_bytes": result.tensor_bytes,
            "total_bytes": result.total_bytes,
            "seconds": round(result.seconds, 4),
            "bytes_per_second": round(rate),
            "peak_rss_bytes": peak,
            "workers": result.workers,
            "resumed": list(result.resumed),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    if quiet:
        return
    from rich.console import Console

    from shardctl.plan.render import fmt_bytes

    mesh_text = "" if result.mesh is None else f" mesh {result.mesh}"
    Console().print(
        f"[green]wrote[/green] {result.dst} ({result.format}{mesh_text}): "
        f"{len(result.files)} files, {fmt_bytes(result.total_bytes)} in {result.seconds:.2f} s "
        f"({fmt_bytes(rate)}/s), peak memory {fmt_bytes(peak)}"
        + (f", carried {', '.join(result.carried)}" if result.carried else "")
        + (
            f"; resumed a killed run: reused {len(result.resumed)} finished "
            f"file{'s' if len(result.resumed) != 1 else ''} ({fmt_bytes(reused)})"
            if result.resumed
            else ""
        )
    )
