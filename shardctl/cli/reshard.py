"""``shardctl reshard``: options → one :func:`shardctl.api.reshard` call → summary."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from shardctl.cli._common import MAX_AXIS, MAX_WORKERS, MaxHeaderBytes, emit_json, header_limit
from shardctl.console import console_for_output
from shardctl.units import fmt_bytes

if TYPE_CHECKING:
    from shardctl.reshard.result import ReshardResult


Src = Annotated[
    Path,
    typer.Argument(
        help="Input: an HF checkpoint dir, a shardctl layout, a training checkpoint "
        "(torch DCP dir with .metadata, DeepSpeed ZeRO-1/2 dir) or a Megatron torch_dist "
        "checkpoint."
    ),
]
Dst = Annotated[Path, typer.Argument(help="Output directory (must not exist unless --force).")]
Tp = Annotated[int | None, typer.Option(help="Target tensor-parallel degree.", min=1, max=MAX_AXIS)]
Pp = Annotated[
    int | None, typer.Option(help="Target pipeline-parallel degree.", min=1, max=MAX_AXIS)
]
Ep = Annotated[int | None, typer.Option(help="Target expert-parallel degree.", min=1, max=MAX_AXIS)]
Dp = Annotated[
    int | None,
    typer.Option(help="FSDP world size of a --format dcp output.", min=1, max=MAX_AXIS),
]
NoOptimizer = Annotated[
    bool,
    typer.Option(
        "--no-optimizer",
        help="DCP training checkpoints: convert the weights only (no optimizer state, no "
        "optimizer.safetensors sidecar).",
    ),
]
ManifestOpt = Annotated[
    Path | None,
    typer.Option(
        help="Take mesh, rules and layout options from this manifest (flags override its mesh)."
    ),
]
Format = Annotated[
    str | None,
    typer.Option(
        "--format",
        help="ranks (per-rank files), hf (whole tensors), dcp (torch DCP training "
        "checkpoint, with optimizer state) or vllm (vLLM sharded_state, --load-format "
        "sharded_state). Default: ranks when the target has more than one rank, else hf; a "
        "DCP input converts to hf. megatron: a Megatron-Core torch_dist checkpoint "
        "(--tp/--pp/--ep: the degrees it is written for; a torch_dist SRC is read as input).",
    ),
]
MaxShardSize = Annotated[
    str, typer.Option(help="Split output files above this size (5GB = 5·10⁹ B, 5GiB = 2³⁰).")
]
Workers = Annotated[
    int | None,
    typer.Option(
        help="Writer threads (each output file has one); default: usable cores, at most 4.",
        min=1,
        max=MAX_WORKERS,
    ),
]
Force = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace an existing DST atomically: only an empty directory or a previous "
        "shardctl output (it has shardctl.layout.json); anything else is exit 4.",
    ),
]
AllowPickle = Annotated[
    bool,
    typer.Option(
        "--allow-pickle",
        help="Accept .bin/.pt input, loaded only with torch.load(weights_only=True).",
    ),
]
FollowSymlinks = Annotated[
    bool,
    typer.Option(
        "--follow-external-symlinks", help="Accept shard symlinks that point outside SRC."
    ),
]
NoVerifyInput = Annotated[
    bool,
    typer.Option(
        "--no-verify-input",
        help="Skip hashing inputs whose digests are known (layout record, HF-cache blob).",
    ),
]
NoResume = Annotated[
    bool,
    typer.Option(
        "--no-resume",
        help="Start clean: do not reuse the finished files of an identical killed run. "
        "Resume trusts inputs whose name, size, mtime, inode and ctime are unchanged (their "
        "bytes are not re-hashed unless their digests are known).",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress, no summary.")]


def reshard(
    src: Src,
    dst: Dst,
    tp: Tp = None,
    pp: Pp = None,
    ep: Ep = None,
    dp: Dp = None,
    manifest: ManifestOpt = None,
    fmt: Format = None,
    max_shard_size: MaxShardSize = "5GB",
    workers: Workers = None,
    force: Force = False,
    allow_pickle: AllowPickle = False,
    follow_external_symlinks: FollowSymlinks = False,
    no_verify_input: NoVerifyInput = False,
    no_resume: NoResume = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    max_header_bytes: MaxHeaderBytes = None,
    no_optimizer: NoOptimizer = False,
) -> None:
    """Split, merge or convert a checkpoint: streaming, constant memory, atomic.

    Examples:
    [bold]shardctl reshard ./Llama-3-8B ./llama-tp4 --tp 4[/bold] (HF → per-rank shards);
    [bold]shardctl reshard ./llama-tp4 ./llama-tp2 --tp 2[/bold] (any-to-any);
    [bold]shardctl reshard ./llama-tp4 ./merged --format hf[/bold] (back to HF).
    """
    from shardctl.api import reshard as run_reshard

    axes = {k: v for k, v in {"tp": tp, "pp": pp, "ep": ep, "dp": dp}.items() if v is not None}
    if dp is not None and fmt != "dcp":
        from shardctl.formats.dcp.metadata import is_dcp

        if not is_dcp(src):
            from shardctl.errors import UsageError

            raise UsageError("--dp applies to DCP output only (--format dcp)")
    show = not quiet and not as_json and sys.stderr.isatty()
    with header_limit(max_header_bytes), _progress(show) as progress:
        result = run_reshard(
            src,
            dst,
            mesh=axes or None,
            manifest=manifest,
            format=fmt,
            max_shard_size=max_shard_size,
            workers=workers,
            force=force,
            allow_pickle=allow_pickle,
            follow_external_symlinks=follow_external_symlinks,
            verify_input=not no_verify_input,
            resume=not no_resume,
            progress=progress,
            optimizer=not no_optimizer,
        )
    if as_json:
        emit_json(result.to_json())
    elif not quiet:
        console_for_output().print(summary(result))


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(
        *progress_columns(),
        transient=True,
        console=Console(stderr=True),
    ) as bar:
        task = bar.add_task("resharding", total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def progress_columns() -> tuple[Any, ...]:
    """The bar's columns, counting in binary units (MiB, GiB) as the summary line does."""
    from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn

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


def summary(result: ReshardResult) -> Text:
    """One line: what was written where, how fast, in how much memory, what was reused."""
    mesh_text = "" if result.mesh is None else f" mesh {result.mesh}"
    line = Text("wrote", style="green")
    line.append(
        f" {result.dst} ({result.format}{mesh_text}): {len(result.files)} files, "
        f"{fmt_bytes(result.total_bytes)} in {result.seconds:.2f} s "
        f"({fmt_bytes(result.bytes_per_second)}/s), peak memory {fmt_bytes(result.peak_rss_bytes)}"
    )
    if result.carried:
        line.append(f", carried {', '.join(result.carried)}")
    if result.resumed:
        n = len(result.resumed)
        line.append(
            f"; resumed a killed run: reused {n} finished file{'s' if n != 1 else ''} "
            f"({fmt_bytes(result.reused_bytes)})"
        )
    return line
