"""The MoE families beyond the common flow (tests/test_families.py): packed experts.

Llama-4 and gpt-oss store every expert of a layer in one tensor (``experts.gate_up_proj
[E, H, 2I]``): ep splits dim 0, tp splits the last dim — as ``[gate | up]`` parts for Llama-4,
as one contiguous range for gpt-oss, whose gate and up columns are interleaved. A layout that
gets either wrong is still self-consistent (structure and bitwise pass: the record describes the
bytes exactly), so the forward level must be what fails it. Then ``plan`` against the published
``model.safetensors.index.json`` ``total_size`` of the Qwen3-MoE flagships.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.layout.engine import build_layout, rank_weight_bytes
from shardctl.layout.types import Mesh, Piece, RuleSpec
from shardctl.model.inventory import from_config_file
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._models import make_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families-moe")


def _checkpoint(root: Path, family: str) -> Path:
    path = root / family
    if not path.exists():
        make_checkpoint(family, path)
    return path


def test_packed_experts_split_over_ep_and_tp(root: Path) -> None:
    """gpt-oss ``gate_up_proj [4, 64, 96]`` on EP2×TP2: ep rank e holds experts 2e, 2e+1; tp
    rank r columns 48r..48r+47 (24 interleaved gate/up pairs); bytes agree with the fast path."""
    model = from_config_file(_checkpoint(root, "gpt_oss") / "config.json")
    mesh = Mesh(ep=2, tp=2)
    layout = build_layout(model, mesh)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for rl in layout.ranks:
        (shard,) = [s for s in rl.shards if s.fqn == name]
        assert shard.global_shape == (4, 64, 96)
        assert shard.local_shape == (2, 64, 48)
        assert shard.pieces == (Piece((2 * rl.ep, 0, 48 * rl.tp), (2, 64, 48), (0, 0, 0)),)
        assert shard.placement == "E·S(0)/2·S(2)"
        (bias,) = [s for s in rl.shards if s.fqn.endswith("0.mlp.experts.down_proj_bias")]
        assert bias.pieces == (Piece((2 * rl.ep, 0), (2, 64), (0, 0)),)  # tp: replicated
    fast = rank_weight_bytes(model, mesh)
    assert fast == {(r.pp, r.ep, r.tp): r.nbytes for r in layout.ranks}


# (family, the preset's rule for the packed gate_up_proj replaced by a plausible wrong one)
WRONG = {
    # gate/up interleaved: [gate | up] halves pair gate j with up j + I/2 on every rank
    "gpt_oss": RuleSpec(
        "model.layers.*.mlp.experts.gate_up_proj",
        tp="S(2)",
        parts=("intermediate", "intermediate"),
        expert=True,
    ),
    # [gate | up]: a plain chunk gives rank 0 only gate columns, rank 1 only up columns
    "llama4_text": RuleSpec(
        "model.layers.*.feed_forward.experts.gate_up_proj", tp="S(2)", expert=True
    ),
}


@pytest.mark.parametrize("family", list(WRONG))
def test_forward_level_catches_a_wrong_gate_up_split(
    root: Path, tmp_path: Path, family: str
) -> None:
    src = _checkpoint(root, family)
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2), rules=[WRONG[family]])
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "fail"], [
        str(f) for lv in result.levels for f in lv.findings
    ]


def _plan(manifest: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", manifest, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


# Published ``metadata.total_size`` of each model's model.safetensors.index.json (bf16):
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/model.safetensors.index.json
# https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/model.safetensors.index.json
# (figures as quoted from those index files in public repositories, found with the code search;
# parameters = total_size / 2: 30,532,122,624 and 235,093,634,560.)
PUBLISHED = {
    "manifests/qwen3-30b-a3b-ep2.yaml": 61_064_245_248,
    "manifests/qwen3-235b-a22b-tp4-ep4.yaml": 470_187_269_120,
}


@pytest.mark.parametrize("manifest", list(PUBLISHED))
def test_plan_weights_equal_the_published_total_size(manifest: str) -> None:
    doc = _plan(manifest)
    assert doc["model"]["weight_bytes"] == PUBLISHED[manifest]
    assert doc["model"]["parameters"] * 2 == PUBLISHED[manifest]
    assert doc["moe"]["parameters_total"] * 2 == PUBLISHED[manifest]


def test_ep_ranks_hold_each_expert_once_and_the_rest_whole() -> None:
    """Qwen3-30B-A3B on EP2: the two ranks' weights = every expert once + the rest twice."""
    doc = _plan("manifests/qwen3-30b-a3b-ep2.yaml")
    total, experts = PUBLISHED["manifests/qwen3-30b-a3b-ep2.yaml"], doc["moe"]["parameters_expert"]
    ranks = [r["memory"]["weights"] for r in doc["ranks"]]
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert sum(ranks) == 2 * experts + 2 * (total - 2 * experts)


def test_plan_runs_for_the_packed_flagships() -> None:
    """gpt-oss-120b (bf16 layout) and Llama-4-Scout (text): their published total_size counts
    other bytes (MXFP4 experts; the multimodal model's vision tower), so no byte figure is
    compared here (tests/test_flagships.py matches the MXFP4 and multimodal manifests).
    gpt-oss-120b's parameter count is its model card's 116.83B; Scout's text model must stay
    under the card's 109B multimodal total. Active parameters count what the MoE layers really
    hold (shared experts, expert biases): gpt-oss-120b's card says 5.13B active without the
    0.58B embedding table; Scout is "17B" active."""
    oss = _plan("manifests/gpt-oss-120b-tp8.yaml")
    assert round(oss["model"]["parameters"] / 1e9, 2) == 116.83
    assert oss["moe"]["parameters_total"] == oss["model"]["parameters"]
    embedding = 201_088 * 2880
    assert round((oss["moe"]["parameters_active"] - embedding) / 1e9, 2) == 5.13
    assert len(oss["ranks"]) == 8
    scout = _plan("manifests/llama-4-scout-tp8.yaml")
    assert scout["model"]["architecture"] == "llama4_text"
    assert 100e9 < scout["model"]["parameters"] < 109e9
    assert scout["moe"]["parameters_total"] == scout["model"]["parameters"]
    assert round(scout["moe"]["parameters_active"] / 1e9) == 17
    assert len(scout["ranks"]) == 8


def test_shared_ep_spreads_packed_experts_over_tp_and_dp(tmp_path: Path) -> None:
    """Llama-4-Scout with ``expert_placement: shared`` on tp4 × dp2 = ep8: every rank holds
    the dense weights' tp4 share plus 2 of the 16 experts whole (not a tp4 share of all 16)."""
    text = Path("manifests/llama-4-scout-tp8.yaml").read_text()
    text = text.replace("mesh: {tp: 8}", "mesh: {tp: 4, dp: 2, ep: 8, expert_placement: shared}")
    manifest = tmp_path / "scout-shared.yaml"
    manifest.write_text(text)
    shared = _plan(str(manifest))
    plain = _plan("manifests/llama-4-scout-tp8.yaml")
    experts = plain["moe"]["parameters_expert"] * 2  # bf16 bytes of every packed expert tensor
    tp8 = plain["ranks"][0]["memory"]["weights"]  # dense / 8 + experts / 8
    dense_tp4 = {r["memory"]["weights"] - experts // 8 for r in shared["ranks"]}
    assert len(shared["ranks"]) == 8 and len(dense_tp4) == 1
    (dense4,) = dense_tp4
    # the dense part on tp4 is twice its tp8 share, up to the replicated norms and routers
    dense8 = tp8 - experts // 8
    assert 2 * dense8 - 2 * 10**7 < dense4 <= 2 * dense8


def test_sparse_step_layers_keep_their_kind_on_a_later_stage(tmp_path: Path) -> None:
    """Qwen2-MoE with ``decoder_sparse_step: 3``: only layer 2 of 4 is sparse. On PP2 the second
    stage starts at layer 2, which its rank must build as sparse and layer 3 as dense (the rank's
    config renumbers them; transformers' step rule on local indices would swap them)."""
    src = make_checkpoint("qwen2_moe", tmp_path / "hf", decoder_sparse_step=3, mlp_only_layers=[])
    model = from_config_file(src / "config.json")
    assert sorted({t.fqn.split(".")[2] for t in model.tensors if ".mlp.gate." in t.fqn}) == ["2"]
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(pp=2, tp=2))
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"], [
        str(f) for lv in result.levels for f in lv.findings
    ]
