"""vLLM loads a multimodal model's vision tower on every pipeline stage; ``mm_encoder_tp_mode:
data`` replicates it; serving text only (``limit_mm_per_prompt`` 0) builds none.

vLLM's ``*ForConditionalGeneration`` classes build the tower and projector in ``__init__`` with
no pipeline-rank test (``qwen2_5_vl.py``: ``self.visual = Qwen2_5_VisionTransformer(...)``
whenever images or videos are allowed; ``gemma3_mm.py``: ``self.vision_tower =
SiglipVisionModel(...)``), and only the language model's layers are split. So under
``engine: vllm`` every stage carries the tower's bytes (and V1's encoder-profile cache), while
``reshard`` and the other engines keep the tower on the first stage.

The tower's bytes per tp rank are taken from the layout engine at ``pp: 1`` (the shards of the
tensors ``Family.towers`` names), not from the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardctl.archs import find
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh
from shardctl.manifest import load_manifest
from shardctl.plan.api import load_model
from shardctl.plan.memory.precision import first_match
from tests._cli import ROOT, run_cli
from tests._multimodal import plan_json

MANIFESTS = [
    "qwen2.5-vl-7b-vllm-tp2.yaml",  # qwen2_5_vl: visual.*
    "qwen3-vl-8b-vllm-tp2.yaml",  # qwen3_vl: model.visual.* (DeepStack mergers too)
    "qwen3-vl-30b-a3b-vllm-tp2.yaml",  # qwen3_vl_moe: the same tower beside packed experts
    "gemma-3-27b-it-vllm-tp1.yaml",  # gemma3: vision tower + projector
    "mistral-small-3.1-24b-vllm-tp1.yaml",  # mistral3: Pixtral tower + projector
    "granite-vision-3.3-2b-vllm-tp1.yaml",  # llava_next: tower, projector, image_newline
]


def _tower_bytes_per_tp_rank(manifest: Path, tp: int) -> list[int]:
    model = load_model(load_manifest(manifest))
    family = find(model.architecture)
    assert family is not None and family.towers
    tower = first_match(family.towers)
    layout = build_layout(model, Mesh(tp=tp))
    return [sum(s.nbytes for s in r.shards if tower(s.fqn) is not None) for r in layout.ranks]


def _weights(doc: dict[str, Any]) -> dict[tuple[int, int], int]:
    return {(r["coord"]["pp"], r["coord"]["tp"]): r["memory"]["weights"] for r in doc["ranks"]}


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_stage_holds_the_tower_under_vllm(tmp_path: Path, name: str) -> None:
    path = ROOT / "manifests" / name
    text = path.read_text()
    assert "engine: vllm" in text
    flags = ("--tp", "2", "--pp", "2")
    vllm = plan_json(tmp_path, text, *flags)
    generic = plan_json(tmp_path, text.replace("engine: vllm", "engine: generic"), *flags)
    tower = _tower_bytes_per_tp_rank(path, 2)
    assert min(tower) > 100 * 2**20  # a real tower: hundreds of MiB per rank
    v, g = _weights(vllm), _weights(generic)
    for t in range(2):
        assert v[(0, t)] == g[(0, t)]  # the first stage held it already
        assert v[(1, t)] - g[(1, t)] == tower[t]  # the last stage: the tower, to the byte
    # the encoder profile's cache is on both stages where the family prices one
    detail = vllm["memory_model"]["detail_per_stage"]
    cached = [st.get("activations.encoder_cache", 0) for st in detail]
    assert cached[0] == cached[1] > 0


def test_reshard_layout_and_pp1_unchanged(tmp_path: Path) -> None:
    # the layout reshard writes keeps the tower on stage 0 only
    path = ROOT / "manifests/qwen2.5-vl-7b-vllm-tp2.yaml"
    model = load_model(load_manifest(path))
    tower = first_match(("visual.*",))
    layout = build_layout(model, Mesh(tp=1, pp=2))
    on = [sum(1 for s in r.shards if tower(s.fqn) is not None) for r in layout.ranks]
    assert on[0] > 0 and on[1] == 0
    # one stage: every engine prices the same weights
    text = path.read_text()
    vllm = plan_json(tmp_path, text)
    generic = plan_json(tmp_path, text.replace("engine: vllm", "engine: generic"))
    assert _weights(vllm) == _weights(generic)


def test_search_prices_the_stage_as_plan_does(tmp_path: Path) -> None:
    # the layout search and plan take the same rules: the pp-2 candidate's heaviest rank is
    # plan's, tower included
    text = (ROOT / "manifests/qwen2.5-vl-7b-vllm-tp2.yaml").read_text()
    found = plan_json(tmp_path, text, "--search", "--gpus", "2", "--top", "50")
    planned = plan_json(tmp_path, text, "--tp", "1", "--pp", "2")
    cands = [c for c in found["candidates"] if c["mesh"]["pp"] == 2 and c["mesh"]["tp"] == 1]
    assert len(cands) == 1, found["candidates"]
    assert cands[0]["peak_bytes"] == max(r["memory"]["total"] for r in planned["ranks"])


def _with(text: str, extra: str) -> str:
    """The manifest ``text`` with ``extra`` keys added to its one-line workload mapping."""
    head, _, tail = text.partition("workload: {")
    assert tail, "the manifest's workload is one flow mapping"
    return f"{head}workload: {{{extra}, {tail}"


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b-vllm-tp2.yaml", "qwen3-vl-30b-a3b-vllm-tp2.yaml"])
def test_encoder_data_mode_replicates_the_tower(tmp_path: Path, name: str) -> None:
    # vLLM --mm-encoder-tp-mode data: the tower's linears are built whole on every rank
    path = ROOT / "manifests" / name
    text = path.read_text()
    split = _weights(plan_json(tmp_path, text, "--tp", "2"))
    data = _weights(plan_json(tmp_path, _with(text, "mm_encoder_tp_mode: data"), "--tp", "2"))
    whole = _tower_bytes_per_tp_rank(path, 1)[0]
    shards = _tower_bytes_per_tp_rank(path, 2)
    assert whole > shards[0] > 0
    for t in range(2):
        assert data[(0, t)] - split[(0, t)] == whole - shards[t]
    # the search prices the same rank
    found = plan_json(
        tmp_path, _with(text, "mm_encoder_tp_mode: data"), "--search", "--gpus", "2", "--top", "50"
    )
    planned = plan_json(tmp_path, _with(text, "mm_encoder_tp_mode: data"), "--tp", "2")
    (cand,) = [c for c in found["candidates"] if c["mesh"]["tp"] == 2 and c["mesh"]["pp"] == 1]
    assert cand["peak_bytes"] == max(r["memory"]["total"] for r in planned["ranks"])


def test_text_only_serving_builds_no_tower(tmp_path: Path) -> None:
    # vLLM --limit-mm-per-prompt '{"image": 0, "video": 0}': Qwen3-VL builds no tower, so no
    # tower weights, no encoder-profile cache and no DeepStack buffers
    path = ROOT / "manifests/qwen3-vl-8b-vllm-tp2.yaml"
    text = path.read_text()
    full = plan_json(tmp_path, text)
    bare = plan_json(tmp_path, _with(text, "limit_mm_per_prompt: {image: 0, video: 0}"))
    tower = _tower_bytes_per_tp_rank(path, 2)
    assert {k: v + tower[k[1]] for k, v in _weights(bare).items()} == _weights(full)
    stage = bare["memory_model"]["detail_per_stage"][0]
    assert "activations.encoder_cache" not in stage and "overhead.model_buffers" not in stage
    assert full["memory_model"]["detail_per_stage"][0]["overhead.model_buffers"] > 0
    cap = "capacity_tokens_per_rank"
    assert bare["kv_cache"][cap] > full["kv_cache"][cap]
    assert bare["model"]["parameters"] == full["model"]["parameters"]  # the checkpoint's own
    # video still allowed: the tower is built
    some = plan_json(tmp_path, _with(text, "limit_mm_per_prompt: {image: 0}"))
    assert _weights(some) == _weights(full)
    # Gemma-3 and Mistral-3 serve images only: {image: 0} is text only
    for name in ("gemma-3-27b-it-vllm-tp1.yaml", "mistral-small-3.1-24b-vllm-tp1.yaml"):
        path = ROOT / "manifests" / name
        text = path.read_text()
        full = plan_json(tmp_path, text)
        bare = plan_json(tmp_path, _with(text, "limit_mm_per_prompt: {image: 0}"))
        (tower,) = _tower_bytes_per_tp_rank(path, 1)
        assert _weights(bare) == {k: v - tower for k, v in _weights(full).items()}, name
        assert "activations.encoder_cache" in full["memory_model"]["detail_per_stage"][0]
        assert "activations.encoder_cache" not in bare["memory_model"]["detail_per_stage"][0]
    # a family whose vLLM code for this was not read (LLaVA-NeXT): the tower still counts
    llava = (ROOT / "manifests/granite-vision-3.3-2b-vllm-tp1.yaml").read_text()
    assert _weights(plan_json(tmp_path, _with(llava, "limit_mm_per_prompt: {image: 0}"))) == (
        _weights(plan_json(tmp_path, llava))
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("mm_encoder_tp_mode: replicated", "workload.mm_encoder_tp_mode"),
        ("limit_mm_per_prompt: {picture: 0}", "workload.limit_mm_per_prompt.picture"),
        ("limit_mm_per_prompt: {image: -1}", "workload.limit_mm_per_prompt.image"),
        ("limit_mm_per_prompt: [image]", "expected a mapping of modality to items"),
    ],
)
def test_bad_multimodal_keys_are_one_line(tmp_path: Path, extra: str, says: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(_with((ROOT / "manifests/qwen3-vl-8b-vllm-tp2.yaml").read_text(), extra))
    done = run_cli("plan", str(path))
    assert done.returncode == 3, done.stderr  # invalid input
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, lines


def test_text_only_drops_manifest_rules_about_the_tower(tmp_path: Path) -> None:
    # a manifest rule that places only tower tensors has nothing to place when vLLM builds no
    # tower: it is dropped, not refused; a rule matching nothing at all is still refused
    text = (ROOT / "manifests/qwen3-vl-8b-vllm-tp2.yaml").read_text()
    bare = _with(text, "limit_mm_per_prompt: {image: 0, video: 0}")
    rule = 'rules:\n  - {match: "model.visual.blocks.*.mlp.linear_fc1.*", tp: R}\n'
    ruled = bare.replace("mesh: {tp: 2}\n", rule + "mesh: {tp: 2}\n")
    assert ruled != bare
    assert _weights(plan_json(tmp_path, ruled)) == _weights(plan_json(tmp_path, bare))
    # with the tower served, the same rule applies (the fc1 weights whole on each rank)
    served = text.replace("mesh: {tp: 2}\n", rule + "mesh: {tp: 2}\n")
    assert _weights(plan_json(tmp_path, served)) != _weights(plan_json(tmp_path, text))
    path = tmp_path / "typo.yaml"
    path.write_text(ruled.replace("model.visual.blocks", "model.visul.blocks"))
    done = run_cli("plan", str(path))
    assert done.returncode == 3 and "no tensor matches" in done.stderr, done.stderr
