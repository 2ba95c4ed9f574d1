"""Qwen3-VL-MoE (``qwen3_vl_moe``) at its published sizes: inventories, the packed experts placed
as vLLM loads them, the transformers-5 layout refused, a vLLM plan. The end-to-end flow
(save_pretrained checkpoint rewritten to the published expert layout, reshard at tp / ep / pp,
verify's three levels against ``Qwen3VLMoeForConditionalGeneration``'s logits, merge
byte-identical) is tests/test_families.py's.

Published figures (exact parameter counts): Qwen3-VL-30B-A3B-Instruct / -Thinking
31,070,754,032 and Qwen3-VL-235B-A22B-Instruct / -Thinking 235,670,022,896 — a public
fine-tuning service's model list (``"paramCount": 31070754032``), next to Qwen3-VL-8B's
8,767,123,696 and Qwen3-30B-A3B's 30,532,122,624, which the suite already holds; found through
the search tool. The configs are the releases' shape keys (public training launch scripts'
model arguments for both repeat the text model's: 48 / 94 layers, 2,048 / 4,096 wide, 128
experts of 768 / 1,536, top 8, 4 KV heads, vocabulary 151,936).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from tests._cli import ROOT, run_cli
from tests._models import make_checkpoint, published_expert_layout
from tests._multimodal import plan_json, qwen3_vl_config

MANIFEST = ROOT / "manifests/qwen3-vl-30b-a3b-vllm-tp2.yaml"
LM = "model.language_model"


def _config(h: int, i: int, moe: int, layers: int, heads: int, out: int) -> dict[str, Any]:
    """A published Qwen3-VL-MoE config.json's shape keys (transformers 4.57: nested): Qwen3-VL's
    large tower, 128 experts of ``moe``, top 8, every layer sparse."""
    cfg = qwen3_vl_config("qwen3_vl_moe", h, i, layers, heads, 4, False, LARGE_TOWER, out)
    cfg["text_config"].update(
        moe_intermediate_size=moe,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return cfg


LARGE_TOWER = (27, 1152, 4304, [8, 16, 24])  # Qwen3-VL-8B / 32B / MoE
A3B = _config(2048, 6144, 768, 48, 32, 2048)
A22B = _config(4096, 12288, 1536, 94, 64, 4096)


def _text_and_tower(model: Any) -> tuple[int, int]:
    numel = {t.fqn: t.numel for t in model.tensors}
    tower = sum(n for f, n in numel.items() if f.startswith("model.visual."))
    return sum(numel.values()) - tower, tower


@pytest.mark.parametrize(
    ("config", "published", "text"),
    [(A3B, 31_070_754_032, 30_532_122_624), (A22B, 235_670_022_896, 235_093_634_560)],
    ids=["30b-a3b", "235b-a22b"],
)
def test_inventory_is_the_published_count(config: dict, published: int, text: int) -> None:
    model = from_config(config)
    assert model.parameters == published
    assert {t.dtype for t in model.tensors} == {"BF16"}
    # the text model is Qwen3-MoE's to the parameter (its published count); the tower is
    # Qwen3-VL-8B's (576,388,336 at out_hidden_size 4,096), its four mergers' linear_fc2
    # [out, 4,608] and bias narrower at 2,048
    lm, tower = _text_and_tower(model)
    assert lm == text
    out = config["vision_config"]["out_hidden_size"]
    assert tower == 576_388_336 - 4 * (4096 - out) * (4608 + 1)
    # one tensor per layer and matrix, not one per expert: q/k/v/o, q/k norms, two norms,
    # router, gate_up, down; the table, final norm and head; the tower's 351
    layers = config["text_config"]["num_hidden_layers"]
    assert len(model.tensors) == layers * 11 + 3 + 351


def test_235b_packed_shapes() -> None:
    shapes = {t.fqn: t.shape for t in from_config(A22B).tensors}
    assert shapes[f"{LM}.layers.93.mlp.experts.gate_up_proj"] == (128, 4096, 2 * 1536)
    assert shapes[f"{LM}.layers.93.mlp.experts.down_proj"] == (128, 1536, 4096)
    assert shapes[f"{LM}.layers.93.mlp.gate.weight"] == (128, 4096)


def test_packed_experts_placed_as_vllm_loads_them() -> None:
    """tp 4 × ep 2: each ep rank holds 64 experts; gate_up_proj [E, H, 2I] is cut along 2I as
    FusedMoE's w13 (a quarter of the gate half, then the same quarter of the up half), the
    down projection [E, I, H] along I; the router whole."""
    model = from_config(A3B)
    layout = build_layout(model, Mesh(tp=4, ep=2))
    rank = layout.ranks[1 * 4 + 3]  # ep 1, tp 3
    shards = {s.fqn: s for s in rank.shards}
    gate_up = shards[f"{LM}.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.local_shape == (64, 2048, 2 * 768 // 4)
    assert [(p.offsets, p.sizes) for p in gate_up.pieces] == [
        ((64, 0, 3 * 192), (64, 2048, 192)),  # gate: columns 576..768
        ((64, 0, 768 + 3 * 192), (64, 2048, 192)),  # up: columns 1344..1536
    ]
    down = shards[f"{LM}.layers.0.mlp.experts.down_proj"]
    assert down.local_shape == (64, 192, 2048)
    assert [(p.offsets, p.sizes) for p in down.pieces] == [((64, 576, 0), (64, 192, 2048))]
    assert shards[f"{LM}.layers.0.mlp.gate.weight"].local_shape == (128, 2048)
    assert shards["model.visual.merger.linear_fc2.weight"].local_shape == (2048, 4608 // 4)


def test_transformers5_layout_is_refused_in_one_line(tmp_path: Path) -> None:
    """transformers 5's save_pretrained writes gate_up_proj [E, 2I, H]: the published layout
    transposed. reshard and plan refuse it with one line, exit 3, nothing written."""
    src = make_checkpoint("qwen3_vl_moe", tmp_path / "src")
    published_expert_layout(src)  # applied twice: back to what save_pretrained wrote
    out = tmp_path / "out"
    done = run_cli("reshard", str(src), str(out), "--tp", "2")
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, lines
    assert "packed experts stored [E, 2I, H] = [4, 96, 64]" in lines[0]
    assert "[E, H, 2I] = [4, 64, 96]" in lines[0] and "transpose dims 1 and 2" in lines[0]
    assert not out.exists()
    config = json.loads((src / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe"
    done = run_cli("plan", str(src), "--tp", "2")
    assert done.returncode == 3 and "[E, 2I, H]" in done.stderr


def test_vllm_plan_of_the_30b(tmp_path: Path) -> None:
    """The committed manifest through the CLI: 31,070,754,032 BF16 parameters over tp 2, the
    DeepStack encoder cache (16,384 embeddings × 4 × 2,048) and buffers (3 × 8,192 × 2,048),
    the fused-MoE workspace vLLM allocates for 16-bit experts, 48 layers of KV."""
    doc = plan_json(tmp_path, MANIFEST.read_text())
    assert doc["model"]["parameters"] == 31_070_754_032
    stage = doc["memory_model"]["detail_per_stage"][0]
    assert stage["activations.encoder_cache"] == 16384 * 4 * 2048 * 2
    assert stage["overhead.model_buffers"] == 3 * 8192 * 2048 * 2
    assert stage["activations.moe_workspace"] > 0
    # 48 layers x K and V x 2 KV heads per rank x 128 x BF16
    assert doc["kv_cache"]["bytes_per_token_per_rank"] == [48 * 2 * 2 * 128 * 2]
    assert doc["fits"] is True


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_both_expert_count_keys(key: str) -> None:
    # transformers 5 writes num_local_experts into a saved text_config; the hub's say num_experts
    cfg = yaml.safe_load(yaml.safe_dump(A3B))
    cfg["text_config"][key] = cfg["text_config"].pop("num_experts")
    assert from_config(cfg).dims is not None
    assert from_config(cfg).dims.num_experts == 128  # type: ignore[union-attr]
