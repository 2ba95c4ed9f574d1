"""Every supported family, end to end: the flow a new user runs, one parametrized list.

For each family (a checkpoint written by transformers' own ``save_pretrained``, random weights):
the inventory from ``config.json`` alone equals the file's; then for each layout — TP2, TP2×PP2,
EP2 where the family has experts, and TP above its KV-head count — reshard, verify at every
level including forward (simulated ranks here; real gloo process groups are in
test_verify_forward.py and test_verify_real_sizes.py), merge back byte-identical, and
``from_pretrained`` loads the merge with logits equal to the original's.

Adding a family = one file in shardctl/archs/ + its config in tests/_models.py + one entry in
``FAMILIES``.
"""

from __future__ import annotations

from operator import attrgetter
from pathlib import Path

import pytest
import torch

from shardctl.archs import SUPPORTED, family_for
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_checkpoint, from_config_file
from shardctl.reshard.api import reshard
from shardctl.verify.adapters import SUPPORTED as FORWARD_SUPPORTED
from shardctl.verify.api import verify
from tests._models import make_checkpoint

# family config (tests/_models.py) -> layouts; the last of each list puts tp above the KV heads
FAMILIES: dict[str, list[Mesh]] = {
    "llama": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2
    "mistral": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2
    "qwen2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, qkv biases
    "qwen3": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, q_norm/k_norm
    "gemma": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 1, tied
    "gemma2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, soft-capping
    "phi3": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # fused qkv / gate_up, kv 2
    "gpt2": [Mesh(tp=2), Mesh(pp=2, tp=2)],  # Conv1D [in, out], MHA
    "granite": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, tied, config multipliers
    "mixtral": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=4)],  # kv 2
    # fam-dense
    "olmo2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # whole-projection q/k norm, kv 2
    "starcoder2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # biases, c_fc/c_proj, kv 2
    "cohere": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # [heads, head_dim] q/k norms
    "stablelm": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # per-head q/k norms, kv 2
    "glm4": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # fused gate_up, kv 2
    "gemma3_text": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, sliding 5:1, tied
    # fam-fused
    "gpt_neox": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # MHA 4 heads, per-head qkv
    "phi": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2, biased vocab-parallel head
    "falcon": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],  # kv 2 groups, tied
    # fam-moe: dense + sparse layers; qwen2_moe shared expert + gate; llama4 packed experts
    # [gate | up]; gpt_oss packed, interleaved gate/up, expert biases, sinks, sliding layers
    "qwen2_moe": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    "qwen3_moe": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    "llama4_text": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    "gpt_oss": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # fam-mla: MLA has no K/V heads to replicate; tp=4 = one head per rank
    "deepseek_v2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    "deepseek_v3": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # GLM-4.5 MoE: GQA (kv 2, biased q/k/v, q/k norms) with DeepSeek-V3's router and shared
    # experts; tp=4 replicates the kv heads
    "glm4_moe": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # MiniMax-M2: whole-projection q/k norms split with kv 2 heads (tp=4 replicates them),
    # sigmoid router with correction bias
    "minimax_m2": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # flagships: multimodal Llama-4; the vision tower on the first stage, split like vLLM's
    "llama4": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # multimodal Gemma-3: gemma3_text (kv 2, sliding 5:1, tied) beside a SigLIP tower
    "gemma3": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # multimodal Mistral-3: mistral (kv 2, untied) beside a Pixtral tower (4 heads)
    "mistral3": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # LLaVA-NeXT: granite (kv 2, tied, multipliers) beside a SigLIP tower (4 heads, its head)
    "llava_next": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # Qwen2.5-VL: qwen2 (kv 2) under its own names beside a ViT (4 heads, fused qkv)
    "qwen2_5_vl": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # Qwen2-VL: qwen2 (kv 2) beside a LayerNorm ViT whose fused qkv splits as one slice
    "qwen2_vl": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # Qwen3-VL: qwen3 (kv 2) under model.language_model.* beside a ViT with DeepStack mergers
    "qwen3_vl": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
    # Qwen3-VL-MoE: qwen3_moe (kv 2, a dense layer) with packed experts stored [E, H, 2I],
    # beside Qwen3-VL's ViT
    "qwen3_vl_moe": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(ep=2), Mesh(ep=2, tp=2), Mesh(tp=4)],
    # LLaVA-1.5: llama (kv 2, untied) beside a CLIP tower (4 heads)
    "llava": [Mesh(tp=2), Mesh(pp=2, tp=2), Mesh(tp=4)],
}
CASES = [(f, m) for f, meshes in FAMILIES.items() for m in meshes]


def test_every_family_file_is_in_the_flow() -> None:
    """The registry is the one list: a family file without an entry here fails."""
    assert set(FAMILIES) == set(SUPPORTED)
    for name in SUPPORTED:
        family = family_for(name)
        assert family.rules and family.forward is not None and family.follows, name
        assert family.shape_keys and family.config_keys, name  # a manifest's model: keys
        assert family.sliding_layers in ("none", "all", "even", "pattern"), name
    assert FORWARD_SUPPORTED == SUPPORTED  # verify's forward level runs every family


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _checkpoint(root: Path, family: str) -> Path:
    path = root / family
    if not path.exists():
        make_checkpoint(family, path)
    return path


def _logits(path: Path) -> torch.Tensor:
    import json

    import transformers

    family = family_for(json.loads((path / "config.json").read_text())["model_type"])
    assert family.forward is not None
    auto = getattr(transformers, family.forward.reference_auto)  # Mistral-3: ImageTextToText
    model = auto.from_pretrained(path, dtype="auto").eval()
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inventory_from_config_equals_checkpoint(root: Path, family: str) -> None:
    src = _checkpoint(root, family)
    # in name order: a file holds its tensors by dtype, then name (safetensors' order), and
    # transformers >= 5.24 saves DeepSeek's router in F32 (first in the file)
    by_name = attrgetter("fqn")
    assert from_config_file(src / "config.json").tensors == tuple(
        sorted(from_checkpoint(src).tensors, key=by_name)
    )


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_reshard_verify_merge(root: Path, tmp_path: Path, family: str, mesh: Mesh) -> None:
    src = _checkpoint(root, family)
    split = tmp_path / "split"
    reshard(src, split, mesh=mesh)
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"], [
        str(f) for lv in result.levels for f in lv.findings
    ]
    merged = tmp_path / "merged"
    reshard(split, merged)
    assert (merged / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert torch.equal(_logits(merged), _logits(src))
