"""``workload.engine: sglang`` and ``trtllm`` against the engines' own start-up logs.

Issue 15's rule: within 3 % of the engine's figure, never "fits" where the engine refused.
SGLang's constants (init memory, load extra) were read from the two Llama-3.1-8B logs below, so
those rows pin the accounting rather than predict it. The Qwen3-235B-A22B-FP8 TP4 H100 row is
out of sample with one disclosure: it missed by +7.6 % with the L4's distributed-init figure
(0.13 GiB), the gap pointed at ~1.25 GiB more before the pool, and the H100 figure then used
(1.25 GiB) was searched for knowing that — it is read from a different run (SGLang 0.5.2rc2,
Grok-2 on 8×H100, "Init torch distributed ends. mem usage=1.25 GB"), not fitted to this row.
TensorRT-LLM: the one public log with the profile's own figures is checked for the sizing
arithmetic; no log with a known model, GPU and settings was found for a full prediction
(docs/memory-model.md says so).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.layout.types import Mesh
from shardctl.model.types import ModelDims, ModelInfo
from shardctl.plan.memory import HardwareSpec, MemoryPlan, Workload, estimate
from shardctl.plan.memory.kv import KvCapacity
from shardctl.plan.memory.sglang import default_mem_fraction_static
from shardctl.plan.memory.shapes import split_layers
from shardctl.plan.memory.trtllm import max_kv_tokens
from tests._cli import run_cli as _cli

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# meta-llama/Llama-3.1-8B-Instruct config.json (the Meta-Llama-3-8B shapes, 128,256 vocab).
LLAMA31_8B = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False)
H100 = HardwareSpec.preset("h100-sxm")


def _plan(
    engine: str, *, tp: int = 1, batch: int = 1, length: int = 8192, **kw: object
) -> MemoryPlan:
    model = ModelInfo("llama", LLAMA31_8B, (), "BF16", "inline")
    w = Workload(batch_size=batch, sequence_length=length, engine=engine, **kw)  # type: ignore[arg-type]
    return estimate(model, Mesh(tp=tp), split_layers(32, 1), hardware=H100, workload=w)


def _capacity(plan: MemoryPlan) -> KvCapacity:
    assert plan.kv is not None and plan.kv.capacity is not None
    return plan.kv.capacity


def _within(ours: float, published: float, tol: float = 0.03) -> None:
    assert abs(ours - published) <= tol * published, f"{ours} vs {published}"


# -- SGLang ----------------------------------------------------------------------------------


def test_sglang_llama31_8b_h100_pr4760() -> None:
    # sgl-project/sglang PR #4760 (2025-03-25), Meta-Llama-3.1-8B-Instruct on one H100, default
    # mem_fraction_static: "Load weight end. … avail mem=63.48 GB, mem usage=15.11 GB",
    # "KV Cache is allocated. #tokens: 442750, K size: 27.02 GB, V size: 27.02 GB".
    plan = _plan("sglang")
    cap = _capacity(plan)
    _within(cap.tokens, 442_750)
    _within(cap.kv_bytes, 2 * 27.02 * GIB)
    assert cap.engine_units() == {"max_total_num_tokens": cap.tokens}
    assert plan.fits is True


def test_sglang_llama31_8b_h100_docs_log() -> None:
    # SGLang documentation, "Sending Requests" notebook output (run 2025-01-23), the same model,
    # defaults, on an 80 GB GPU whose free memory before loading was 78.81 GB (an H100: 79.22 GiB):
    # "Load weight end. … avail mem=63.72 GB", "max_total_num_tokens=444500".
    _within(_capacity(_plan("sglang")).tokens, 444_500)


def test_sglang_default_fraction_is_sglangs_by_tp() -> None:
    # python/sglang/srt/server_args.py, ServerArgs.__post_init__ (0.4.x).
    assert [default_mem_fraction_static(t) for t in (1, 2, 4, 8, 16)] == [
        0.88, 0.87, 0.85, 0.81, 0.79,
    ]  # fmt: skip
    assert _plan("sglang", tp=4).inputs["mem_fraction_static"] == 0.85
    assert _plan("sglang", mem_fraction_static=0.5).inputs["mem_fraction_static"] == 0.5


def test_sglang_fraction_moves_the_pool_as_sglang_computes_it() -> None:
    # rest = (device − init) × fraction − weights − load_extra: 0.1 of the fraction is 0.1 ×
    # (device − init) bytes of pool, to the token.
    a, b = (
        _capacity(_plan("sglang", mem_fraction_static=0.8)),
        _capacity(_plan("sglang", mem_fraction_static=0.9)),
    )
    plan = _plan("sglang")
    assert plan.device_memory is not None  # the size CUDA reports (79.22 GiB), not 80
    free = plan.device_memory - plan.coords[(0, 0, 0)].detail["overhead.init"]
    assert abs((b.tokens - a.tokens) * 131072 - 0.1 * free) <= 2 * 131072


@given(batch=st.integers(1, 64), length=st.integers(1, 300_000), tp=st.sampled_from([1, 2, 4]))
@settings(max_examples=40, deadline=None)
def test_sglang_verdict_is_the_token_pool(batch: int, length: int, tp: int) -> None:
    plan = _plan("sglang", tp=tp, batch=batch, length=length)
    assert plan.fits == (batch * length <= _capacity(plan).tokens)


def test_sglang_qwen3_235b_fp8_tp4_h100() -> None:
    # vLLM issue #21348 (MMuzzammil1, 2025-07-22): Qwen3-235B-A22B-FP8, 4xH100, `--tp 4
    # --mem-fraction-static 0.93`: "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB".
    # shardctl: 371,927 (+1.2 %). Until the H100 distributed-init figure (1.25 GiB, read from a
    # Grok-2 TP8 log, module docstring) replaced the L4's 0.13, this row was +7.6 % (xfail).
    done = _cli("plan", str(ROOT / "manifests/qwen3-235b-a22b-fp8-sglang-tp4.yaml"), "--json")
    assert done.returncode == 0, done.stderr
    kv = json.loads(done.stdout)["kv_cache"]
    assert kv["engine_units"]["max_total_num_tokens"] == kv["capacity_tokens_per_rank"]
    _within(kv["capacity_tokens_per_rank"], 367_404)


# QwQ-32B (Qwen/QwQ-32B config.json: the Qwen2.5-32B shapes) as didier-durand/llms-in-clouds
# ran it (docs, 2025-03-08): SGLang 0.4.3.post4, 4×L4 (g6.12xlarge), --tensor-parallel-size 4,
# default mem_fraction_static (0.85 in its server_args log). The L4's CUDA-reported size is not
# in the log, so the device is set to the log's free memory before loading (21.63 GB) plus the
# profile's init (0.35 + 0.13 GiB): this row checks weights, fraction and load extra only.
QWQ = """
model: {model_type: qwen2, architectures: [Qwen2ForCausalLM], hidden_size: 5120,
        intermediate_size: 27648, num_hidden_layers: 64, num_attention_heads: 40,
        num_key_value_heads: 8, vocab_size: 152064, max_position_embeddings: 131072,
        tie_word_embeddings: false, torch_dtype: bfloat16}
mesh: {tp: 4}
hardware: {device_memory: 23740431729}
workload: {engine: sglang, sequence_length: 32768}
"""


def test_sglang_qwq_32b_tp4_l4(tmp_path: Path) -> None:
    # "Load weight end. … avail mem=6.09 GB, mem usage=15.54 GB", "KV Cache is allocated.
    # #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB", "max_total_num_tokens=46611".
    path = tmp_path / "qwq.yaml"
    path.write_text(QWQ)
    done = _cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["memory_model"]["inputs"]["mem_fraction_static"] == 0.85  # SGLang's at tp 4
    # Loading took 0.28 GiB over the weights' 15.26 where Llama-3.1-8B's logs show 0.06-0.15:
    # the caching allocator's segments (SGLang reads free memory, so reserved bytes count).
    # Per layer at tp 4: qkv [1792, 5120] 17.5 MiB in an 18 MiB segment, o_proj 12.5 in 14,
    # gate_up 135 in 136, down 67.5 in 68 (3.5 MiB); embedding and head 371.25 in 372 each;
    # biases and norms (1,550,336 B) in one 2 MiB small segment. 0.22 GiB, plus the profile's
    # 0.13: 46,611 logged, 45,498 priced (-2.4 %); +5.4 % (xfail) before this term.
    detail = doc["memory_model"]["detail_per_stage"][0]
    assert detail["overhead.allocator"] == 64 * 7 * 2**19 + 3 * 2**19 + 2 * 2**20 - 1_550_336
    _within(doc["kv_cache"]["capacity_tokens_per_rank"], 46_611)


# -- TensorRT-LLM ----------------------------------------------------------------------------


def test_trtllm_sizing_arithmetic_reproduces_its_log() -> None:
    # A public TensorRT-LLM log (PyTorch backend, 2025-12-20): "Peak memory during memory usage
    # profiling (torch + non-torch): 113.65 GiB, available KV cache memory when calculating max
    # tokens: 5.95 GiB, fraction is set 0.8999999761581421, kv size is 73728. device total memory
    # 119.70 GiB, , tmp kv_mem 0.56 GiB", then "Number of tokens per block: 32." and "Allocated
    # 5.95 GiB for max tokens in paged KV cache (86720)". This checks the sizing step only: the
    # peak is the log's own measurement.
    avail, tokens = max_kv_tokens(
        total=round(119.70 * GIB), peak=round(113.65 * GIB), tmp_kv=round(0.56 * GIB),
        fraction=0.8999999761581421, per_token=73728, tokens_per_block=32,
    )  # fmt: skip
    assert round(avail / GIB, 2) == 5.95
    _within(tokens, 86_720, tol=0.001)
    assert tokens % 32 == 0


def test_trtllm_engine_path_log_is_the_same_fraction() -> None:
    # NVIDIA/TensorRT-LLM issue #4275 (comment of 2025-06, TensorRT-LLM 0.19.0 in Triton, RTX
    # 5090, Llama-3.1-8B-Instruct FP8 with FP8 KV: 2·32·8·128 = 65,536 B per token):
    # "Memory usage when calculating max tokens in paged kv cache: total: 31.84 GiB, available:
    # 17.83 GiB", "Number of tokens per block: 32.", "Allocated 16.05 GiB for max tokens in
    # paged KV cache (263008)". The TensorRT-engine path keeps the same 0.9 of what is free;
    # again the sizing step only (the free memory is the log's).
    avail, tokens = max_kv_tokens(
        total=round(31.84 * GIB), peak=round((31.84 - 17.83) * GIB), tmp_kv=0,
        fraction=0.9, per_token=65536, tokens_per_block=32,
    )  # fmt: skip
    assert round(avail / GIB, 2) == 16.05
    _within(tokens, 263_008, tol=0.001)  # 262,944: the log's 2-decimal GiB leave ±3 blocks


def test_trtllm_kv_is_the_fraction_of_what_the_profile_left() -> None:
    plan = _plan("trtllm")
    r = plan.coords[(0, 0, 0)]
    cap = _capacity(plan)
    used = r.weights + r.activations + r.detail["overhead.non_torch"]
    # KV = 0.9 × (device − weights − activation peak − non-torch), in whole tokens, up to 32s
    assert plan.device_memory is not None
    expected = int((plan.device_memory - used) * 0.9) // 131072
    assert cap.tokens == -(-expected // 32) * 32
    assert cap.engine_units()["tokens_per_block"] == 32
    assert plan.inputs["free_gpu_memory_fraction"] == 0.9
    assert r.activations == r.detail["activations.profile_peak"] > 0  # 8192-token dummy run


def test_trtllm_fraction_and_block_are_settable() -> None:
    half = _capacity(_plan("trtllm", free_gpu_memory_fraction=0.45, tokens_per_block=64))
    full = _capacity(_plan("trtllm"))
    assert half.block_size == 64 and half.tokens % 64 == 0
    _within(half.tokens, full.tokens / 2, tol=0.001)


@given(batch=st.integers(1, 64), length=st.integers(1, 300_000))
@settings(max_examples=30, deadline=None)
def test_trtllm_verdict_is_the_paged_cache(batch: int, length: int) -> None:
    plan = _plan("trtllm", batch=batch, length=length)
    per_seq = -(-length // 32) * 32
    cap = _capacity(plan)
    # the verdict counts whole blocks per sequence against the fraction's bytes; the capacity
    # rounds the last partial block up, as TensorRT-LLM does: they differ by under one block
    if plan.fits:
        assert batch * per_seq <= cap.tokens
    else:
        assert batch * per_seq > cap.tokens - 32


# -- manifest and refusals -------------------------------------------------------------------


MANIFEST = """
model: {model_type: llama, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32,
        num_attention_heads: 32, num_key_value_heads: 8, vocab_size: 128256,
        tie_word_embeddings: false, torch_dtype: bfloat16}
mesh: {tp: 1}
hardware: {gpu: h100-sxm}
workload: {engine: %s, sequence_length: 8192%s}
"""


def test_manifest_engines_print_their_own_units(tmp_path: Path) -> None:
    for engine, extra, unit in (
        ("sglang", ", mem_fraction_static: 0.88", "max_total_num_tokens"),
        ("trtllm", ", free_gpu_memory_fraction: 0.9, tokens_per_block: 32",
         "max_tokens_in_paged_kv_cache"),
    ):  # fmt: skip
        path = tmp_path / f"{engine}.yaml"
        path.write_text(MANIFEST % (engine, extra))
        done = _cli("plan", str(path), "--json")
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["kv_cache"]["engine_units"][unit] == doc["kv_cache"]["capacity_tokens_per_rank"]
        text = _cli("plan", str(path))
        assert unit.replace("_", " ") in text.stdout.replace("_", " ").lower()


def test_manifest_bad_fraction_is_one_line_exit_3(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(MANIFEST % ("sglang", ", mem_fraction_static: 1.5"))
    done = _cli("plan", str(path))
    assert done.returncode == 3
    assert "mem_fraction_static" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serving_engines_refuse_training() -> None:
    model = ModelInfo("llama", LLAMA31_8B, (), "BF16", "inline")
    from shardctl.errors import InvalidInputError
    from shardctl.plan.memory import TrainingSpec

    for engine in ("sglang", "trtllm"):
        with pytest.raises(InvalidInputError, match="inference only"):
            estimate(model, Mesh(), split_layers(32, 1), hardware=H100,
                     workload=Workload(sequence_length=2048, engine=engine),
                     training=TrainingSpec(sequence_length=2048))  # fmt: skip


def test_search_prices_serving_engines_as_plan_does(tmp_path: Path) -> None:
    # 60 × 8,192 = 491,520 tokens > SGLang's 442,914 on one H100: plan exits 1; the search over
    # 2 GPUs keeps only layouts that plan itself says fit, under the same budget.
    path = tmp_path / "s.yaml"
    path.write_text(
        (MANIFEST % ("sglang", ", batch_size: 60")).replace(
            "{gpu: h100-sxm}", "{gpu: h100-sxm, gpus_per_node: 2}"
        )
    )
    plan = _cli("plan", str(path), "--json")
    assert plan.returncode == 1
    search = json.loads(_cli("plan", str(path), "--search", "--gpus", "2", "--json").stdout)
    assert search["budget_bytes"] == json.loads(plan.stdout)["budget_bytes"]
    meshes = [c["mesh"] for c in search["candidates"]]
    assert {"pp": 1, "dp": 1, "tp": 1, "ep": 1} not in meshes and meshes
    for mesh in meshes:
        one = _cli("plan", str(path), "--tp", str(mesh["tp"]), "--pp", str(mesh["pp"]),
                   "--dp", str(mesh["dp"]), "--json")  # fmt: skip
        assert one.returncode == 0, (mesh, one.stderr)


def test_sglang_05_default_fraction_follows_gpu_memory(tmp_path: Path) -> None:
    # SGLang >= 0.5.3 (PR #10975, server_args._handle_gpu_memory_settings): H100 bucket, 8k
    # chunk, 256 graphs at tp 1: reserved = 512 + 12,288 + 512 + 128 = 13,440 MiB of the
    # device's 81,117 MiB (79.216 GiB as CUDA reports it) → round(67,677 / 81,117, 3) = 0.834.
    plan = _plan("sglang", sglang_version="0.5")
    assert plan.inputs["mem_fraction_static"] == 0.834
    # tp 8: 512 graphs, 1,024 MiB for tp/8 → 14,848 MiB reserved → 0.817
    assert _plan("sglang", tp=8, sglang_version="0.5").inputs["mem_fraction_static"] == 0.817
    # the newer default leaves less for the pool than 0.4's 0.88
    assert _capacity(plan).tokens < _capacity(_plan("sglang")).tokens
    # the manifest key, written as a plain number
    path = tmp_path / "v.yaml"
    path.write_text(MANIFEST % ("sglang", ", sglang_version: 0.5"))
    done = _cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["memory_model"]["inputs"]["mem_fraction_static"] == 0.834
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST % ("sglang", ", sglang_version: 0.6"))
    done = _cli("plan", str(bad))
    assert done.returncode == 3 and "sglang_version" in done.stderr
