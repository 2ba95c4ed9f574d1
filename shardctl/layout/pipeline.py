"""Pipeline stages: which decoder layers each ``pp`` rank holds, as one pure function.

Conventions for a layer count ``L`` that ``pp`` does not divide differ between engines; each is
reproduced from the engine's own source:

- ``even``: ``L % pp == 0`` required (torchtitan, and the common case).
- ``vllm``: ``vllm/distributed/utils.py::get_pp_indices`` — ``L // pp`` each, the remainder
  added one each to stages ``-2, -3, …`` (the last stage holds the norm and head, so it gets
  fewer; with remainder ``pp - 1`` the first stage gets one too). 30 / 4 → ``[7, 8, 8, 7]``.
- ``tensorrt-llm``: ``tensorrt_llm/mapping.py::Mapping.pp_layers`` —
  ``torch.tensor_split(arange(L), pp)``: the first ``L % pp`` stages get one extra layer.
  30 / 4 → ``[8, 8, 7, 7]``.
- ``megatron``: ``megatron/core/transformer/transformer_block.py::get_num_layers_to_build`` —
  ``num_layers % pipeline_model_parallel_size == 0`` is asserted; uneven splits need
  ``--decoder-first/last-pipeline-num-layers``, which ``layers_per_stage`` expresses here.

Explicit ``layers_per_stage`` wins over any convention. A stage may hold 0 layers (a stage of
only the embedding or only the head is a real pattern, e.g. torchtitan's module-per-stage
splits); the counts must sum to ``L``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shardctl.errors import LayoutError
from shardctl.layout.types import Stage

CONVENTIONS: tuple[str, ...] = ("even", "vllm", "tensorrt-llm", "megatron")
DIVISIBLE_ONLY: tuple[str, ...] = ("even", "megatron")  # they refuse L % pp != 0

# ``model.layers.{i}.`` (Llama family), ``transformer.h.{i}.`` / ``h.{i}.`` (GPT-2).
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def layer_index(fqn: str) -> int | None:
    """``model.layers.12.mlp.up_proj.weight`` → 12; ``model.norm.weight`` → None."""
    m = _LAYER.search(fqn)
    return int(m.group(1)) if m else None


def assign_layers(
    num_layers: int,
    pp: int,
    convention: str = "even",
    layers_per_stage: Sequence[int] | None = None,
) -> tuple[Stage, ...]:
    """Split ``num_layers`` decoder layers into ``pp`` contiguous stages.

    >>> [s.layers for s in assign_layers(30, 4, "vllm")]
    [(0, 6), (7, 14), (15, 22), (23, 29)]
    """
    if pp < 1:
        raise LayoutError(f"pp={pp} must be >= 1", where="mesh.pp")
    if layers_per_stage is not None:
        counts = _explicit(num_layers, pp, layers_per_stage)
    else:
        if convention not in CONVENTIONS:
            raise LayoutError(
                f"unknown convention {convention!r}",
                where="pipeline.convention",
                hint=f"use one of {', '.join(CONVENTIONS)}",
            )
        if pp > max(num_layers, 1):
            raise LayoutError(
                f"pp={pp} is larger than num_layers={num_layers}: some stage would hold no layer",
                where="mesh.pp",
                hint=f"use pp <= {num_layers}, or give pipeline.layers_per_stage explicitly",
            )
        counts = _by_convention(num_layers, pp, convention)
    return _stages(counts)


def _by_convention(num_layers: int, pp: int, convention: str) -> list[int]:
    base, rem = divmod(num_layers, pp)
    if rem == 0:
        return [base] * pp
    if convention == "vllm":
        counts = [base] * pp
        for i in range(2, rem + 2):
            counts[-i] += 1
        return counts
    if convention == "tensorrt-llm":
        return [base + 1 if i < rem else base for i in range(pp)]
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    alternatives = (
        f"vllm gives {_by_convention(num_layers, pp, 'vllm')}, "
        f"tensorrt-llm gives {_by_convention(num_layers, pp, 'tensorrt-llm')}"
    )
    megatron_like = megatron_suggestion(num_layers, pp)
    assert convention in DIVISIBLE_ONLY, convention
    if convention == "megatron":
        raise LayoutError(
            f"Megatron requires num_layers % pp == 0; num_layers={num_layers}, pp={pp} "
            f"leaves {rem}",
            where="pipeline",
            hint=(
                f"use pp in {_fmt(divisors)}, or layers_per_stage {megatron_like} "
                f"(= --decoder-last-pipeline-num-layers {megatron_like[-1]})"
            ),
        )
    raise LayoutError(
        f"num_layers={num_layers} is not divisible by pp={pp} (remainder {rem})",
        where="pipeline",
        hint=(
            f"use pp in {_fmt(divisors)}, or pipeline.convention vllm | tensorrt-llm "
            f"({alternatives}), or layers_per_stage e.g. {megatron_like}"
        ),
    )


def megatron_suggestion(num_layers: int, pp: int) -> list[int]:
    """An uneven split Megatron can express: equal stages, a smaller last one (holds the head)."""
    per = math.ceil(num_layers / pp)
    if num_layers - (pp - 1) * per < 0:
        per = num_layers // pp
    return [per] * (pp - 1) + [num_layers - (pp - 1) * per]


def _explicit(num_layers: int, pp: int, counts: Sequence[int]) -> list[int]:
    where = "pipeline.layers_per_stage"
    if len(counts) != pp:
        raise LayoutError(
            f"{len(counts)} entries {list(counts)} for pp={pp}",
            where=where,
            hint=f"give exactly {pp} layer counts summing to {num_layers}",
        )
    if any(c < 0 for c in counts):
        raise LayoutError(f"negative layer count in {list(counts)}", where=where)
    if sum(counts) != num_layers:
        raise LayoutError(
            f"{list(counts)} sums to {sum(counts)}, expected num_layers={num_layers}",
            where=where,
            hint=f"adjust the counts by {num_layers - sum(counts):+d} in total",
        )
    return list(counts)


def _stages(counts: Sequence[int]) -> tuple[Stage, ...]:
    stages: list[Stage] = []
    start = 0
    for i, c in enumerate(counts):
        stages.append(Stage(i, (start, start + c - 1) if c else None))
        start += c
    return tuple(stages)


def stage_of_layers(stages: Sequence[Stage], num_layers: int) -> list[int]:
    """Layer index → stage index, as a list (``out[12] == 1``)."""
    out = [0] * num_layers
    for s in stages:
        if s.layers is not None:
            for i in range(s.layers[0], s.layers[1] + 1):
                out[i] = s.index
    return out


def _fmt(values: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"
