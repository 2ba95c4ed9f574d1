"""``shardctl verify``: levels → one :func:`shardctl.api.verify` call → report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shardctl.cli._common import MaxHeaderBytes, emit_json, header_limit
from shardctl.console import console_for_output
from shardctl.errors import EXIT_NEGATIVE
from shardctl.verify.result import LevelResult, VerifyResult


def verify(
    src: Annotated[
        Path, typer.Argument(help="The original: an HF checkpoint dir (or a shardctl layout).")
    ],
    dst: Annotated[
        Path, typer.Argument(help="The resharded output: a shardctl layout or an HF dir.")
    ],
    level: Annotated[
        str, typer.Option(help="structure | bitwise | forward (cumulative).")
    ] = "forward",
    device: Annotated[
        str, typer.Option(help="auto | cpu | cuda (auto: CUDA when present).")
    ] = "auto",
    launcher: Annotated[
        str, typer.Option(help="local (spawn one process per rank) | torchrun (see README).")
    ] = "local",
    seed: Annotated[
        int, typer.Option(help="Seed of the random input ids.", min=0, max=2**63 - 1)
    ] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result as JSON (schema shardctl.verify/1).")
    ] = False,
    report: Annotated[
        Path | None, typer.Option(help="Also write the JSON result to this file.")
    ] = None,
    max_header_bytes: MaxHeaderBytes = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="List every tensor (default: counts, failures only)."),
    ] = False,
) -> None:
    """Prove DST equivalent to SRC: structure, then bits, then a distributed forward.

    Exit 0 equivalent, 1 not equivalent, 3 invalid input, 5 could not verify.

    Example: [bold]shardctl verify ./Llama-3-8B ./llama-tp4 --level forward --json[/bold]
    """
    from shardctl.api import verify as run_verify

    with header_limit(max_header_bytes):
        result = run_verify(src, dst, level=level, device=device, launcher=launcher, seed=seed)
    # the JSON copy (a dict per tensor: ~30 MiB at 90,000) only where it is written
    doc = result.to_json() if report is not None or as_json else {}
    if report is not None:
        report.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if as_json:
        emit_json(doc)
    else:
        console_for_output().print(render(result, verbose=verbose))
    if not result.ok:
        raise typer.Exit(EXIT_NEGATIVE)


MAX_FINDINGS = 40  # failures printed per level without --verbose (--json keeps them all)
_STYLE = {"pass": "green", "fail": "bold red", "not-run": "dim"}


def _status(s: str) -> Text:
    return Text(s.upper() if s != "not-run" else "not run", style=_STYLE.get(s, ""))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _plain(text: object) -> Text:
    """User-controlled text (tensor names, paths, messages quoting them): never rich markup."""
    return Text(str(text))


def summary(result: VerifyResult) -> Table:
    t = Table(title=f"verify {escape(result.src)} → {escape(result.dst)}", title_justify="left")
    t.add_column("level")
    t.add_column("status")
    t.add_column("seconds", justify="right")
    t.add_column("figures")
    for lv in result.levels:
        figs = {k: v for k, v in lv.figures.items() if not isinstance(v, dict)}
        t.add_row(
            lv.name,
            _status(lv.status),
            f"{lv.seconds:.2f}",
            _plain(", ".join(f"{k}={_fmt(v)}" for k, v in list(figs.items())[:6])),
        )
    return t


def findings(lv: LevelResult, *, verbose: bool = False) -> Table:
    t = Table(title=f"{lv.name}: {len(lv.findings)} finding(s)", title_justify="left")
    for col in ("tensor", "rank", "file", "what"):
        t.add_column(col, overflow="fold")
    shown = lv.findings if verbose else lv.findings[:MAX_FINDINGS]
    for f in shown:
        t.add_row(
            _plain(f.fqn or ""),
            "" if f.rank is None else str(f.rank),
            _plain(f.file or ""),
            _plain(f.message),
        )
    if len(shown) < len(lv.findings):
        t.add_row("…", "", "", f"{len(lv.findings) - len(shown)} more (--verbose or --json)")
    return t


def passed_line(lv: LevelResult) -> Text:
    """``291 tensors bit-identical (1164 shards)``: what passed, counted, not listed."""
    passed, shards, failed = _tally(lv.rows)
    line = Text(f"{passed} tensor{'s' if passed != 1 else ''} bit-identical", style="green")
    line.append(f" ({shards} shards)")
    if failed:
        line.append(f"; {failed} differ", style="bold red")
    return line


def _tally(rows: Sequence[dict[str, Any]]) -> tuple[int, int, int]:
    """``(tensors passed, their shards, tensors failed)``; the bitwise level's lazy rows count
    from their columns (``TensorRows.tally``)."""
    tally = getattr(rows, "tally", None)
    if tally is not None:
        return tally()
    passed = [r for r in rows if r.get("status") == "pass"]
    return len(passed), sum(int(r.get("shards", 0)) for r in passed), len(rows) - len(passed)


def tensors(lv: LevelResult) -> Table:
    """Every tensor of the bitwise level, failures first (``--verbose``)."""
    t = Table(title="bitwise, per tensor", title_justify="left")
    for col in ("tensor", "shards", "bytes", "status"):
        t.add_column(col, justify="right" if col in ("shards", "bytes") else "left")
    for r in sorted(lv.rows, key=lambda r: r.get("status") != "fail"):
        t.add_row(_plain(r["fqn"]), str(r["shards"]), str(r["bytes"]), _status(r["status"]))
    return t


def failed_tensors(lv: LevelResult) -> Table:
    t = Table(title="bitwise, tensors that differ", title_justify="left")
    for col in ("tensor", "shards", "bytes"):
        t.add_column(col, justify="left" if col == "tensor" else "right")
    failed = [r for r in lv.rows if r.get("status") == "fail"]
    for r in failed[:MAX_FINDINGS]:
        t.add_row(_plain(r["fqn"]), str(r["shards"]), str(r["bytes"]))
    if len(failed) > MAX_FINDINGS:
        t.add_row(f"… {len(failed) - MAX_FINDINGS} more (--verbose or --json)", "", "")
    return t


def forward(lv: LevelResult, result: VerifyResult) -> Table:
    env = result.environment
    where = f"{env.get('backend')} on {env.get('device')}, world {env.get('world_size')}" + (
        " (simulated in one process)" if env.get("simulated") else ""
    )
    t = Table(title=f"forward logits vs float64 reference — {where}", title_justify="left")
    for col in ("figure", "sharded", "unsharded", "bound", "status"):
        t.add_column(col, justify="left" if col in ("figure", "status") else "right")
    for r in lv.rows:
        t.add_row(
            r["figure"],
            _fmt(r["sharded"]),
            _fmt(r["unsharded"]),
            _fmt(r["bound"]),
            _status(r["status"]),
        )
    return t


def render(result: VerifyResult, *, verbose: bool = False) -> RenderableType:
    """The level summary, what passed (counted), and every failure; ``verbose`` lists every
    tensor of the bitwise level (an 8B model has 291, DeepSeek-V3 about 90,000)."""
    parts: list[RenderableType] = [summary(result)]
    for lv in result.levels:
        if lv.name == "bitwise" and lv.rows:
            parts.append(passed_line(lv))
            if verbose:
                parts.append(tensors(lv))
            elif _tally(lv.rows)[2]:
                parts.append(failed_tensors(lv))
        if lv.name == "forward" and lv.rows:
            parts.append(forward(lv, result))
        if lv.findings:
            parts.append(findings(lv, verbose=verbose))
    verdict = "EQUIVALENT" if result.ok else "NOT EQUIVALENT"
    parts.append(Text(verdict, style="bold green" if result.ok else "bold red"))
    return Group(*parts)
