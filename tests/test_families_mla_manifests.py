"""DeepSeek manifests: ``plan``'s weight bytes against the published checkpoints' sizes.

Published ``model.safetensors.index.json`` ``metadata.total_size`` (bf16 checkpoints):

- deepseek-ai/DeepSeek-V2-Lite: 31,412,968,448 B
  https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/model.safetensors.index.json
  (figure as quoted from that index in a public DeepSeek-V2-Lite roofline note found by code
  search: "The index file reports `total_size: 31412968448`").
- deepseek-ai/DeepSeek-V2-Chat-0628 (DeepSeek-V2's 236B architecture): 471,482,869,760 B
  https://huggingface.co/deepseek-ai/DeepSeek-V2-Chat-0628/blob/main/model.safetensors.index.json
  (as quoted in https://blog.youkuaiyun.com/gitblog_00601/article/details/151947352:
  "模型总大小达到471,482,869,760字节", 55 safetensors shards).

DeepSeek-V3's hub checkpoint is FP8 (e4m3, a float32 ``weight_scale_inv`` per 128×128 block);
its bytes are matched in tests/test_flagships.py (from the FP8 manifest, against the tensor data
summed from the 163 shard headers; the index's ``total_size`` there is 2 × elements, not bytes).
What is tested here for the bf16 V3 manifests are the README's published parameter counts
(https://huggingface.co/deepseek-ai/DeepSeek-V3-Base/blob/main/README_WEIGHTS.md: main model
671B; the MTP module's decoder layer 11.5B), and that the bytes the plan prices per rank are the
layout engine's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.layout.engine import staged_weight_bytes
from shardctl.layout.types import LayoutOptions, Mesh
from shardctl.manifest.load import load_manifest
from shardctl.model.inventory import from_config
from shardctl.plan.memory.layout_counts import layout_counts
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"


def _plan(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _plan_api(manifest: Path) -> dict:
    """The same plan through the library (no interpreter start-up per manifest)."""
    from shardctl import plan

    return plan(manifest).to_json()


@pytest.mark.parametrize(
    ("manifest", "total_size"),
    [("deepseek-v2-lite-tp1.yaml", 31_412_968_448), ("deepseek-v2-tp8.yaml", 471_482_869_760)],
)
def test_plan_weight_bytes_equal_published_total_size(manifest: str, total_size: int) -> None:
    doc = _plan(str(MANIFESTS / manifest))
    assert doc["model"]["weight_bytes"] == total_size
    assert doc["model"]["architecture"] == "deepseek_v2"


def test_deepseek_v3_published_parameter_counts() -> None:
    """README_WEIGHTS.md: 671B main-model parameters; the MTP module adds a decoder layer of
    11.5B plus its projection and norms (and copies of the embedding and head)."""
    doc = _plan_api(MANIFESTS / "deepseek-v3-tp8-pp2.yaml")
    with_mtp = doc["model"]["parameters"]
    cfg = load_manifest(MANIFESTS / "deepseek-v3-tp8-pp2.yaml").model.config_dict()
    main = from_config({**cfg, "include_mtp_layers": False})
    assert round(main.parameters / 1e9) == 671
    mtp = with_mtp - main.parameters
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    decoder_layer = mtp - 2 * v * h - 2 * h * h - 3 * h  # minus embed/head copies, eh_proj, norms
    assert round(decoder_layer / 1e8) == 115
    assert doc["moe"]["parameters_total"] == with_mtp
    assert doc["moe"]["num_experts"] == 256 and doc["moe"]["experts_per_token"] == 8


@pytest.mark.parametrize(
    "manifest",
    [
        "deepseek-v3-tp8-pp2.yaml",
        "deepseek-v3-ep8-tp2.yaml",
        "deepseek-v2-tp8.yaml",
        "deepseek-v2-lite-tp1.yaml",
    ],
)
def test_plan_prices_the_layout_engines_bytes_and_counts(manifest: str) -> None:
    """The per-rank weights ``plan`` prints are the layout's; the by-kind counts that quantized
    and training plans use (layout_counts, not the Llama closed form) add up to the same."""
    m = load_manifest(MANIFESTS / manifest)
    doc = _plan_api(MANIFESTS / manifest)
    model = from_config(m.model.config_dict())
    mesh = Mesh(**{k: v for k, v in doc["mesh"].items() if k in ("pp", "dp", "ep", "tp")})
    per_stage = tuple(s["layers"][1] - s["layers"][0] + 1 for s in doc["stages"])
    options = LayoutOptions(layers_per_stage=per_stage)
    stages, by_coord = staged_weight_bytes(model, mesh, options=options)
    for r in doc["ranks"]:
        c = r["coord"]
        assert r["memory"]["weights"] == by_coord[(c["pp"], c["ep"], c["tp"])]
    counts = layout_counts(model, mesh, stages, "tp")
    for st in stages:
        assert counts[st.index].total * 2 == by_coord[(st.index, 0, 0)]  # BF16
        assert counts[st.index].expert > counts[st.index].linear  # MoE: experts dominate


def test_plan_from_config_json_and_checkpoint_dir(tmp_path: Path) -> None:
    src = make_checkpoint("deepseek_v3", tmp_path / "hf")
    on_disk = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    for target in (src / "config.json", src):
        doc = _plan(str(target), "--tp", "2", "--ep", "2", "--gpu", "h100-sxm")
        assert doc["model"]["architecture"] == "deepseek_v3"
        assert 0 < doc["model"]["weight_bytes"] < on_disk  # the file adds only its header


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_layout_counts_equal_engine_bytes_on_every_mesh(name: str) -> None:
    """The by-kind counts replace the closed form (tests/test_memory_closed_form.py) for
    these families: equal to the engine's bytes on every rank, tp/pp/ep and both paddings."""
    import itertools

    from shardctl.errors import LayoutError
    from tests._models import CONFIGS

    model = from_config(dict(CONFIGS[name]))
    compared = 0
    for (tp, pp, ep), padding in itertools.product(
        itertools.product([1, 2, 4], [1, 2], [1, 2, 4]), ["tp", "megatron"]
    ):
        mesh = Mesh(tp=tp, pp=pp, ep=ep)
        options = LayoutOptions(vocab_padding=padding)
        try:
            stages, exact = staged_weight_bytes(model, mesh, options=options)
        except LayoutError:
            continue
        counts = layout_counts(model, mesh, stages, padding)
        for (p, e, t), nbytes in exact.items():
            if e == 0 and t == 0:
                assert counts[p].total * 2 == nbytes, (mesh, padding, p)
        compared += 1
    assert compared >= 16


def test_zero3_gathers_the_largest_real_layer(tmp_path: Path) -> None:
    """FSDP/ZeRO-3 holds two gathered layers: for DeepSeek-V2-Lite the largest is a MoE layer
    of the inventory (584.8M parameters), not the closed form's 64 experts of the dense
    intermediate_size (4.3B)."""
    from shardctl import plan
    from shardctl.layout.pipeline import layer_index

    text = (MANIFESTS / "deepseek-v2-lite-tp1.yaml").read_text()
    text = text[: text.index("mesh:")] + (
        "mesh: {dp: 8}\nhardware: {gpu: h100-sxm}\n"
        "workload: {batch_size: 8, sequence_length: 4096}\n"
        "training: {optimizer: adamw, zero: FULL_SHARD, recompute: selective}\n"
    )
    path = tmp_path / "train.yaml"
    path.write_text(text)
    doc = plan(path).to_json()
    gathered = doc["memory_model"]["detail_per_stage"][0]["weights.zero3_gather"]
    model = from_config(load_manifest(path).model.config_dict())
    per_layer: dict[int, int] = {}
    for t in model.tensors:
        i = layer_index(t.fqn)
        if i is not None:
            per_layer[i] = per_layer.get(i, 0) + t.nbytes
    assert gathered == 2 * max(per_layer.values())
    assert max(per_layer.values()) // 2 == 584_847_872  # router + 64 + 2 shared experts + MLA
