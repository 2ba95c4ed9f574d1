"""GLM-4.5 MoE (``glm4_moe``, shardctl/archs/glm4_moe.py) at its published sizes (its
multi-token-prediction layer's round trip is DeepSeek-V3's test, tests/test_families_mla_real.py).

Sources of the published figures: the Hub's parameter counts of zai-org/GLM-4.5-Air
(110,468,824,832) and zai-org/GLM-4.5 (358,337,791,296), whose checkpoints carry one MTP layer
after the stack (``num_nextn_predict_layers: 1``); their config.json shapes are in
manifests/glm-4.5-air-tp4.yaml and below.
"""

from __future__ import annotations

from typing import Any

import yaml

from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_config
from tests._cli import ROOT

AIR = ROOT / "manifests/glm-4.5-air-tp4.yaml"


def _air() -> dict[str, Any]:
    model: dict[str, Any] = yaml.safe_load(AIR.read_text())["model"]
    return model


def test_published_parameter_counts() -> None:
    air = _air()
    assert from_config(air).parameters == 110_468_824_832
    # GLM-4.5: 92 layers 5,120 wide, 160 experts of 1,536, three dense layers, q/k norms
    full = {
        **air,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "num_hidden_layers": 92,
        "moe_intermediate_size": 1536,
        "n_routed_experts": 160,
        "first_k_dense_replace": 3,
        "use_qk_norm": True,
    }
    assert from_config(full).parameters == 358_337_791_296
    # without the MTP layer: one decoder layer, its projection, norms and the table copies less
    main = from_config({**air, "include_mtp_layers": False})
    h, v = air["hidden_size"], air["vocab_size"]
    mtp = from_config(air).parameters - main.parameters
    assert mtp - 2 * v * h - 2 * h * h - 3 * h > 0


def test_real_size_rank_at_tp4_ep2() -> None:
    """At GLM-4.5-Air's sizes, a tp 4 x ep 2 rank holds a quarter of every attention
    projection's heads (24 query, 2 KV of 128), 64 experts at a quarter of their width, the
    shared expert at a quarter, and the whole router in F32 or BF16."""
    model = from_config({**_air(), "include_mtp_layers": False})
    layout = build_layout(model, Mesh(tp=4, ep=2))
    shards = {s.fqn: s for s in layout.ranks[0].shards}
    p = "model.layers.1"
    assert shards[f"{p}.self_attn.q_proj.weight"].local_shape == (24 * 128, 4096)
    assert shards[f"{p}.self_attn.k_proj.bias"].local_shape == (2 * 128,)
    assert shards[f"{p}.self_attn.o_proj.weight"].local_shape == (4096, 24 * 128)
    experts = {n for n in shards if n.startswith(f"{p}.mlp.experts.")}
    assert len(experts) == 64 * 3
    assert shards[f"{p}.mlp.experts.0.gate_proj.weight"].local_shape == (352, 4096)
    assert shards[f"{p}.mlp.shared_experts.down_proj.weight"].local_shape == (4096, 352)
    assert shards[f"{p}.mlp.gate.weight"].local_shape == (128, 4096)
    assert shards[f"{p}.mlp.gate.e_score_correction_bias"].local_shape == (128,)
    assert shards["model.layers.0.mlp.gate_proj.weight"].local_shape == (10944 // 4, 4096)
