"""Properties of the memory model (hypothesis): never negative, monotone, consistent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.types import Mesh
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, TrainingSpec, Workload, estimate
from shardctl.plan.memory.activations import layer_activation_bytes, prefill_peak_bytes
from shardctl.plan.memory.kv import kv_bytes_per_token
from shardctl.plan.memory.shapes import split_layers

GIB = 2**30


@st.composite
def dims(draw: st.DrawFn) -> ModelDims:
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    experts = draw(st.sampled_from([0, 0, 4, 8]))
    return ModelDims(
        hidden_size=heads * head_dim,
        num_layers=draw(st.sampled_from([2, 4, 8])),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=draw(st.integers(64, 4096)),
        vocab_size=draw(st.integers(100, 50000)),
        tie_word_embeddings=draw(st.booleans()),
        num_experts=experts,
        experts_per_token=2 if experts else 0,
        gated_mlp=draw(st.booleans()),
    )


@given(
    dims(),
    st.integers(1, 64),
    st.integers(1, 4096),
    st.sampled_from([1, 2, 4, 8]),
    st.booleans(),
    st.sampled_from(["none", "selective", "full"]),
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_layer_activations_nonnegative_and_monotone(
    d: ModelDims, b: int, s: int, tp: int, sp: bool, rc: str, flash: bool
) -> None:
    kw = dict(tp=tp, sequence_parallel=sp, recompute=rc, flash_attention=flash)
    a = layer_activation_bytes(d, seq=s, batch=b, **kw)  # type: ignore[arg-type]
    assert a >= 0
    assert layer_activation_bytes(d, seq=s, batch=b + 1, **kw) >= a  # type: ignore[arg-type]
    assert layer_activation_bytes(d, seq=s + 1, batch=b, **kw) >= a  # type: ignore[arg-type]
    none = layer_activation_bytes(
        d, seq=s, batch=b, tp=tp, sequence_parallel=sp, flash_attention=flash
    )
    assert a <= none  # recompute never stores more


@given(dims(), st.integers(1, 64), st.integers(1, 8192), st.booleans())
@settings(max_examples=100, deadline=None)
def test_prefill_peak_monotone(d: ModelDims, b: int, s: int, flash: bool) -> None:
    a = prefill_peak_bytes(d, tokens=b * s, context=s, flash_attention=flash)
    assert 0 <= a <= prefill_peak_bytes(d, tokens=b * s + s, context=s + 1, flash_attention=flash)


@given(dims(), st.sampled_from([1, 2, 4, 8]))
def test_kv_per_rank_times_ranks_covers_the_model(d: ModelDims, tp: int) -> None:
    per_rank = kv_bytes_per_token(d, "BF16", tp=tp)
    whole = kv_bytes_per_token(d, "BF16")
    assert per_rank * tp >= whole  # equal unless K/V heads are replicated
    if tp <= d.num_kv_heads:
        assert per_rank * tp == whole


@given(
    dims(),
    st.integers(1, 32),
    st.integers(0, 4096),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2]),
)
@settings(max_examples=100, deadline=None)
def test_estimate_ranks_consistent(
    d: ModelDims, batch: int, seq: int, pp: int, tp: int, dp: int
) -> None:
    if d.num_heads % tp or (d.num_kv_heads % tp and tp % d.num_kv_heads):
        return
    model = ModelInfo("llama", d, (), "BF16", "inline")
    mesh = Mesh(pp=pp, tp=tp, dp=dp)
    stages = split_layers(d.num_layers, pp)
    hw = HardwareSpec(device_memory=80 * GIB)
    plan = estimate(
        model, mesh, stages, workload=Workload(batch_size=batch, sequence_length=seq), hardware=hw
    )
    ranks = plan.memory_per_rank()
    assert len(ranks) == mesh.world
    for m in ranks:
        assert all(v >= 0 for v in m.values())
        assert m["total"] == sum(v for k, v in m.items() if k != "total")
    # KV of one dp replica: every stage's share, summed over tp, covers the model's KV.
    replica = [plan.for_rank(mesh.rank(pp=p, tp=t)) for p in range(pp) for t in range(tp)]
    whole_kv = kv_bytes_per_token(d, "BF16") * -(-batch // dp) * seq
    assert sum(r.kv_cache for r in replica) >= whole_kv
    bigger = estimate(
        model,
        mesh,
        stages,
        workload=Workload(batch_size=batch + dp, sequence_length=seq),
        hardware=hw,
    )
    assert bigger.peak >= plan.peak


@given(
    st.integers(1, 8), st.sampled_from([0, 1, 2, 3]), st.sampled_from(["none", "selective", "full"])
)
@settings(max_examples=50, deadline=None)
def test_training_zero_stages_never_grow(dp: int, zero: int, rc: str) -> None:
    d = ModelDims(1024, 4, 8, 8, 128, 4096, 32000, False)
    model = ModelInfo("llama", d, (), "BF16", "inline")
    mesh = Mesh(dp=dp, pp=2)
    stages = split_layers(4, 2)
    tr = TrainingSpec(zero=zero, recompute=rc, sequence_length=512)
    plan = estimate(model, mesh, stages, training=tr)
    if zero < 3:
        more = estimate(
            model,
            mesh,
            stages,
            training=TrainingSpec(zero=zero + 1, recompute=rc, sequence_length=512),
        )
        m0, m1 = plan.coords[(0, 0, 0)], more.coords[(0, 0, 0)]
        assert m1.gradients + m1.optimizer <= m0.gradients + m0.optimizer
    # Stage 0 holds more micro-batches in flight than the last stage.
    tr2 = TrainingSpec(zero=zero, recompute=rc, sequence_length=512, grad_accumulation_steps=4)
    p2 = estimate(model, mesh, stages, training=tr2)
    d0 = p2.coords[(0, 0, 0)].detail["activations.in_flight"]
    d1 = p2.coords[(1, 0, 0)].detail["activations.in_flight"]
    assert (d0, d1) == (2, 1)
