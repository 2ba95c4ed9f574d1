"""Layout search: rejection reasons, counts, ordering, agreement with estimate()."""

from __future__ import annotations

import pytest

from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, TrainingSpec, Workload, estimate
from shardctl.plan.memory.shapes import split_layers
from shardctl.plan.search import SearchOptions, _triples, search

GIB = 2**30
# Llama-3.1-405B's dims.
D405 = ModelDims(16384, 126, 128, 8, 128, 53248, 128256, False)
M405 = ModelInfo("llama", D405, (), "BF16", "inline")
MOE = ModelInfo(
    "mixtral", ModelDims(4096, 32, 32, 8, 128, 14336, 32000, False, 8, 2), (), "BF16", "inline"
)


def test_triples_counts_every_tuple() -> None:
    n = 24
    brute = sum(
        1
        for a in range(1, n + 1)
        for b in range(1, n + 1)
        for c in range(1, n + 1)
        if a * b * c <= n
    )
    assert _triples(n) == brute


def test_every_tuple_is_counted_once() -> None:
    n = 64
    hw = HardwareSpec.preset("h100-sxm", nodes=8)
    r = search(
        M405,
        options=SearchOptions(gpus=n),
        hardware=hw,
        workload=Workload(batch_size=4, sequence_length=4096),
    )
    quads = sum(
        1
        for tp in range(1, n + 1)
        for pp in range(1, n + 1)
        for ep in range(1, n + 1)
        for dp in range(1, n + 1)
        if tp * pp * ep * dp <= n
    )
    valid_priced = r.priced
    assert sum(r.rejected.values()) - r.rejected.get("does_not_fit", 0) + valid_priced == quads


def test_rejection_reasons_405b() -> None:
    hw = HardwareSpec.preset("h100-sxm", nodes=128)
    r = search(
        M405,
        options=SearchOptions(gpus=1024),
        hardware=hw,
        workload=Workload(batch_size=32, sequence_length=8192),
    )
    for reason in (
        "tp_across_nodes",
        "tp_splits_node",
        "pp_above_layers",
        "layers_not_divisible",
        "no_experts",
        "dp_above_batch",
        "does_not_fit",
    ):
        assert r.rejected[reason] > 0, reason
    assert r.has_fit
    # tp 3, 5, 6, 7 do not divide 8 GPUs per node; tp 16 is beyond a node.
    assert all(c.mesh.tp in (1, 2, 4, 8) for c in r.candidates)
    assert all(126 % c.mesh.pp == 0 for c in r.candidates)
    # Default objective: fewest GPUs first, then the most headroom.
    keys = [(c.world, -(c.headroom or 0)) for c in r.candidates]
    assert keys == sorted(keys)
    # 405B in bf16 needs more than 810 GB / 80 GiB ≈ 10 GPUs.
    assert r.candidates[0].world >= 11


def test_heads_and_experts_reasons() -> None:
    hw = HardwareSpec(device_memory=80 * GIB, gpus_per_node=16)
    d = ModelDims(3072, 32, 24, 6, 128, 8192, 32000, False, 6, 2)
    r = search(
        ModelInfo("mixtral", d, (), "BF16", "inline"),
        options=SearchOptions(gpus=16),
        hardware=hw,
        workload=Workload(batch_size=64, sequence_length=1024),
    )
    assert r.rejected["kv_heads_not_divisible"] > 0  # tp = 4: 4 ∤ 6 and 6 ∤ 4
    assert r.rejected["experts_not_divisible"] > 0  # ep = 4 ∤ 6
    assert {c.mesh.ep for c in r.candidates} <= {1, 2, 3, 6}


def test_heads_not_divisible() -> None:
    d = ModelDims(960, 4, 12, 4, 80, 2048, 32000, False)
    r = search(
        ModelInfo("llama", d, (), "BF16", "inline"),
        options=SearchOptions(gpus=8),
        hardware=HardwareSpec(device_memory=80 * GIB),
        workload=Workload(batch_size=1, sequence_length=128),
    )
    assert r.rejected["heads_not_divisible"] > 0  # tp = 8 ∤ 12


def test_tp_across_nodes_allowed() -> None:
    hw = HardwareSpec(device_memory=80 * GIB, gpus_per_node=8, nodes=4)
    allowed = search(
        M405,
        options=SearchOptions(gpus=32, allow_tp_across_nodes=True),
        hardware=hw,
        workload=Workload(batch_size=1, sequence_length=1024),
    )
    assert "tp_across_nodes" not in allowed.rejected
    assert any(c.mesh.tp == 16 for c in allowed.candidates)


def test_candidate_peak_equals_estimate() -> None:
    hw = HardwareSpec.preset("h100-sxm", nodes=4)
    tr = TrainingSpec(global_batch_size=64, sequence_length=2048, sequence_parallel=True)
    d = ModelDims(8192, 80, 64, 8, 128, 28672, 128256, False)
    model = ModelInfo("llama", d, (), "BF16", "inline")
    r = search(model, options=SearchOptions(gpus=32), hardware=hw, training=tr)
    assert r.has_fit and r.rejected["batch_not_divisible"] > 0
    for c in r.candidates[:20]:
        t = TrainingSpec(
            global_batch_size=64,
            sequence_length=2048,
            sequence_parallel=True,
            zero=c.zero or 0,
            recompute=c.recompute or "none",
        )
        plan = estimate(model, c.mesh, split_layers(80, c.mesh.pp), training=t, hardware=hw)
        assert plan.peak == c.peak


def test_json_has_all_candidates_and_reasons() -> None:
    r = search(
        MOE,
        options=SearchOptions(gpus=16),
        hardware=HardwareSpec.preset("h100-sxm", nodes=2),
        workload=Workload(batch_size=16, sequence_length=4096),
    )
    js = r.to_json()
    assert js["fitting"] == len(js["candidates"]) == len(r.candidates)
    assert set(js["rejected"]) == set(r.rejected)
    assert {"mesh", "gpus", "peak_bytes", "headroom_bytes", "comm_time_s"} <= set(
        js["candidates"][0]
    )


def test_bad_objective() -> None:
    from shardctl.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="objective"):
        SearchOptions(gpus=8, objective="speed")
