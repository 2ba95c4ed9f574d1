"""DeepSeek-V3's shape at a real tensor count, FP8 block-scaled, in many files, through the CLI.

The scale issue names DeepSeek-V3 (~91,000 tensors in 163 files: 256 routed experts x 3
weights x their FP8 scales per MoE layer). The other many-tensor tests hold Mixtral and Qwen3-MoE
at 10,000+ tensors; this one holds the shape the issue names, with everything it brings at once:
MLA attention (q_a / q_b / kv_a / kv_b), a dense first layer, shared experts, the router's
correction bias, each decoder linear an ``F8_E4M3`` weight with its ``F32`` ``weight_scale_inv``
(transformers' ``save_pretrained``, then quantized as the release stores it), the tensors in 24
files with an index, and ``tp 2 x ep 4``: TP cuts the scales with their weights' blocks, EP
places whole experts. Widths are shrunk (hidden 64), the block with them (8: every TP cut stays
on whole blocks); the counts are real: 256 experts, 10,000+ tensors.

Through the real CLI: ``inspect`` and ``plan`` read it, ``reshard`` splits it, ``verify`` proves
every shard bit-exact, the merge gives back the source's bytes tensor by tensor, and each rank
file holds the weight bytes ``plan`` priced for that rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from shardctl.io.safetensors_header import read_header
from tests import _quant
from tests._cli import run_cli
from tests._models import make_checkpoint
from tests.test_reshard_roundtrip import same_checkpoint, tensors

LAYERS, EXPERTS, BLOCK, FILES = 8, 256, 8, 24
GEOMETRY: dict[str, Any] = dict(
    num_hidden_layers=LAYERS, n_routed_experts=EXPERTS, first_k_dense_replace=1,
    num_experts_per_tok=8, n_group=8, topk_group=4,
)  # fmt: skip
MOE_LAYERS = LAYERS - 1
# per MoE layer: 256 experts x 3 linears, the shared expert's 3, q_a / q_b / kv_a / kv_b / o;
# the dense layer: its MLP's 3 and the same 5 attention linears
GROUPS = MOE_LAYERS * (EXPERTS * 3 + 3 + 5) + (3 + 5)
MESH = ("--tp", "2", "--ep", "4")


def _in_files(src: Path, dst: Path, files: int) -> Path:
    """``src``'s one ``model.safetensors`` as ``files`` files and an index, as a release comes:
    tensors in name order, cut into runs of about equal count (so a weight and its scale may
    land in two files)."""
    dst.mkdir()
    with safe_open(src / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
        weight_map: dict[str, str] = {}
        total = 0
        per = -(-len(names) // files)
        for k in range(files):
            part = names[k * per : (k + 1) * per]
            name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            chunk = {n: f.get_tensor(n) for n in part}
            save_file(chunk, str(dst / name), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in chunk.values())
            weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dsv3")
    bf16 = make_checkpoint("deepseek_v3", root / "bf16", **GEOMETRY)
    one = _quant.fp8_block(bf16, root / "one", block=BLOCK)
    return _in_files(one, root / "fp8", FILES)


def _json(*args: str) -> dict[str, Any]:
    done = run_cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout)


def test_inspect_and_plan_read_every_group(fp8: Path) -> None:
    held = tensors(fp8)
    assert len(held) > 10_000 and len(list(fp8.glob("*.safetensors"))) == FILES
    doc = _json("inspect", str(fp8))
    assert doc["model"]["tensors"] == len(held)
    quant = doc["model"]["quantization"]
    assert quant["quantized_weights"] == GROUPS
    experts = [g for g in quant["groups"] if ".experts.*." in g["pattern"]]
    assert {g["count"] for g in experts} == {MOE_LAYERS * EXPERTS}
    assert all(g["scheme"] == "fp8-block" for g in quant["groups"])
    # plan prices the checkpoint as stored: its weights are the files' tensor bytes
    plan = _json("plan", str(fp8), *MESH, "--gpu", "h100-sxm")
    assert plan["model"]["weight_bytes"] == sum(len(b) for _, _, b in held.values())
    assert len(plan["ranks"]) == 8


def test_split_verify_merge_through_the_cli(fp8: Path, tmp_path: Path) -> None:
    split, merged = tmp_path / "split", tmp_path / "merged"
    done = run_cli("reshard", str(fp8), str(split), *MESH)
    assert done.returncode == 0, done.stderr
    assert len(list(split.glob("*.safetensors"))) == 8
    doc = _json("verify", str(fp8), str(split), "--level", "bitwise")
    assert [x["status"] for x in doc["levels"]] == ["pass", "pass", "not-run"], doc["levels"]
    bitwise = next(x for x in doc["levels"] if x["name"] == "bitwise")
    assert bitwise["figures"]["tensors"] == len(tensors(fp8))
    # every shard was compared: each expert tensor (3 weights and their 3 scales) whole on
    # its ep rank, cut in two by tp; every other tensor on all 8 ranks (a tp cut or a replica)
    expert_tensors = MOE_LAYERS * EXPERTS * 6
    want = 2 * expert_tensors + 8 * (len(tensors(fp8)) - expert_tensors)
    assert bitwise["figures"]["shards"] == want
    # what reshard wrote is what plan priced, rank by rank
    plan = _json("plan", str(fp8), *MESH, "--gpu", "h100-sxm")
    files = sorted(split.glob("rank-*.safetensors"))
    written = [sum(e.end - e.begin for e in read_header(f).tensors) for f in files]
    priced = sorted(plan["ranks"], key=lambda r: r["rank"])
    assert written == [r["memory"]["weights"] for r in priced]
    done = run_cli("reshard", str(split), str(merged), "--format", "hf")
    assert done.returncode == 0, done.stderr
    same_checkpoint(fp8, merged)
