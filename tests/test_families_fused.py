"""GPT-NeoX, Phi-1/2 and Falcon beyond the one config each in test_families.py.

- the other layouts of each family (Falcon MQA and classic MHA, GPT-NeoX sequential residual
  without attention biases and tied, Phi with qk_layernorm) through the same flow: inventory
  from config == ``save_pretrained``'s, reshard, verify all three levels, merge byte-identical;
- the trap this branch exists for: splitting an interleaved ``query_key_value`` as if it were
  ``[Q; K; V]`` (a manifest rule without ``groups``) is self-consistent — structure and bitwise
  pass — but verify's forward level must catch it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.layout.types import Mesh, RuleSpec
from shardctl.model.inventory import from_checkpoint, from_config_file
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._models import make_checkpoint

VARIANTS: dict[str, list[Mesh]] = {
    "gpt_neox-sequential-nobias": [Mesh(tp=4), Mesh(pp=2, tp=2)],  # tied head on the last stage
    "phi-qk-layernorm": [Mesh(tp=2)],
    "falcon-mqa": [Mesh(tp=4), Mesh(pp=2, tp=2)],  # one k/v head, replicated on every rank
    "falcon-mha-sequential-bias": [Mesh(tp=2)],
}
CASES = [(v, m) for v, meshes in VARIANTS.items() for m in meshes]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fused")


def _checkpoint(root: Path, name: str) -> Path:
    path = root / name
    if not path.exists():
        make_checkpoint(name, path)
    return path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inventory_from_config_equals_checkpoint(root: Path, name: str) -> None:
    src = _checkpoint(root, name)
    assert from_config_file(src / "config.json").tensors == from_checkpoint(src).tensors


@pytest.mark.parametrize(("name", "mesh"), CASES, ids=[f"{v}-{m}" for v, m in CASES])
def test_reshard_verify_merge(root: Path, tmp_path: Path, name: str, mesh: Mesh) -> None:
    src = _checkpoint(root, name)
    split = tmp_path / "split"
    reshard(src, split, mesh=mesh)
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"], [
        str(f) for lv in result.levels for f in lv.findings
    ]
    merged = tmp_path / "merged"
    reshard(split, merged)
    assert (merged / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# Each family's fused qkv, split as if it were [Q; K; V] (no ``groups``): wrong rows per rank.
WRONG = {
    "gpt_neox": RuleSpec(
        "gpt_neox.layers.*.attention.query_key_value.*", tp="colwise", parts=("q", "kv", "kv")
    ),
    "falcon": RuleSpec(
        "transformer.h.*.self_attention.query_key_value.*", tp="colwise", parts=("q", "kv", "kv")
    ),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_qkv_split_as_q_k_v_blocks_fails_forward(root: Path, tmp_path: Path, name: str) -> None:
    src = _checkpoint(root, name)
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2), rules=[WRONG[name]])
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "fail"]
    assert not result.ok


def test_alibi_falcon_at_tp2_could_not_verify_never_not_equivalent(
    root: Path, tmp_path: Path
) -> None:
    """ALiBi slopes belong to global head indices; the forward level does not run ALiBi at
    tp > 1, so it must say "could not verify" (exit 5), not claim a difference (exit 1)."""
    from shardctl.errors import EnvironmentFailure

    src = tmp_path / "alibi"
    make_checkpoint("falcon-mha-sequential-bias", src, alibi=True)
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    with pytest.raises(EnvironmentFailure, match=r"could not verify the forward level.*ALiBi"):
        verify(src, split, device="cpu", simulate=True)
    assert verify(src, split, level="bitwise").ok
    tp1 = tmp_path / "pp2"  # tp = 1: the forward level runs it
    reshard(src, tp1, mesh=Mesh(pp=2))
    result = verify(src, tp1, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"]


def test_old_pythia_buffers_travel_and_forward_skips_them(root: Path, tmp_path: Path) -> None:
    """Older Pythia hub files also store the causal-mask buffers and rotary ``inv_freq`` per
    layer, which transformers 5 recomputes: reshard places them (replicated), bitwise checks
    them, the forward level skips them instead of calling them unexpected."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "pythia-old"
    make_checkpoint("gpt_neox", src)
    tensors = load_file(src / "model.safetensors")
    for i in range(2):
        p = f"gpt_neox.layers.{i}.attention"
        tensors[f"{p}.bias"] = torch.tril(torch.ones(128, 128, dtype=torch.bool))[None, None]
        tensors[f"{p}.masked_bias"] = torch.tensor(-1e9)
        tensors[f"{p}.rotary_emb.inv_freq"] = torch.rand(2)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    split = tmp_path / "split"
    reshard(src, split, mesh=Mesh(tp=2))
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"], [
        str(f) for lv in result.levels for f in lv.findings
    ]
    merged = tmp_path / "merged"
    reshard(split, merged)
    assert (merged / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
