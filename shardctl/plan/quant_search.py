"""``plan --search --quant …``: layouts and weight formats in one search.

Each format re-runs the layout search with the manifest's ``quantization`` set to it (weights
priced by :mod:`shardctl.plan.memory.quant`; KV cache, activations and overhead as the
manifest says); the rows of every format are ranked together by GPUs needed, then by
headroom (largest first). Each row carries a one-line quality note with its source (published
deltas; docs/memory-model.md, "Weight formats in the search").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardctl.errors import UsageError

if TYPE_CHECKING:
    from shardctl.manifest import Manifest
    from shardctl.model.types import ModelInfo
    from shardctl.plan.search_types import Candidate

QUANT_SEARCH_SCHEMA = "shardctl.quant-search/1"

# format name → the memory model's quantization method ("none": as the checkpoint stores it).
FORMATS: dict[str, str] = {
    "bf16": "none",
    "fp8": "fp8",
    "int8": "int8",
    "int4-awq": "awq",
    "int4-gptq": "gptq",
    "nf4": "nf4",
    "mxfp4": "mxfp4",
    "nvfp4": "nvfp4",
}

# One line per format: what was measured, and where it was published.
QUALITY: dict[str, tuple[str, str]] = {
    "bf16": ("baseline (the checkpoint as stored)", "—"),
    "fp8": (
        "FP8 W8A8 effectively lossless on Llama-3.1 8B–405B",
        "Kurtic et al. 2025, ACL, arXiv:2411.02355",
    ),
    "int8": (
        "LLM.int8() weights: no perplexity degradation up to 175B",
        "Dettmers et al. 2022, arXiv:2208.07339",
    ),
    "int4-awq": (
        "WikiText-2 ppl Llama-2-70B 3.32 → 3.41, 7B 5.47 → 5.60 (INT4 g128)",
        "Lin et al. 2024, AWQ, arXiv:2306.00978",
    ),
    "int4-gptq": (
        "INT4 weight-only (W4A16, GPTQ) competitive with 8-bit W8A8-INT (1–3 % loss)",
        "Kurtic et al. 2025, ACL, arXiv:2411.02355",
    ),
    "nf4": (
        "NF4 + double quant matches 16-bit fine-tuning on MMLU (QLoRA)",
        "Dettmers et al. 2023, arXiv:2305.14314",
    ),
    "mxfp4": ("no published delta cited here: measure before use", "—"),
    "nvfp4": (
        "DeepSeek-R1 FP8 → NVFP4: MMLU 90.8 → 90.7, GPQA 69.7 → 69.2",
        "nvidia/DeepSeek-R1-FP4 model card",
    ),
}


def parse_formats(text: str) -> tuple[str, ...]:
    """``"bf16,fp8,int4-awq"`` → the names in order; ``"any"`` → every known format."""
    if text.strip() == "any":
        return tuple(FORMATS)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise UsageError(
            f"--quant: unknown format {unknown[0] if unknown else text!r}",
            hint=f"use any, or a comma list of: {', '.join(FORMATS)}",
        )
    return names


@dataclass(frozen=True)
class QuantRow:
    format: str
    candidate: Candidate
    weights_per_rank: int  # the fullest rank's weights in this format

    def to_json(self) -> dict[str, Any]:
        note, source = QUALITY[self.format]
        return {
            "format": self.format,
            "method": FORMATS[self.format],
            **self.candidate.to_json(),
            "weights_per_rank_bytes": self.weights_per_rank,
            "quality": note,
            "quality_source": source,
        }


@dataclass(frozen=True)
class QuantSearchResult:
    formats: tuple[str, ...]
    gpus: int
    manifest_gpus: int  # the manifest's own mesh
    budget: int | None
    rows: tuple[QuantRow, ...]  # every fitting (format, layout), best first
    best: dict[str, QuantRow | None]  # each format's best row

    @property
    def has_fit(self) -> bool:
        return bool(self.rows)

    def fewer_gpus(self) -> list[str]:
        """One line per quantized format whose best layout needs fewer GPUs than the manifest's."""
        out = []
        for fmt, row in self.best.items():
            if (
                row is not None
                and FORMATS[fmt] != "none"
                and row.candidate.world < self.manifest_gpus
            ):
                out.append(
                    f"{fmt} fits on {row.candidate.world} GPU"
                    f"{'s' if row.candidate.world > 1 else ''} (mesh {row.candidate.mesh}), fewer "
                    f"than the manifest's {self.manifest_gpus}"
                )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": QUANT_SEARCH_SCHEMA,
            "formats": list(self.formats),
            "gpus": self.gpus,
            "manifest_gpus": self.manifest_gpus,
            "budget_bytes": self.budget,
            "fewer_gpus": self.fewer_gpus(),
            "best": {f: None if r is None else r.to_json() for f, r in self.best.items()},
            "rows": [r.to_json() for r in self.rows],
        }


def _with_format(manifest: Manifest, fmt: str) -> Manifest:
    from shardctl.plan.memory.spec import QuantSpec

    method = FORMATS[fmt]
    given = manifest.quantization
    if given is not None:
        # The manifest's keep_16bit and per-tensor overrides (bf16 attention, ...) stay part
        # of the priced model; the searched format replaces only the base method.
        spec = QuantSpec(method=method, keep_16bit=given.keep_16bit, overrides=given.overrides)
        keep = spec.method != "none" or bool(spec.overrides)
        return replace(manifest, quantization=spec if keep else None)
    return replace(manifest, quantization=None if method == "none" else QuantSpec(method=method))


def _weights(manifest: Manifest, model: ModelInfo, cand: Candidate) -> int:
    from shardctl.layout.types import Mesh
    from shardctl.plan.memory.adapter import plan_memory
    from shardctl.plan.weights import (
        engine_rules,
        options_for,
        served_model,
        served_rules,
        weights_per_coord,
    )

    mesh = Mesh(pp=cand.mesh.pp, dp=cand.mesh.dp, ep=cand.mesh.ep, tp=cand.mesh.tp)
    options = options_for(manifest.layout, mesh.pp)
    served = served_model(model, manifest.workload)
    own = served_rules(model, served, manifest.rules)
    rules = engine_rules(served, own, manifest.workload)
    stages, weights = weights_per_coord(
        served, mesh, rules=rules, options=options, quant=manifest.quantization
    )
    memory = plan_memory(manifest, served, mesh, stages, weights)
    return max(m.weights for m in memory.coords.values())


def search_formats(
    manifest_path: Path, formats: tuple[str, ...], *, gpus: int | None, top: int
) -> QuantSearchResult:
    """Every fitting layout of every format on ``gpus`` GPUs, ranked together."""
    from shardctl.manifest import load_manifest
    from shardctl.plan.api import load_model
    from shardctl.plan.memory.adapter import search_layouts

    manifest = load_manifest(manifest_path)
    if manifest.training is not None:
        raise UsageError("--quant searches inference formats; the manifest plans training")
    model = load_model(manifest)
    found: list[tuple[str, Candidate, Manifest]] = []
    budget = None
    searched = 0
    for fmt in formats:
        variant = _with_format(manifest, fmt)
        result = search_layouts(variant, model, gpus=gpus)
        budget, searched = result.budget, result.gpus
        found += [(fmt, c, variant) for c in result.candidates]
    # GPUs needed first, then headroom (largest first); formats in the order given break ties.
    found.sort(key=lambda x: (x[1].world, -(x[1].headroom or 0), formats.index(x[0])))
    rows: list[QuantRow] = []
    best: dict[str, QuantRow | None] = dict.fromkeys(formats)
    for fmt, cand, variant in found:
        first = best[fmt] is None
        if len(rows) >= top and not first:
            continue
        row = QuantRow(fmt, cand, _weights(variant, model, cand))
        if first:
            best[fmt] = row
        if len(rows) < top:
            rows.append(row)
    return QuantSearchResult(
        formats=formats,
        gpus=searched,
        manifest_gpus=manifest.mesh.world,
        budget=budget,
        rows=tuple(rows),
        best=best,
    )
