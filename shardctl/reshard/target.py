"""What a reshard writes, decided before writing: format, layout, every file and its header.

``plan(source, mesh=Mesh(tp=4))`` builds the target layout with the one layout engine and lays
its shards into output files (``checkpoint.plan_files``); nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from shardctl.checkpoint import plan_files, record_table
from shardctl.checkpoint.source import Source, SourceShard
from shardctl.errors import UsageError
from shardctl.layout import bounds, classes, resolve
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RuleSpec

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class Plan:
    """Everything decided before writing: format, layout, files and their headers."""

    fmt: str
    layout: Layout | None
    files: tuple[plan_files.OutputFile, ...]
    shard_files: Mapping[tuple[int, str], str]  # (rank, fqn) -> file name
    index: bytes | None
    # engine formats (--format vllm): the copy engine reads these instead of the source's own
    sources: Mapping[str, tuple[SourceShard, ...]] | None = None
    # the global fqn order every output file follows (the planner's: the copy engine does not
    # make a second dict of 100,000 names, ~6 MB)
    order: dict[str, int] | None = None
    extra_files: tuple[tuple[str, bytes], ...] = ()  # (name, bytes) written whole at commit

    @property
    def data_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan(
    source: Source,
    *,
    mesh: Mesh | None,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen
    fmt: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Plan:
    """The target layout and every output file's header; writes nothing."""
    if fmt is None:
        fmt = "ranks" if mesh is not None and mesh.model_parallel > 1 else "hf"
    if fmt not in ("ranks", "hf", "vllm"):
        raise UsageError(f"unknown format {fmt!r}", hint="use ranks, hf or vllm")
    if max_shard_size <= 0:
        raise UsageError(f"max_shard_size must be positive, got {max_shard_size}")
    bounds.check_dtypes(source.model)
    # ---- engine format: vllm (branch vllm) ----
    if fmt == "vllm":
        from shardctl.formats.vllm.write import VLLM_MAX_PART, vllm_files

        if rules or options != LayoutOptions():
            raise UsageError(
                "--format vllm: vLLM's layout is fixed; rules/layout options do not apply"
            )
        limit = VLLM_MAX_PART if max_shard_size == DEFAULT_MAX_SHARD_SIZE else max_shard_size
        v = vllm_files(source, mesh, limit)
        return Plan("vllm", None, v.files, {}, None, v.sources, v.order, v.extra_files)
    # ---- end vllm ----
    order = _order(source)
    if fmt == "hf":
        if mesh is not None and mesh.model_parallel > 1:
            raise UsageError(f"format hf holds whole tensors; mesh {mesh} needs format ranks")
        files, index = plan_files.hf_files(source.model.tensors, max_shard_size)
        return Plan("hf", None, tuple(files), {}, index, order=order)
    bounds.check_mesh(source.model, mesh or Mesh())  # before build_layout materializes shards
    bounds.check_config(source.model)
    layout = build_layout(source.model, mesh or Mesh(), rules=rules, options=options)
    resolve.forget(source.model)  # the per-tensor rules (or the classes) are in the layout now
    classes.forget(source.model)
    rfiles, where = plan_files.rank_files(layout, order, max_shard_size)
    return Plan("ranks", layout, tuple(rfiles), where, None, order=order)


def _order(source: Source) -> dict[str, int]:
    """``fqn -> position`` of the source's tensors; a sharded source's record already holds
    this map for its own tensor tuple (one dict of 100,000 names, ~7 MB, not two)."""
    table = source.record.table if source.record is not None else None
    if table is not None and table.tensors is source.model.tensors:
        return record_table.index_of(table)
    tensors = source.model.tensors
    return dict(zip(map(attrgetter("fqn"), tensors), range(len(tensors)), strict=True))


def space_needed(source: Source, the_plan: Plan) -> int:
    carried = sum(os.path.getsize(source.root / p) for p in source.carried)
    extra = sum(len(data) for _, data in the_plan.extra_files)
    return the_plan.data_bytes + carried + 2**20 + len(the_plan.index or b"") + extra
