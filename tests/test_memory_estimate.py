"""estimate(): components per rank, MoE, quantization, bare counts, the manifests, pictures."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.errors import InvalidInputError, UsageError
from shardctl.layout.types import Mesh
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import (
    HardwareSpec,
    OverheadSpec,
    QuantSpec,
    TrainingSpec,
    Workload,
    estimate,
    zero_stage,
)
from shardctl.plan.memory.moe import moe_params
from shardctl.plan.memory.shapes import ModelShape, split_layers
from shardctl.plan.report import bars, html_report, stage_balance, svg, write_report

GIB = 2**30
L8B = ModelInfo(
    "llama", ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False), (), "BF16", "inline"
)
MIXTRAL = ModelDims(4096, 32, 32, 8, 128, 14336, 32000, False, 8, 2)
ROOT = Path(__file__).resolve().parent.parent


def test_llama3_8b_weights_exact() -> None:
    plan = estimate(L8B, Mesh(), split_layers(32, 1), workload=Workload(sequence_length=0))
    assert plan.coords[(0, 0, 0)].weights == 16_060_522_496  # issue 2's golden figure
    assert plan.coords[(0, 0, 0)].kv_cache == plan.coords[(0, 0, 0)].activations == 0


def test_engine_bytes_win_when_given() -> None:
    plan = estimate(L8B, Mesh(), split_layers(32, 1), weights_per_coord={(0, 0, 0): 123})
    assert plan.coords[(0, 0, 0)].weights == 123


def test_overhead_named_and_overridable() -> None:
    ovh = OverheadSpec(cuda_context=0, nccl_buffers=0, framework=0, fragmentation=0.0, reserved=GIB)
    plan = estimate(
        L8B, Mesh(), split_layers(32, 1), overhead=ovh, workload=Workload(sequence_length=0)
    )
    r = plan.coords[(0, 0, 0)]
    assert r.overhead == GIB and r.detail["overhead.reserved"] == GIB
    with pytest.raises(InvalidInputError, match=r"overhead\.fragmentation"):
        OverheadSpec(fragmentation=1.5)


def test_kv_capacity_reported() -> None:
    hw = HardwareSpec.preset("h100-sxm")
    plan = estimate(
        L8B,
        Mesh(),
        split_layers(32, 1),
        hardware=hw,
        workload=Workload(batch_size=8, sequence_length=8192),
    )
    kv = plan.to_json()["kv_cache"]
    assert kv["bytes_per_token"] == 131072  # 2 · 32 · 8 · 128 · 2
    assert kv["max_batch"] >= 8 and kv["max_sequence_length"] >= 8192
    assert kv["capacity_tokens_per_rank"] == kv["max_batch"] * 8192 + (
        kv["capacity_tokens_per_rank"] % 8192
    )


def test_quantization_keeps_embeddings_and_head() -> None:
    base = estimate(L8B, Mesh(), split_layers(32, 1), workload=Workload(sequence_length=0))
    q = estimate(
        L8B,
        Mesh(),
        split_layers(32, 1),
        quant=QuantSpec(method="awq"),
        workload=Workload(sequence_length=0),
    )
    emb_head = 2 * 128256 * 4096 * 2
    linear = base.coords[(0, 0, 0)].weights - emb_head - (65 * 4096 * 2)
    got = q.coords[(0, 0, 0)].weights
    n = linear // 2  # bf16 bytes -> parameters; AWQ: n/2 + 2n/128 + n/256
    assert got == pytest.approx(emb_head + 65 * 4096 * 2 + n / 2 + 2.5 * n / 128, rel=1e-6)
    all_q = estimate(
        L8B,
        Mesh(),
        split_layers(32, 1),
        quant=QuantSpec(method="awq", keep_16bit=()),
        workload=Workload(sequence_length=0),
    )
    assert all_q.coords[(0, 0, 0)].weights < got


def test_moe_total_active_and_expert_parallel() -> None:
    shape = ModelShape(MIXTRAL)
    p = moe_params(shape)
    assert round(p.total / 1e9, 1) == 46.7 and round(p.active / 1e9, 1) == 12.9  # Mixtral
    model = ModelInfo("mixtral", MIXTRAL, (), "BF16", "inline")
    one = estimate(model, Mesh(), split_layers(32, 1), workload=Workload(sequence_length=0))
    ep4 = estimate(model, Mesh(ep=4), split_layers(32, 1), workload=Workload(sequence_length=0))
    expert_bytes = p.expert * 2
    assert one.coords[(0, 0, 0)].weights - ep4.coords[(0, 0, 0)].weights == expert_bytes * 3 // 4


def test_bare_parameter_count_zero_paper_style() -> None:
    model = ModelInfo("unknown", None, (), "BF16", "parameters", parameter_count=7_500_000_000)
    tr = TrainingSpec(zero=3)
    plan = estimate(
        model, Mesh(dp=64), split_layers(1, 1), training=tr, overhead=OverheadSpec(0, 0, 0, 0, 0.0)
    )
    r = plan.coords[(0, 0, 0)]
    assert r.activations == 0 and r.total == pytest.approx(1.875e9, rel=1e-6)


def test_training_offload_and_host_per_node() -> None:
    tr = TrainingSpec(zero=3, offload_optimizer="cpu", offload_params="nvme", sequence_length=1024)
    plan = estimate(L8B, Mesh(dp=8), split_layers(32, 1), training=tr)
    r = plan.coords[(0, 0, 0)]
    assert r.optimizer == 0 and r.host > 0 and r.nvme > 0
    per_node = plan.host_bytes_per_node()
    assert per_node["host_memory"] == 8 * r.host


def test_validation_errors() -> None:
    with pytest.raises(InvalidInputError, match=r"training\.zero"):
        TrainingSpec(zero=4)
    with pytest.raises(InvalidInputError, match="needs ZeRO stage 3"):
        TrainingSpec(zero=2, offload_params="cpu")
    with pytest.raises(InvalidInputError, match="global_batch_size"):
        TrainingSpec(global_batch_size=10, micro_batch_size=4).grad_accumulation(1)
    assert zero_stage("FULL_SHARD") == 3 and zero_stage("zero-2") == 2
    with pytest.raises(InvalidInputError, match=r"quantization\.method"):
        QuantSpec(method="int3")


def test_stage_imbalance_warning() -> None:
    tr = TrainingSpec(sequence_length=4096, grad_accumulation_steps=8)
    plan = estimate(L8B, Mesh(pp=4), split_layers(32, 4), training=tr)
    assert plan.load_balance() > 1.1
    assert any("stage 0" in w for w in plan.warnings())
    ratio, warnings = stage_balance(bars(plan))
    assert ratio == pytest.approx(plan.load_balance()) and warnings


def test_report_svg_and_html(tmp_path: Path) -> None:
    plan = estimate(
        L8B,
        Mesh(pp=2, tp=2),
        split_layers(32, 2),
        hardware=HardwareSpec.preset("h100-sxm"),
        workload=Workload(batch_size=4, sequence_length=4096),
    )
    text = svg(plan)
    assert text.startswith("<svg") and text.count("<rect") > 4 and "load balance" in text
    assert "<svg" in html_report(plan)
    write_report(plan, tmp_path / "plan.svg")
    write_report(plan, tmp_path / "plan.html")
    assert (tmp_path / "plan.svg").read_text().startswith("<svg")
    with pytest.raises(UsageError, match="svg or"):
        write_report(plan, tmp_path / "plan.png")


def test_terminal_bars_render() -> None:
    from rich.console import Console

    from shardctl.plan.report import render_bars

    plan = estimate(
        L8B,
        Mesh(pp=2),
        split_layers(32, 2),
        hardware=HardwareSpec.preset("h100-sxm"),
        workload=Workload(batch_size=4, sequence_length=4096),
    )
    console = Console(record=True, width=120)
    render_bars(plan, console=console)
    out = console.export_text()
    assert "rank 0" in out and "rank 1" in out and "load balance" in out


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "manifests").glob("*.yaml")))
def test_bundled_manifests_plan_and_search(name: str) -> None:
    from shardctl.layout.engine import rank_weight_bytes
    from shardctl.manifest import load_manifest
    from shardctl.plan.api import load_model
    from shardctl.plan.memory.adapter import memory_per_rank, search_layouts

    man = load_manifest(ROOT / "manifests" / name)
    model = load_model(man)
    assert model.dims is not None
    weights = rank_weight_bytes(model, man.mesh, rules=man.rules, options=man.layout)
    stages = split_layers(
        model.dims.num_layers, man.mesh.pp, man.layout.pipeline, man.layout.layers_per_stage
    )
    per_rank, extra = memory_per_rank(man, model, man.mesh, stages, weights)
    assert len(per_rank) == man.mesh.world
    assert {"memory_model", "communication"} <= set(extra)
    for m in per_rank.values():
        assert m["total"] == sum(v for k, v in m.items() if k != "total") > 0
    result = search_layouts(man, model, gpus=None)
    assert result.priced > 0
