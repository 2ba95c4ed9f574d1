"""``shardctl inspect``: a checkpoint at a glance, from headers only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shardctl.cli._common import MaxHeaderBytes, emit_json, header_limit
from shardctl.console import console_for_output
from shardctl.units import fmt_bytes

if TYPE_CHECKING:
    from shardctl.checkpoint.summary import InspectResult


def inspect(
    path: Annotated[
        Path,
        typer.Argument(help="A checkpoint directory (HF or shardctl layout) or a config.json."),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print as JSON (schema shardctl.inspect/1).")
    ] = False,
    max_header_bytes: MaxHeaderBytes = None,
) -> None:
    """Show a checkpoint at a glance without reading tensor data.

    Example: [bold]shardctl inspect ./Llama-3-8B[/bold]
    """
    from shardctl.api import inspect as run_inspect

    with header_limit(max_header_bytes):
        info = run_inspect(path)
    if as_json:
        emit_json(info.to_json())
    else:
        render_inspect(info)


def render_inspect(info: InspectResult, console: Console | None = None) -> None:
    """The checkpoint at a glance; names from the checkpoint are printed literally."""
    console = console or console_for_output()
    m = info.model
    console.print(f"[bold]{escape(str(info.path))}[/bold]  ({info.kind})")
    console.print(
        f"  architecture {escape(m.architecture)}  {m.parameters:,} parameters  "
        f"{fmt_bytes(m.weight_bytes)} ({m.weight_bytes:,} B)  {len(m.tensors)} tensors"
    )
    if info.dtypes:
        console.print(
            "  dtypes: " + ", ".join(f"{escape(d)} {n:,}" for d, n in info.dtypes.items())
        )
    if m.dims is not None:
        d = m.dims
        console.print(
            f"  hidden {d.hidden_size}, layers {d.num_layers}, heads {d.num_heads} "
            f"(kv {d.num_kv_heads}, head_dim {d.head_dim}), intermediate "
            f"{d.intermediate_size}, vocab {d.vocab_size}"
            + (", tied embeddings" if d.tie_word_embeddings else "")
            + (f", {d.num_experts} experts (top-{d.experts_per_token})" if d.num_experts else "")
        )
    quant = info.quantization
    if quant is not None:
        console.print(
            f"  quantization: {escape(quant['method'])}, {quant['quantized_weights']} weights "
            f"quantized ({fmt_bytes(quant['quantized_bytes'])}), "
            f"{fmt_bytes(quant['unquantized_bytes'])} unquantized"
        )
        for g in quant["groups"]:
            members = ", ".join(f"{k} {v}" for k, v in g["members"].items())
            console.print(
                f"    {escape(g['pattern'])} ×{g['count']}: {escape(g['scheme'])}: "
                f"{escape(members)}"
            )
    if info.mesh is not None:
        mesh = "×".join(f"{a.upper()}{info.mesh[a]}" for a in ("pp", "dp", "ep", "tp"))
        console.print(f"  layout: {escape(str(info.layout_format))}, mesh {mesh}")
        for s in info.stages:
            console.print(f"    stage {s['stage']}: layers {s['layers']}")
    if info.ranks:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for col in ("rank", "coord", "shards", "bytes", "files"):
            table.add_column(col, justify="right" if col in ("rank", "shards") else "left")
        for r in info.ranks:
            coord = " ".join(f"{k}{v}" for k, v in r.coord.items())
            table.add_row(
                str(r.rank), coord, str(r.shards), fmt_bytes(r.bytes), Text(", ".join(r.files))
            )
        console.print(table)
    if info.files and not info.ranks:
        table = Table(box=None, header_style="bold", pad_edge=False)
        table.add_column("file")
        table.add_column("size", justify="right")
        table.add_column("tensors", justify="right")
        for f in info.files:
            table.add_row(Text(f.name), fmt_bytes(f.size), str(f.tensors))
        console.print(table)
    if "dcp" in info.extra:  # dcp-optim
        _render_dcp(info.extra["dcp"], console)
    if info.carried:
        console.print("  carried files: " + escape(", ".join(info.carried)))
    if info.suggested is not None:
        from shardctl.archs.suggest import rule_yaml

        console.print(
            f"  no family file for {escape(info.model.architecture)!s}: suggested manifest "
            f"rules (from {escape(info.suggested.source)}; not applied — copy them into a "
            "manifest and check with shardctl verify):"
        )
        console.print("  rules:")
        for rule in info.suggested.rules:
            console.print("    - " + escape(rule_yaml(rule)))
    for w in info.warnings:
        console.print(f"  [yellow]warning[/yellow]: {escape(w)}")


def _render_dcp(d: dict[str, Any], console: Console) -> None:
    """A DCP training checkpoint's optimizer state, step and hyper-parameters."""
    states = ", ".join(f"{escape(k)} {v}" for k, v in d["optimizer_state"].items()) or "none"
    console.print(
        f"  optimizer state: {d['optimizer_tensors']} tensors "
        f"({fmt_bytes(d['optimizer_bytes'])}): {states}"
    )
    step = d["step"]
    if step is not None:
        shown = (
            f"{step['min']:g}"
            if step["min"] == step["max"]
            else f"{step['min']:g}..{step['max']:g}"
        )
        console.print(f"  step {shown}")
    for i, g in enumerate(d["param_groups"]):
        console.print(
            f"  param_groups[{i}]: " + escape(", ".join(f"{k}={v}" for k, v in g.items()))
        )
    if d["other_keys"]:
        console.print("  other state: " + escape(", ".join(d["other_keys"])))
