"""Terminal rendering of a plan (rich). The only module of ``shardctl.plan`` that prints.

One row per group of identical neighbouring ranks (``ranks 0–7 · tp0–7 ×8``), every rank with
``all_ranks``; every size in one unit, chosen by the largest; off a terminal (CI logs) lines are
never wrapped at 80 columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardctl.console import console_for_output
from shardctl.plan.groups import fold, group_ranks
from shardctl.units import fmt_in, pick_unit

if TYPE_CHECKING:
    from shardctl.plan.api import PlanResult

MEMORY_COLUMNS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "overhead")
MAX_ROWS = 64


def render_plan(
    result: PlanResult, console: Console | None = None, *, all_ranks: bool = False
) -> None:
    console = console or console_for_output()
    model, m = result.model, result.mesh
    largest = max([r.total for r in result.ranks] + [result.device_memory or 0, 1])
    unit = pick_unit(largest)
    tr = result.manifest.training
    cp = tr.context_parallel if tr is not None else 1
    console.print(
        f"[bold]{escape(model.architecture)}[/bold]  {model.parameters:,} parameters  "
        f"{fmt_in(model.weight_bytes, unit)} ({model.weight_bytes:,} B, {model.dtype})  "
        f"mesh {m}{f'×CP{cp}' if cp > 1 else ''} = {m.world * cp} GPUs"
    )
    if cp > 1:
        console.print(
            f"  context parallel: each of the {cp} CP ranks of a replica holds 1/{cp} of every "
            "sequence's tokens and the same weights as the rank listed"
        )
    if result.shared_ep:
        experts = model.dims.num_experts if model.dims else 0
        console.print(
            f"  experts: EP{result.shared_ep} shared over the TP×DP ranks of attention "
            f"(vLLM --enable-expert-parallel): {experts // result.shared_ep} of {experts} "
            "experts whole on each rank"
        )
    q = result.manifest.quantization
    if q is not None:
        stored = result.quantized_weight_bytes()
        mixed = f" + {len(q.overrides)} overrides" if q.overrides else ""
        console.print(
            f"  quantized {q.method}{mixed}: {fmt_in(stored, unit)} ({stored:,} B, "
            f"{stored / model.parameters:.4f} B/parameter incl. scales)"
        )
    if result.weights_only:
        console.print(
            "[bold yellow]WEIGHTS ONLY[/bold yellow]: no KV cache and no activations counted"
        )
    for warning in result.warnings:
        console.print(f"[yellow]warning[/yellow]: {warning}", markup=True)
    stage_bytes = result.stage_weight_bytes()
    for s, w in zip(result.stages, stage_bytes, strict=True):
        layers = "no layers" if s.layers is None else f"layers {s.layers[0]}–{s.layers[1]}"
        console.print(f"  stage {s.index}: {layers} ({s.num_layers}), weights {fmt_in(w, unit)}")
    if len(stage_bytes) > 1 and sum(stage_bytes) > 0:
        mean = sum(stage_bytes) / len(stage_bytes)
        console.print(f"  load balance (max/mean weights per stage): {max(stage_bytes) / mean:.3f}")
    console.print(_rank_table(result, unit, all_ranks=all_ranks))
    from shardctl.plan.report import render_bars

    render_bars(result, console=console, all_ranks=all_ranks, unit=unit)
    _verdict(result, console, unit)
    cmd = result.engine_command()  # engine formats (issue 16)
    if cmd is not None:
        if cmd["command"] is not None:
            console.print(
                f"{cmd['engine']} checkpoint: {cmd['command']}", markup=False, highlight=False
            )
            if cmd.get("load_flags"):
                console.print(f"  load with: {cmd['load_flags']}", markup=False)
        elif cmd.get("refused") is None:  # nothing to convert (engine: hf)
            console.print(f"{cmd['engine']}: {cmd.get('note', '')}", markup=False)
            if cmd.get("load_flags"):
                console.print(f"  load with: {cmd['load_flags']}", markup=False)
        else:
            console.print(
                f"{cmd['engine']}: cannot write this layout: {cmd['refused']}", markup=False
            )


def _rank_table(result: PlanResult, unit: tuple[str, int], *, all_ranks: bool) -> Table:
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("ranks", justify="right")
    table.add_column("coord")
    table.add_column("stage", justify="right")
    active = [k for k in MEMORY_COLUMNS if any(r.memory[k] for r in result.ranks)] or ["weights"]
    for k in active:
        table.add_column(k.replace("_", " "), justify="right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("×", justify="right")
    if result.budget is not None:
        table.add_column("fits", justify="center")
    groups = group_ranks(
        ((r.rank, r.coord, r.stage, r.memory) for r in result.ranks), all_ranks=all_ranks
    )
    for g in groups if all_ranks else fold(groups, MAX_ROWS):
        if g is None:
            table.add_row("…", "…", "…", *["…"] * (len(active) + 2))
            continue
        cells = [
            g.ranks_text(),
            g.coord_text(result.mesh),
            str(g.stage),
            *(fmt_in(g.memory[k], unit) for k in active),
            fmt_in(g.total, unit),
            f"×{g.count}",
        ]
        if result.budget is not None:
            ok = g.total <= result.budget
            cells.append("[green]yes[/green]" if ok else "[red]no[/red]")
        table.add_row(*cells)
    return table


def _verdict(result: PlanResult, console: Console, unit: tuple[str, int]) -> None:
    budget = result.budget
    if budget is None:
        if result.memory.refused is not None:  # no budget, but the engine would not start
            console.print(f"[red]does not fit[/red]: {escape(result.memory.refused)}")
            return
        console.print("no verdict: hardware.device_memory is not set")
        return
    worst = max(result.ranks, key=lambda r: r.total)
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    if result.weights_only:
        verdict += " (weights only)"
    share = result.memory.inputs.get("gpu_memory_utilization")
    of = fmt_in(budget, unit)
    fraction = result.memory.inputs.get("mem_fraction_static") or result.memory.inputs.get(
        "free_gpu_memory_fraction"
    )
    if fraction is not None:  # SGLang / TensorRT-LLM: the reserve is an overhead item
        of += f" (device memory; engine fraction {fraction} priced as overhead)"
    elif result.memory.mode == "inference" and share is not None:
        of += f" (gpu_memory_utilization {share} × {fmt_in(result.device_memory or 0, unit)})"
    if result.memory.refused is not None:
        console.print(f"{verdict}: {escape(result.memory.refused)}", highlight=False)
    console.print(
        f"{'memory' if result.memory.refused is not None else verdict}: largest rank "
        f"{worst.rank} needs {fmt_in(worst.total, unit)} of the budget {of}: "
        f"{worst.total / budget:.1%}, headroom {fmt_in(budget - worst.total, unit)}"
    )
    kv = result.memory.kv
    if kv is not None and kv.capacity is not None and kv.sequence_length:
        c = kv.capacity
        if c.engine in ("sglang", "trtllm"):  # the engine's own log line
            name = (
                "max_total_num_tokens"
                if c.engine == "sglang"
                else f"max tokens in paged KV cache (blocks of {c.block_size})"
            )
            console.print(
                f"KV cache per rank: {fmt_in(c.kv_bytes, unit)}, {name} = {c.tokens:,}; max "
                f"concurrency at {kv.sequence_length:,} tokens: {c.max_concurrency:.2f}x"
            )
            return
        # vLLM's own units: "# GPU blocks", "GPU KV cache size: N tokens", "Maximum concurrency".
        groups = f" shared by {c.groups} KV cache groups" if c.groups > 1 else ""
        console.print(
            f"KV cache per rank: {fmt_in(c.kv_bytes, unit)} = {c.blocks:,} blocks of "
            f"{c.block_size} tokens{groups} = {c.tokens:,} tokens; max concurrency at "
            f"{kv.sequence_length:,} tokens: {c.max_concurrency:.2f}x"
        )


def render_search(result: Any, *, top: int, console: Console | None = None) -> None:
    from shardctl.plan.report import render_search_table

    render_search_table(result, top=top, console=console or console_for_output())
