"""Issue 15's accuracy table: ``workload.engine: vllm`` against vLLM's own start-up logs.

Each row cites the log it reproduces; the assertion is the issue's: within 3 % of vLLM's figure,
and never "fits" where vLLM refused to start. Several constants of the profile were read from
these same logs (see shardctl/plan/memory/vllm.py), so these rows pin the accounting; they are
not out-of-sample predictions.
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
from shardctl.plan.memory.shapes import split_layers
from tests._cli import ROOT, run_cli

GIB = 2**30
# meta-llama/Meta-Llama-3-8B and Llama-3.1-8B config.json (same shapes; 128,256 vocab).
LLAMA3_8B = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False)
# meta-llama/Llama-2-7b-hf and Llama-2-70b-hf config.json (fp16 checkpoints).
LLAMA2_7B = ModelDims(4096, 32, 32, 32, 128, 11008, 32000, False)
LLAMA2_70B = ModelDims(8192, 80, 64, 8, 128, 28672, 32000, False)
H100 = HardwareSpec.preset("h100-sxm")
A100 = HardwareSpec.preset("a100-80gb")
RTX3090 = HardwareSpec(device_memory=round(23.58 * GIB))  # "total_gpu_memory=23.58GiB"


def _vllm(
    dims: ModelDims, dtype: str, tp: int, hw: HardwareSpec, max_len: int, **workload_keys: object
) -> MemoryPlan:
    model = ModelInfo("llama", dims, (), dtype, "inline")
    workload = Workload(sequence_length=max_len, engine="vllm", **workload_keys)  # type: ignore[arg-type]
    return estimate(model, Mesh(tp=tp), split_layers(dims.num_layers, 1), hardware=hw,
                    workload=workload)  # fmt: skip


def _capacity(plan: MemoryPlan) -> KvCapacity:
    assert plan.kv is not None and plan.kv.capacity is not None
    return plan.kv.capacity


def _within(ours: float, published: float, tol: float = 0.03) -> None:
    assert abs(ours - published) <= tol * published, f"{ours} vs {published}"


def test_llama3_8b_tp1_h100() -> None:
    # vLLM PR #10511 (youkaichao, 2024-12-14), `vllm serve meta-llama/Meta-Llama-3-8B`:
    # total 79.22GiB, can use 71.29GiB, weights 14.96GiB, non_torch 1.79GiB, activation peak
    # 1.26GiB, available_kv_cache_memory 53.29GiB = 436,551 tokens of 131,072 B.
    plan = _vllm(LLAMA3_8B, "BF16", 1, H100, 8192)
    cap = _capacity(plan)
    _within(cap.kv_bytes, 53.29 * GIB)
    _within(cap.tokens, 436_551)
    assert plan.fits is True


def test_llama3_8b_tp2_h100() -> None:
    # vLLM PR #10511, same run with -tp 2: weights 7.48GiB, non_torch 3.58GiB, activation
    # 1.26GiB → 71.29 − 7.48 − 3.58 − 1.26 = 58.97 GiB per rank ≈ 966,164 tokens of 65,536 B.
    cap = _capacity(_vllm(LLAMA3_8B, "BF16", 2, H100, 8192))
    _within(cap.tokens, 966_164)


def test_llama2_7b_tp1_a100() -> None:
    # vLLM PR #2031 (WoosukKwon, 2023-12-12): Llama2-7B, TP=1, 1xA100-80GB, "# GPU blocks: 7351".
    cap = _capacity(_vllm(LLAMA2_7B, "F16", 1, A100, 4096))
    _within(cap.blocks, 7351)


def test_llama2_7b_tp1_a100_dec_2023_profile() -> None:
    # The same row under vllm_version "0.2", the accounting PR #2031 itself introduced: at tp 1
    # nothing is all-reduced, so it prices as "0.6" does. The A100's 0.77 GiB non-torch figure
    # was read from this PR's two tp-1 rows (vllm.py, NON_TORCH_TP1), so this row pins that
    # constant rather than testing it.
    cap = _capacity(_vllm(LLAMA2_7B, "F16", 1, A100, 4096, vllm_version="0.2"))
    _within(cap.blocks, 7351)


def test_llama2_70b_tp4_a100() -> None:
    """vLLM PR #2031 (WoosukKwon, 2023-12-12): Llama2-70B, TP=4, 4xA100-80GB, "# GPU blocks:
    20865", priced with ``vllm_version: "0.2"`` (V0 of December 2023).

    Terms: weights 32.12 GiB; non-torch 0.77 (A100 tp 1, read from this PR's Llama2-7B rows)
    + 1.79 GiB for the tensor-parallel group (read from vLLM PR #10511, v0.6.5 on H100, a year
    later: which share of it one torch NCCL communicator took in December 2023 is not
    established; a smaller share would give more blocks); profile forward over 4,096 tokens
    (0.35 GiB); and 161 all-reduce outputs of 4,096 × 8,192 × 2 B kept from reuse by NCCL's
    record_stream (vLLM issue #2150, fixed in PR #2151): 10.06 GiB. Nothing was fitted to this
    row. Result: 21,484 blocks, +2.97 % — inside 3 %, but only just: the 0.76 GiB still
    unaccounted for (allocator slack under mem_get_info beyond the weights' 3.5 MiB, which is
    priced; the sampler's all-gathered logits) is not modelled. Under "0.6" (no retained
    all-reduces) the row is 29,728 blocks, +42 %.
    """
    plan = _vllm(LLAMA2_70B, "F16", 4, A100, 4096, vllm_version="0.2")
    r = plan.coords[(0, 0, 0)]
    assert r.detail["activations.retained_allreduce"] == 161 * 4096 * 8192 * 2
    _within(_capacity(plan).blocks, 20865)
    # the 2024 accounting misses the 2023 defect: the row's +42 % (issue 15's table, +46 %)
    old = _capacity(_vllm(LLAMA2_70B, "F16", 4, A100, 4096))
    assert old.blocks > 1.4 * 20865


@pytest.mark.parametrize(
    ("dims", "tp", "logged"),
    [(LLAMA2_7B, 1, 7449), (LLAMA2_70B, 4, 31615)],
)
def test_pr2031_torch_peak_rows(dims: ModelDims, tp: int, logged: int) -> None:
    # vLLM PR #2031's "Current main" figures: before the PR, vLLM charged only torch's peak
    # allocation (torch.cuda.max_memory_allocated), so no non-torch memory and no retained
    # all-reduce blocks (freed tensors, only held back from reuse). With non_torch_memory 0 the
    # profile's weights and activation peak alone must give them: a check of those two terms
    # that no constant was read from (7,449 was used only as the difference to 7,351).
    cap = _capacity(_vllm(dims, "F16", tp, A100, 4096, non_torch_memory=0))
    _within(cap.blocks, logged)


def test_dec_2023_profile_keeps_all_reduces_only_at_tp_above_1() -> None:
    one = _vllm(LLAMA2_7B, "F16", 1, A100, 4096, vllm_version="0.2").coords[(0, 0, 0)]
    assert "activations.retained_allreduce" not in one.detail
    two = _vllm(LLAMA2_7B, "F16", 2, A100, 4096, vllm_version="0.2").coords[(0, 0, 0)]
    six = _vllm(LLAMA2_7B, "F16", 2, A100, 4096).coords[(0, 0, 0)]
    # 2 per layer + the embedding's, each [4096, 4096] fp16; the rest as "0.6" prices it
    kept = (2 * 32 + 1) * 4096 * 4096 * 2
    assert two.detail["activations.retained_allreduce"] == kept
    assert two.activations == six.activations + kept
    # the same overhead but the allocator's: "0.2" read free memory (reserved segments), "0.6"
    # torch's allocated bytes (shardctl/plan/memory/allocator.py)
    alloc = "overhead.allocator"
    assert two.overhead - two.detail[alloc] == six.overhead - six.detail[alloc]
    assert two.detail[alloc] > six.detail[alloc] > 0


def test_llama31_8b_rtx3090_20k_fits() -> None:
    # vLLM issue #10517 (kaspersiminski, 2024-12-02), RTX 3090, meta-llama/Llama-3.1-8B-Instruct,
    # --max-model-len 20000: total_gpu_memory=23.58GiB, peak_torch_memory=17.06GiB,
    # non_torch_memory=0.35GiB, kv_cache_size=3.81GiB, "# GPU blocks: 1952", concurrency 1.56x.
    plan = _vllm(LLAMA3_8B, "BF16", 1, RTX3090, 20000)
    cap = _capacity(plan)
    _within(cap.blocks, 1952)
    _within(cap.max_concurrency, 1.56)
    assert plan.fits is True


def test_llama31_8b_rtx3090_29k_does_not_fit() -> None:
    # vLLM issue #10517, same GPU and model, --max-model-len 29000: peak_torch_memory=17.98GiB,
    # kv_cache_size=2.89GiB, "# GPU blocks: 1478", and vLLM refused to start: "The model's max
    # seq len (29000) is larger than the maximum number of tokens that can be stored in KV
    # cache (23648)".
    plan = _vllm(LLAMA3_8B, "BF16", 1, RTX3090, 29000)
    cap = _capacity(plan)
    _within(cap.blocks, 1478)
    assert cap.tokens < 29000
    assert plan.fits is False


def test_vllm_budget_uses_the_size_cuda_reports() -> None:
    plan = _vllm(LLAMA3_8B, "BF16", 1, H100, 8192)
    # PR #10511: "total_gpu_memory 79.22GiB", "the current vLLM instance can use 71.29GiB".
    assert plan.device_memory is not None and round(plan.device_memory / GIB, 2) == 79.22
    assert plan.budget is not None and round(plan.budget / GIB, 2) == 71.29


def test_generic_engine_budgets_from_the_reported_size_with_its_own_overheads() -> None:
    model = ModelInfo("llama", LLAMA3_8B, (), "BF16", "inline")
    plan = estimate(model, Mesh(), split_layers(32, 1), hardware=H100,
                    workload=Workload(sequence_length=8192))  # fmt: skip
    # the device size CUDA reports (79.216 GiB on an H100), as for vLLM; generic overheads
    assert plan.budget == int(round(79.216 * GIB) * 0.9)
    assert "overhead.cuda_context" in plan.coords[(0, 0, 0)].detail


def test_non_torch_and_cuda_graphs_are_settable() -> None:
    model = ModelInfo("llama", LLAMA3_8B, (), "BF16", "inline")
    w = Workload(sequence_length=8192, engine="vllm", non_torch_memory=0, cuda_graph_memory=GIB)
    plan = estimate(model, Mesh(), split_layers(32, 1), hardware=H100, workload=w)
    r = plan.coords[(0, 0, 0)]
    assert r.detail["overhead.non_torch"] == 0 and r.detail["overhead.cuda_graphs"] == GIB
    assert r.overhead == GIB


@given(
    length=st.integers(1, 200_000),
    batch=st.integers(1, 64),
    tp=st.sampled_from([1, 2, 4]),
    gpu=st.sampled_from(["h100-sxm", "a100-80gb"]),
    version=st.sampled_from(["0.2", "0.6"]),
)
@settings(max_examples=60, deadline=None)
def test_vllm_verdict_is_the_capacity(
    length: int, batch: int, tp: int, gpu: str, version: str
) -> None:
    # The one verdict and the capacity agree: the workload fits exactly when its sequences,
    # each rounded up to whole blocks, fit in the blocks vLLM would allocate.
    model = ModelInfo("llama", LLAMA3_8B, (), "BF16", "inline")
    w = Workload(batch_size=batch, sequence_length=length, engine="vllm", vllm_version=version)
    plan = estimate(model, Mesh(tp=tp), split_layers(32, 1), hardware=HardwareSpec.preset(gpu),
                    workload=w)  # fmt: skip
    cap = _capacity(plan)
    assert plan.fits == (batch * -(-length // 16) * 16 <= cap.tokens)


@pytest.mark.xfail(
    strict=True,
    reason="vLLM V1 (July 2025, LMCache connector) logged 178,880 tokens (8.11 GiB); with "
    "vllm_version 0.16 (V1 as at 0.15-0.16: the sort-path sampler over 1,024 sequences, 5.94 GiB; "
    "non-torch 0.13 + 1.79 GiB) the profile gives 185,424 tokens (8.31 GiB): +3.7 %, +2.5 % "
    "in bytes. The log's own lines disagree by 1.1 % (178,880 × 48,128 B = 8.02 GiB, not "
    "8.11) and the LMCache connector's GPU buffers are unknown",
)
def test_qwen3_235b_fp8_tp4_h100_v1(tmp_path: Path) -> None:
    # vLLM issue #21348 (MMuzzammil1, 2025-07-22): `vllm serve Qwen3-235B-A22B-FP8
    # --tensor-parallel-size 4` on 4xH100: "Available KV cache memory: 8.11 GiB", "GPU KV cache
    # size: 178,880 tokens" (48,128 B per token per rank).
    text = (ROOT / "manifests/qwen3-235b-a22b-fp8-sglang-tp4.yaml").read_text()
    path = tmp_path / "q.yaml"
    path.write_text(
        text.replace("engine: sglang", 'engine: vllm\n  vllm_version: "0.16"').replace(
            "  mem_fraction_static: 0.93\n", ""
        )
    )
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    _within(json.loads(done.stdout)["kv_cache"]["capacity_tokens_per_rank"], 178_880)


def test_dec_2023_manifest_through_the_cli(tmp_path: Path) -> None:
    # The manifest's `vllm_version: "0.2"` reaches the profile: PR #2031's 20,865 blocks.
    path = ROOT / "manifests/llama-2-70b-vllm-0.2-tp4.yaml"
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    _within(json.loads(done.stdout)["kv_cache"]["blocks_per_rank"], 20865)
    # unquoted, YAML reads 0.2 as a float: the same profile
    plain = tmp_path / "plain.yaml"
    plain.write_text(path.read_text().replace('vllm_version: "0.2"', "vllm_version: 0.2"))
    same = run_cli("plan", str(plain), "--json")
    assert json.loads(same.stdout)["kv_cache"] == json.loads(done.stdout)["kv_cache"]
    # a version without a profile: exit 3, one line naming the key
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace('vllm_version: "0.2"', 'vllm_version: "0.3"'))
    run = run_cli("plan", str(bad), "--json")
    assert run.returncode == 3 and "vllm_version" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
