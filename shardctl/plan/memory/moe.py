"""Mixture of experts: total vs active parameters, and where experts sit.

Experts are split contiguously over ``ep`` (rank ``e`` holds experts
``e·E/ep … (e+1)·E/ep - 1``; Lepikhin et al. 2021, GShard), each expert's matrices further
over ``tp`` like a dense MLP (Megatron-LM expert tensor parallelism); the router ``[E, h]`` is
replicated. A token runs ``k`` of the ``E`` experts (Fedus et al. 2022; Jiang et al. 2024,
Mixtral: 46.7B total, 12.9B active with E = 8, k = 2).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, contains

from shardctl.layout.types import Stage
from shardctl.model.types import TensorInfo
from shardctl.plan.memory.shapes import ModelShape, stage_counts


@dataclass(frozen=True)
class MoeParams:
    total: int
    active: int  # per token: shared weights + k/E of the expert weights
    expert: int
    num_experts: int
    experts_per_token: int

    def to_json(self) -> dict[str, int]:
        return {
            "parameters_total": self.total,
            "parameters_active": self.active,
            "parameters_expert": self.expert,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
        }


def moe_params(shape: ModelShape, tensors: Sequence[TensorInfo] = ()) -> MoeParams:
    """Total and active parameters of the whole (unsharded) model.

    ``active = total - expert · (1 - k/E)``. With an inventory (``tensors``) the counts are
    its own: expert tensors are those under ``.experts.`` (per-expert or packed), so shared
    experts, dense layers and biases count as they are (the closed form assumes uniform MoE
    layers without them).
    """
    d = shape.dims
    e, k = d.num_experts, d.experts_per_token
    if tensors:
        # per (shape, expert or not) pair, not per tensor: 90,000 experts share a few shapes;
        # one C-level counting pass (C-speed hashing), multiplied out once per pair
        names = map(attrgetter("fqn"), tensors)
        experts = map(contains, names, repeat(".experts."))
        pairs = Counter(zip(map(attrgetter("shape"), tensors), experts, strict=True))
        total = sum(math.prod(s) * n for (s, _), n in pairs.items())
        expert = sum(math.prod(s) * n for (s, is_expert), n in pairs.items() if is_expert)
    else:
        c = stage_counts(shape, Stage(0, (0, d.num_layers - 1)), 1, 1, 1)
        total, expert = c.total, c.expert
    active = total - (expert - expert * k // e if e else 0)
    return MoeParams(total, active, expert, e, k)
