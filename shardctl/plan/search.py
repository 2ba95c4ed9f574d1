"""Layout search: every ``(tp, pp, dp, ep)`` (and, for training, ZeRO stage and recompute)
within the hardware, why the invalid ones are invalid, and the ones that fit, ranked.

Validity rules (first failing rule is the reason counted):

- ``tp_across_nodes``: ``tp`` above ``gpus_per_node`` (TP all-reduces every layer; across
  nodes they run at NIC speed), unless allowed; ``tp_splits_node``: ``tp`` does not divide
  ``gpus_per_node`` (a TP group would straddle two nodes);
- ``heads_not_divisible``: ``tp`` does not divide ``num_attention_heads``;
  ``kv_heads_not_divisible``: neither ``tp`` divides ``num_key_value_heads`` nor the reverse
  (DESIGN.md, K/V replication);
- ``pp_above_layers``; ``layers_not_divisible``: the pipeline convention needs ``pp | L``;
- ``no_experts``: ``ep > 1`` on a dense model; ``experts_not_divisible``: ``ep ∤ E``;
- ``dp_above_batch`` (inference: a replica would serve no sequence);
  ``batch_not_divisible`` (training: ``global_batch ∤ micro_batch × dp``);
- ``bare_parameter_count``: a bare count has no layers or heads: only ``dp`` is searched;
- ``layout_refused``: the layout engine refuses the mesh (e.g. an uneven split of a tensor,
  ``layout.uneven: error``); ``plan`` on that mesh exits 3 with the engine's message;
- ``does_not_fit``: priced, some rank above the budget (the same budget and weights as
  ``plan``: :mod:`shardctl.plan.memory.budget`, :mod:`shardctl.plan.weights`).

Objective (default ``gpus,headroom,comm``): fewest GPUs, then the most headroom (budget
minus the fullest rank), then the least communication time per token / step.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cache
from typing import Any

from shardctl.errors import LayoutError
from shardctl.layout.pipeline import DIVISIBLE_ONLY
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.budget import engine_utilization, memory_budget
from shardctl.plan.memory.budget import fits as fits_budget
from shardctl.plan.memory.context import Context
from shardctl.plan.memory.context_length import refusal
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.overhead import OverheadSpec
from shardctl.plan.memory.shapes import shape_from_model
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload
from shardctl.plan.memory.summaries import stage_comm
from shardctl.plan.memory.vllm import engine_hardware
from shardctl.plan.search_types import OBJECTIVES, Candidate, SearchOptions, SearchResult
from shardctl.plan.weights import (
    engine_rules,
    options_for,
    served_model,
    served_rules,
    weights_per_coord,
)

# rejection reason of every mesh when the serving engine refuses the sequence length
ENGINE_REFUSES = "engine_refuses_length"


@cache
def _pairs(m: int) -> int:
    """#(x, y) >= 1 with x·y <= m."""
    return sum(m // x for x in range(1, m + 1))


@cache
def _triples(m: int) -> int:
    """#(x, y, z) >= 1 with x·y·z <= m."""
    return sum(_pairs(m // x) for x in range(1, m + 1))


def search(
    model: ModelInfo,
    *,
    options: SearchOptions,
    workload: Workload | None = None,
    training: TrainingSpec | None = None,
    quant: QuantSpec | None = None,
    hardware: HardwareSpec | None = None,
    overhead: OverheadSpec | None = None,
    rules: Sequence[RuleSpec] = (),
    layout: LayoutOptions | None = None,
) -> SearchResult:
    """Price every valid layout on at most ``options.gpus`` GPUs; keep those that fit.

    Weights come from the layout engine (``rules`` and ``layout`` as ``plan`` uses them), and
    every rank is judged against the same budget as ``plan`` (:mod:`.memory.budget`): for any
    mesh it prices, the search's verdict is ``plan``'s.
    """
    t0 = time.perf_counter()
    workload = workload or Workload()
    served = served_model(model, workload)  # the tensors the engine loads (plan's)
    rules = engine_rules(served, served_rules(model, served, rules), workload)
    model = served
    quant = quant or QuantSpec()
    hw = engine_hardware(hardware or HardwareSpec(), workload.engine, training=training is not None)
    ovh = overhead or OverheadSpec()
    base = layout or LayoutOptions(pipeline=options.pipeline, vocab_padding=options.vocab_padding)
    n = options.gpus
    rej: Counter[str] = Counter()
    fits: list[Candidate] = []
    priced = 0
    shape = shape_from_model(model, vocab_padding=base.vocab_padding) if model.dims else None
    combos = _state_choices(training, options)
    term_cache: dict[Any, Any] = {}
    count_cache: dict[Any, Any] = {}

    # an engine that refuses the length refuses every layout: none is priced (plan's verdict)
    refused = None if training else refusal(model, workload.engine, workload.sequence_length)
    meshes = _model_parallel(model, n, hw, options, base, rules, rej, quant)
    for tp, pp, ep, stages, per_stage in meshes:
        for dp in range(1, n // (tp * pp * ep) + 1):
            reason = _dp_reason(dp, workload, training) or (refused and ENGINE_REFUSES)
            if reason:
                rej[reason] += 1
                continue
            mesh = Mesh(pp=pp, dp=dp, ep=ep, tp=tp)
            for tr in combos:
                priced += 1
                ctx = Context(model, mesh, stages, shape, workload, tr, quant, hw, ovh)
                # Meshes that agree on these share their per-stage terms and counts.
                key = (tp, pp, ep, ctx.batch, ctx.microbatches, tr.recompute if tr else None)
                ctx._cache = term_cache.setdefault(key, {})
                ctx._counts = count_cache.setdefault((tp, pp, ep), {})
                cand = _price(ctx, mesh, stages, per_stage, tr)
                if cand.headroom is not None and cand.headroom < 0:
                    rej["does_not_fit"] += 1
                else:
                    fits.append(cand)
    fits.sort(key=_sort_key(options.objective))
    notes = [refused] if refused else []
    if hw.device_memory is None:
        notes.append("hardware.device_memory is not set: every valid layout is kept")
    if model.dims is None:
        notes.append("bare parameter count: model states only, dp searched alone")
    return SearchResult(
        mode="training" if training else "inference",
        gpus=n,
        budget=memory_budget(
            hw.device_memory,
            training=training is not None,
            gpu_memory_utilization=(
                workload.gpu_memory_utilization
                if training
                else engine_utilization(workload.engine, workload.gpu_memory_utilization)
            ),
        ),
        objective=options.objective,
        candidates=tuple(fits),
        rejected=dict(rej),
        priced=priced,
        seconds=time.perf_counter() - t0,
        unit="step" if training else "token",
        notes=tuple(notes),
    )


def _model_parallel(
    model: ModelInfo,
    n: int,
    hw: HardwareSpec,
    options: SearchOptions,
    layout: LayoutOptions,
    rules: Sequence[RuleSpec],
    rej: Counter[str],
    quant: QuantSpec | None = None,
) -> Iterator[tuple[int, int, int, tuple[Stage, ...], list[tuple[int | None, ...]]]]:
    """Every valid ``(tp, pp, ep)`` on ``n`` GPUs with its stages and weights; the invalid
    ones are counted in ``rej`` once for every mesh (every ``dp``, every smaller axis) they
    would have made."""
    for tp in range(1, n + 1):
        reason = _tp_reason(model, tp, hw, options)
        if reason:
            rej[reason] += _triples(n // tp)
            continue
        for pp in range(1, n // tp + 1):
            reason = _pp_reason(model, pp, layout)
            if reason:
                rej[reason] += _pairs(n // (tp * pp))
                continue
            for ep in range(1, n // (tp * pp) + 1):
                reason = _ep_reason(model, ep)
                if reason:
                    rej[reason] += n // (tp * pp * ep)
                    continue
                try:
                    stages, per_stage = _stage_weights(
                        model, Mesh(pp=pp, ep=ep, tp=tp), rules, layout, quant
                    )
                except LayoutError:
                    rej["layout_refused"] += n // (tp * pp * ep)
                    continue
                yield tp, pp, ep, stages, per_stage


def _stage_weights(
    model: ModelInfo,
    mesh: Mesh,
    rules: Sequence[RuleSpec],
    layout: LayoutOptions,
    quant: QuantSpec | None = None,
) -> tuple[tuple[Stage, ...], list[tuple[int | None, ...]]]:
    """The stages of ``mesh`` and, per stage, the distinct weight bytes of its ranks (from the
    layout engine, as ``plan`` has them); ``(None,)`` where the closed form prices weights."""
    stages, weights = weights_per_coord(
        model, mesh, rules=rules, options=options_for(layout, mesh.pp), quant=quant
    )
    if weights is None:
        return stages, [(None,)] * len(stages)
    per_stage: list[set[int]] = [set() for _ in stages]
    for (p, _e, _t), w in weights.items():
        per_stage[p].add(w)
    return stages, [tuple(sorted(ws)) for ws in per_stage]


def _state_choices(
    training: TrainingSpec | None, options: SearchOptions
) -> list[TrainingSpec | None]:
    if training is None:
        return [None]
    out: list[TrainingSpec | None] = []
    for z in options.zero_stages:
        for rc in options.recompute:
            off_p = training.offload_params if z == 3 else "none"
            out.append(replace(training, zero=z, recompute=rc, offload_params=off_p))
    return out


def invalid_reason(
    model: ModelInfo,
    mesh: Mesh,
    *,
    options: SearchOptions,
    hardware: HardwareSpec,
    workload: Workload,
    training: TrainingSpec | None = None,
    rules: Sequence[RuleSpec] = (),
    layout: LayoutOptions | None = None,
) -> str | None:
    """Why :func:`search` does not price ``mesh`` (its rejection reason), or ``None`` when it
    prices it: then its verdict is ``plan``'s for the same mesh."""
    base = layout or LayoutOptions(pipeline=options.pipeline, vocab_padding=options.vocab_padding)
    reason = (
        _tp_reason(model, mesh.tp, hardware, options)
        or _pp_reason(model, mesh.pp, base)
        or _ep_reason(model, mesh.ep)
    )
    if reason:
        return reason
    try:
        served = served_model(model, workload)
        own = served_rules(model, served, rules)
        _stage_weights(served, replace(mesh, dp=1), engine_rules(served, own, workload), base)
    except LayoutError:
        return "layout_refused"
    if training is None and refusal(model, workload.engine, workload.sequence_length):
        return _dp_reason(mesh.dp, workload, training) or ENGINE_REFUSES
    return _dp_reason(mesh.dp, workload, training)


def _tp_reason(model: ModelInfo, tp: int, hw: HardwareSpec, o: SearchOptions) -> str | None:
    d = model.dims
    if d is None:
        return "bare_parameter_count" if tp > 1 else None
    if tp > hw.gpus_per_node and not o.allow_tp_across_nodes:
        return "tp_across_nodes"
    if tp <= hw.gpus_per_node and hw.gpus_per_node % tp:
        return "tp_splits_node"
    if d.num_heads % tp:
        return "heads_not_divisible"
    if d.num_kv_heads % tp and tp % d.num_kv_heads:
        return "kv_heads_not_divisible"
    return None


def _pp_reason(model: ModelInfo, pp: int, layout: LayoutOptions) -> str | None:
    d = model.dims
    if d is None:
        return "bare_parameter_count" if pp > 1 else None
    if pp > d.num_layers:
        return "pp_above_layers"
    explicit = options_for(layout, pp).layers_per_stage is not None
    if d.num_layers % pp and layout.pipeline in DIVISIBLE_ONLY and not explicit:
        return "layers_not_divisible"
    return None


def _ep_reason(model: ModelInfo, ep: int) -> str | None:
    d = model.dims
    if ep == 1:
        return None
    if d is None:
        return "bare_parameter_count"
    if not d.num_experts:
        return "no_experts"
    if d.num_experts % ep:
        return "experts_not_divisible"
    return None


def _dp_reason(dp: int, w: Workload, tr: TrainingSpec | None) -> str | None:
    if tr is None:
        return "dp_above_batch" if dp > w.batch_size else None
    if tr.global_batch_size is not None and tr.global_batch_size % (tr.micro_batch_size * dp):
        return "batch_not_divisible"
    return None


def _probe_stages(stages: tuple[Stage, ...]) -> list[Stage]:
    """The stages whose communication is priced: the first (embedding), the first with the most
    layers, the last (head, logits), and a middle one (the most PP traffic). Memory is priced
    on every stage: with uneven conventions an early short stage can hold the most in flight."""
    most = max(stages, key=lambda s: s.num_layers)
    picks = {stages[0].index: stages[0], most.index: most, stages[-1].index: stages[-1]}
    if len(stages) > 2:  # a middle stage sends and receives: the most PP traffic
        mid = stages[len(stages) // 2]
        picks.setdefault(mid.index, mid)
    return [picks[i] for i in sorted(picks)]


def _price(
    ctx: Context,
    mesh: Mesh,
    stages: tuple[Stage, ...],
    per_stage: list[tuple[int | None, ...]],
    tr: TrainingSpec | None,
) -> Candidate:
    """Every stage's fullest rank (ranks of a stage differ only in their weight bytes), the
    verdict from the one budget, and the communication of the probed stages."""
    peaks = tuple(
        max(ctx.rank(st, w).total for w in weights)
        for st, weights in zip(stages, per_stage, strict=True)
    )
    peak = max(peaks)
    headroom = None if ctx.budget is None else ctx.budget - peak
    times, sent = [0.0], [0]
    if fits_budget(peak, ctx.budget) is not False:  # communication is priced for the ones kept
        comm = [stage_comm(ctx, st) for st in _probe_stages(stages)]
        times = [sum(c.time(mesh, ctx.hw).values()) for c in comm]
        sent = [int(sum(c.bytes.values())) for c in comm]
    return Candidate(
        mesh=mesh,
        zero=None if tr is None else tr.zero,
        recompute=None if tr is None else tr.recompute,
        peak=peak,
        headroom=headroom,
        comm_time=max(times),
        comm_bytes=max(sent),
        stage_peaks=peaks,
    )


def _sort_key(objective: str) -> Any:
    order = objective.split(",")

    def key(c: Candidate) -> tuple[float, ...]:
        parts = {
            "gpus": float(c.world),
            "headroom": -float(c.headroom if c.headroom is not None else 0),
            "comm": c.comm_time,
        }
        return tuple(parts[k] for k in order)

    return key


__all__ = [
    "OBJECTIVES",
    "Candidate",
    "SearchOptions",
    "SearchResult",
    "invalid_reason",
    "search",
]
