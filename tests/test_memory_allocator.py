"""The caching allocator's share of an engine's loaded weights (shardctl.plan.memory.allocator).

Simulator cases are worked by hand from c10/cuda/CUDACachingAllocator.cpp (``round_size``,
``get_allocation_size``, ``should_split``, best-fit ``get_free_block``); the engine rows check
the fused parameters of real shapes against sums done by hand; a ``gpu`` test holds the
simulator against torch's own allocator where CUDA is present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.layout.types import Mesh, Stage
from shardctl.plan.memory.allocator import (
    CachingAllocator,
    ParamNames,
    engine_params,
    load_extra,
    stage_load_extra,
)
from tests._cli import run_cli
from tests._models import make_checkpoint

MiB = 2**20


def test_large_request_keeps_a_remainder_of_one_mib() -> None:
    # 231 MiB: a 232 MiB segment (kRoundLarge), 1 MiB left is not > kSmallSize: not split,
    # the block is allocated whole (Qwen2.5-72B's down_proj at tp 2)
    a = CachingAllocator()
    assert a.malloc(231 * MiB) == 232 * MiB
    assert (a.allocated, a.reserved) == (232 * MiB, 232 * MiB)
    # 12.5 MiB: 14 MiB segment, 1.5 MiB split off (free, not allocated, still reserved)
    assert a.malloc(12 * MiB + MiB // 2) == 12 * MiB + MiB // 2
    assert (a.allocated, a.reserved) == (244 * MiB + MiB // 2, 246 * MiB)


def test_mid_sized_requests_share_twenty_mib_segments() -> None:
    a = CachingAllocator()
    assert a.malloc(9 * MiB + MiB // 2) == 9 * MiB + MiB // 2  # 20 MiB segment, 10.5 left
    # best fit takes the 10.5 MiB remainder; 1 MiB would be left: not split, taken whole
    assert a.malloc(9 * MiB + MiB // 2) == 10 * MiB + MiB // 2
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    # a 1.25 MiB request reuses nothing (no free block) and opens another 20 MiB segment
    a.malloc(MiB + MiB // 4)
    assert a.reserved == 40 * MiB


def test_small_requests_round_to_512_in_two_mib_segments() -> None:
    a = CachingAllocator()
    assert a.malloc(1) == 512
    assert a.malloc(10_000) == 10_240
    assert a.malloc(0) == 0  # an empty tensor holds no block
    assert (a.allocated, a.reserved) == (10_752, 2 * MiB)
    # exactly 1 MiB is still the small pool; a full small segment takes another
    a.malloc(MiB)
    a.malloc(MiB)
    assert a.reserved == 4 * MiB
    # what the load adds: allocated or reserved, less the bytes asked for
    assert load_extra([231 * MiB, 1], reserved=False) == MiB + 511
    assert load_extra([231 * MiB, 1], reserved=True) == MiB + 2 * MiB - 1


def test_a_split_remainder_serves_a_later_request() -> None:
    a = CachingAllocator()
    a.malloc(12 * MiB + MiB // 2)  # leaves a free 1.5 MiB block in the large pool
    # best fit takes that block; 1.5 MiB − (1 MiB + 4 KiB) is under 1 MiB: not split, so the
    # block is allocated whole, and no segment is added
    assert a.malloc(MiB + 4096) == MiB + MiB // 2
    assert a.allocated == 14 * MiB
    assert a.reserved == 14 * MiB


L = "model.layers.#."


@pytest.mark.parametrize(
    ("arch", "fqn", "param"),
    [
        ("llama", "model.layers.3.self_attn.q_proj.weight", L + "self_attn.qkv_proj.weight"),
        ("qwen2", "model.layers.3.self_attn.v_proj.bias", L + "self_attn.qkv_proj.bias"),
        ("llama", "model.layers.3.self_attn.o_proj.weight", L + "self_attn.o_proj.weight"),
        ("llama", "model.layers.1.mlp.gate_proj.weight", L + "mlp.gate_up_proj.weight"),
        (
            "llama",
            "model.layers.3.self_attn.k_proj.weight_scale",
            L + "self_attn.qkv_proj.weight_scale",
        ),
        (
            "qwen3_moe",
            "model.layers.2.mlp.experts.17.up_proj.weight",
            L + "mlp.experts.routed_experts.w13_weight",
        ),
        (
            "deepseek_v3",
            "model.layers.2.mlp.experts.17.down_proj.weight_scale_inv",
            L + "mlp.experts.routed_experts.w2_weight_scale_inv",
        ),
        (
            "mixtral",
            "model.layers.2.block_sparse_moe.experts.3.w1.weight",
            L + "block_sparse_moe.experts.routed_experts.w13_weight",
        ),
        (
            "deepseek_v3",
            "model.layers.2.mlp.shared_experts.gate_proj.weight",
            L + "mlp.experts._shared_experts._layer.gate_up_proj.weight",
        ),
        (
            "deepseek_v3",
            "model.layers.2.self_attn.q_a_proj.weight",
            L + "self_attn.fused_qkv_a_proj.weight",
        ),
        (
            "deepseek_v3",
            "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
            L + "self_attn.fused_qkv_a_proj.weight",
        ),
        ("llama", "model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("llama", "model.layers.3.self_attn.q_proj.qweight", L + "self_attn.q_proj.qweight"),
        ("gpt2", "transformer.h.4.attn.c_attn.weight", "transformer.h.#.attn.c_attn.weight"),
    ],
)
def test_param_names_follow_the_familys_vllm_declaration(arch: str, fqn: str, param: str) -> None:
    # the rules --format vllm writes by (formats/vllm/spec.py), numbers as #; a scale joins its
    # weight's parameter; no rule (GPTQ qweight, a family without a declaration): its own
    assert ParamNames(arch).key(fqn) == param


def test_engine_params_of_a_saved_mixtral(tmp_path: Path) -> None:
    # transformers' save_pretrained: hidden 64, expert intermediate 96, 4 experts, 2 layers,
    # 8 heads of 8, 2 kv heads; bf16. At tp 2 × ep 2 each rank holds 2 experts per layer.
    from shardctl.model.inventory import from_checkpoint

    model = from_checkpoint(make_checkpoint("mixtral", tmp_path / "ck"))
    mesh = Mesh(tp=2, ep=2)
    params = engine_params(model, mesh)
    layer0 = [p for p in params if p.layer == 0]
    w13 = [p for p in layer0 if p.ep_rank is not None and p.sizes[0] == 2 * 2 * 48 * 64 * 2]
    w2 = [p for p in layer0 if p.ep_rank is not None and p.sizes[0] == 2 * 64 * 48 * 2]
    assert {p.ep_rank for p in w13} == {0, 1} and {p.ep_rank for p in w2} == {0, 1}
    # attention: q 64 + k 16 + v 16 rows of 64, halved over tp: one qkv parameter per layer
    qkv = [p for p in layer0 if p.ep_rank is None and p.sizes == [48 * 64 * 2] * 2]
    assert len(qkv) == 1
    # every byte of the layout is in some parameter, once per ep rank that holds it
    total = sum(p.sizes[0] for p in params if p.layer is not None and p.ep_rank in (None, 0))
    per_layer_rank0 = (
        (48 * 64 + 64 * 32 + 2 * (2 * 48 * 64 + 64 * 48)) * 2 + 4 * 64 * 2 + 2 * 64 * 2
    )
    assert total == 2 * per_layer_rank0
    # every parameter is under 1 MiB: the small pool, each rounded up to 512 bytes
    rank0 = [p.sizes[0] for p in params if p.ep_rank in (None, 0)]
    expected = sum(-(-s // 512) * 512 - s for s in rank0)
    assert expected > 0
    assert stage_load_extra(params, Stage(0, (0, 1)), mesh, reserved=False) == expected


def test_a_model_without_a_preset_has_no_engine_params() -> None:
    # placed by manifest rules only: the engine's own split is unknown, nothing is priced
    from shardctl.model.types import ModelInfo, TensorInfo

    m = ModelInfo("unknown", None, (TensorInfo("foo.weight", (64, 64), "BF16"),), "BF16", "x")
    assert engine_params(m, Mesh(tp=2)) == []


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2"])
def test_class_and_per_tensor_paths_give_the_same_params(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # qwen3_moe here has a dense layer 0 (mlp_only_layers) before its expert layers; qwen2
    # carries q/k/v biases: fused parameters alike whichever path builds them
    from shardctl.layout import classes
    from shardctl.model.inventory import from_checkpoint
    from shardctl.plan.memory import allocator

    model = from_checkpoint(make_checkpoint(name, tmp_path / "ck"))
    for mesh in (Mesh(tp=2), Mesh(tp=2, ep=2, pp=2)):
        if name == "qwen2" and mesh.ep > 1:
            continue
        allocator._PARAMS.clear()
        by_class = allocator.engine_params(model, mesh)
        allocator._PARAMS.clear()
        monkeypatch.setattr(classes, "rule_classes", lambda m, r: None)
        per_tensor = allocator.engine_params(model, mesh)
        monkeypatch.undo()
        allocator._PARAMS.clear()
        assert by_class and by_class == per_tensor, mesh


QWEN25_72B = """
model: {model_type: qwen2, architectures: [Qwen2ForCausalLM], hidden_size: 8192,
        intermediate_size: 29568, num_hidden_layers: 80, num_attention_heads: 64,
        num_key_value_heads: 8, vocab_size: 152064, max_position_embeddings: 32768,
        tie_word_embeddings: false, torch_dtype: bfloat16}
mesh: {tp: 2}
hardware: {gpu: h100-sxm}
workload: {engine: vllm, vllm_version: "0.19", gpu_memory_utilization: 0.95,
           sequence_length: 8192}
"""


def _detail(tmp_path: Path, text: str) -> dict[str, int]:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    done = run_cli("plan", str(path), "--json")
    assert done.returncode == 0, done.stderr
    detail: dict[str, int] = json.loads(done.stdout)["memory_model"]["detail_per_stage"][0]
    return detail


def test_vllm_qwen25_72b_tp2_down_proj_rounding(tmp_path: Path) -> None:
    # Per rank: qkv [5120, 8192] 80 MiB, o [8192, 4096] 64, gate_up [29568, 8192] 462, down
    # [8192, 14784] 231 -> 232 (1 MiB left: not split), embedding and head [76032, 8192] 1188
    # each; norms and biases in the small pool (exact to 512 B: 10,240 B and 16,384 B each).
    # 80 layers × 1 MiB: shardctl's 67.71 GiB of weights become vLLM's "Model loading took
    # 67.8 GiB" (llm-d-planner v0.19.0 log, tests/test_plan_accuracy_vllm_v1.py).
    d = _detail(tmp_path, QWEN25_72B)
    assert d["overhead.allocator"] == 80 * MiB


def test_a_model_known_by_its_dimensions_is_priced_alike() -> None:
    # a library caller's ModelInfo without tensors: its family's tensors for those dimensions
    from shardctl.model.types import ModelDims, ModelInfo
    from shardctl.plan.memory.estimate import estimate
    from shardctl.plan.memory.hardware import HardwareSpec
    from shardctl.plan.memory.shapes import split_layers
    from shardctl.plan.memory.spec import Workload

    dims = ModelDims(8192, 80, 64, 8, 128, 29568, 152064, False)
    w = Workload(sequence_length=8192, engine="vllm", vllm_version="0.19")
    for arch, expected in (("qwen2", 80 * MiB), ("unknown", 0)):
        model = ModelInfo(arch, dims, (), "BF16", "inline")
        plan = estimate(model, Mesh(tp=2), split_layers(80, 1),
                        hardware=HardwareSpec.preset("h100-sxm"), workload=w)  # fmt: skip
        assert plan.coords[(0, 0, 1)].detail["overhead.allocator"] == expected, arch


def test_vllm_dense_llama_has_nothing_to_round(tmp_path: Path) -> None:
    # Llama-3-8B at tp 1: every matrix is a whole number of 2 MiB; norms are 8 KiB
    text = (
        QWEN25_72B.replace("qwen2", "llama")
        .replace("Qwen2ForCausalLM", "LlamaForCausalLM")
        .replace("hidden_size: 8192", "hidden_size: 4096")
        .replace("29568", "14336")
        .replace("num_hidden_layers: 80", "num_hidden_layers: 32")
        .replace("num_attention_heads: 64", "num_attention_heads: 32")
        .replace("152064", "128256")
        .replace("tp: 2", "tp: 1")
    )
    assert _detail(tmp_path, text)["overhead.allocator"] == 0


def test_generic_engine_has_no_allocator_term(tmp_path: Path) -> None:
    text = QWEN25_72B.replace("engine: vllm", "engine: generic")
    assert "overhead.allocator" not in _detail(tmp_path, text)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


GPU_CHECK = """
import json, sys, torch
sizes = json.loads(sys.argv[1])
torch.cuda.init()
a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
print(json.dumps([torch.cuda.memory_allocated() - a0, torch.cuda.memory_reserved() - r0]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_simulator_matches_torch_on_a_gpu() -> None:
    half = MiB // 2
    sizes = [231 * MiB, 12 * MiB + half, MiB + 4096, 9 * MiB + half, 9 * MiB + half, 10_240,
             16_384, 1, 80 * MiB, 371 * MiB + MiB // 4, 3584, 0, 67 * MiB + half]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", GPU_CHECK, json.dumps(sizes)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    a = CachingAllocator()
    for n in sizes:
        a.malloc(n)
    assert json.loads(done.stdout) == [a.allocated, a.reserved]


def test_vllm_0_2_counts_reserved_bytes(tmp_path: Path) -> None:
    # vLLM of December 2023 sized the cache from free device memory (``mem_get_info``): the
    # segments count. Llama-2-70B at tp 4: every matrix a whole number of 2 MiB but the
    # embedding and head ([8000, 8192] bf16, 125 MiB: 1 MiB left of 126, not split); 161 norms
    # of 16 KiB fill two 2 MiB small segments. Allocated (0.6 and V1): the 2 MiB of the two
    # unsplit blocks; reserved (0.2): those, plus the small segments' free remainder.
    root = Path(__file__).resolve().parent.parent
    text = (root / "manifests/llama-2-70b-vllm-0.2-tp4.yaml").read_text()
    assert _detail(tmp_path, text)["overhead.allocator"] == 2 * MiB + 4 * MiB - 161 * 16_384
    v06 = text.replace('vllm_version: "0.2"', 'vllm_version: "0.6"')
    assert _detail(tmp_path, v06)["overhead.allocator"] == 2 * MiB


def test_uneven_pipeline_stages_are_priced(tmp_path: Path) -> None:
    # DeepSeek-V3's 61 layers over pp 2 in vLLM's convention ([31, 30]): the allocator's layout
    # takes the plan's stages (an even split would refuse 61 layers, and the term was 0)
    root = Path(__file__).resolve().parent.parent
    text = (root / "manifests/deepseek-v3-tp8-pp2.yaml").read_text()
    text = text.replace("workload:\n", "workload:\n  engine: vllm\n", 1)
    path = tmp_path / "m.yaml"
    path.write_text(text)
    done = run_cli("plan", str(path), "--json")
    assert done.returncode in (0, 1), done.stderr
    stages = json.loads(done.stdout)["memory_model"]["detail_per_stage"]
    assert len(stages) == 2 and all(s["overhead.allocator"] > 0 for s in stages)
