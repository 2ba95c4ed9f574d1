"""Quantized MoE checkpoints at a real tensor count: 5,000 groups placed by class.

``resolve_rules`` places the first member of each class (name pattern, shape, dtype and the
group's shapes and axes) through the rules and copies the result to the others, and ``plan``
prices by those classes (``layout.classes``); these tests hold that to the per-tensor path
and to what every member must get — its own weight's blocks — on a Qwen3-MoE of 128 experts
× 13 MoE layers (10,000+ tensors; transformers' ``save_pretrained``, then each linear
quantized in Qwen3-*-FP8's block layout, or GPTQ; widths shrunk 8x with the blocks, so every
split still keeps whole blocks), and check that one mis-shaped scale among them is still
refused, naming it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from shardctl.errors import InvalidInputError
from shardctl.layout.classes import classes_of
from shardctl.layout.engine import build_layout
from shardctl.layout.types import LayoutOptions, Mesh
from shardctl.model.inventory import from_checkpoint
from shardctl.quant.groups import group_tensors
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests import _quant
from tests._models import make_checkpoint
from tests.test_layout_classes import _counts, _fresh, _outcome, _shard_bytes
from tests.test_reshard_roundtrip import same_checkpoint

BLOCK = 16  # FP8 blocks of 16x16 on widths shrunk 8x: every split stays whole blocks
LAYERS, EXPERTS = 14, 128  # the first layer dense (tests._models): 13 MoE layers
GEOMETRY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, moe_intermediate_size=32, vocab_size=128, num_hidden_layers=LAYERS,
    num_experts=EXPERTS, num_experts_per_tok=8,
)  # fmt: skip
EXPERT_GROUPS = (LAYERS - 1) * EXPERTS * 3  # gate, up, down of every expert: 4,992
OTHER_GROUPS = LAYERS * 4 + 3  # q, k, v, o of every layer and the dense layer's MLP


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("many") / "bf16", **GEOMETRY)


@pytest.fixture(scope="module")
def fp8(bf16: Path) -> Path:
    return _quant.fp8_block(bf16, bf16.with_name("fp8"), block=BLOCK)


@pytest.fixture(scope="module")
def gptq(bf16: Path) -> Path:
    return _quant.gptq(bf16, bf16.with_name("gptq"), group=BLOCK)


@pytest.mark.parametrize("scheme", ["fp8", "gptq"])
def test_plan_bytes_by_class_equal_per_tensor_and_the_shards(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    """``plan`` prices a quantized MoE by tensor class (each class's first tensor resolved with
    its whole group): the bytes per rank equal the per-tensor resolution's and the shards'."""
    model = from_checkpoint(request.getfixturevalue(scheme))
    with _fresh():
        rc = classes_of(model, ())
    assert rc is not None and len(rc.rules) < 60  # thousands of members, a few dozen classes
    for mesh in (Mesh(ep=2, tp=2), Mesh(pp=2, ep=4), Mesh(pp=7, tp=2)):
        fast = _outcome(model, mesh, by_class=True)
        assert fast == _outcome(model, mesh, by_class=False), (scheme, mesh)
        assert fast[1] == _shard_bytes(model, mesh, LayoutOptions()), (scheme, mesh)
        counts = _counts(model, mesh, "none", by_class=True)  # plan's per-stage counts
        assert counts == _counts(model, mesh, "none", by_class=False), (scheme, mesh)


def test_every_member_holds_its_own_weights_blocks(fp8: Path) -> None:
    model = from_checkpoint(fp8)
    groups = group_tensors(model.tensors, model.config)
    assert len(model.tensors) > 10_000
    scales = [t.fqn for t in model.tensors if t.fqn.endswith(".weight_scale_inv")]
    assert len({id(g) for g in groups.values()}) == len(scales) == EXPERT_GROUPS + OTHER_GROUPS
    mesh = Mesh(ep=2, tp=2)
    layout = build_layout(model, mesh)
    checked = 0
    for rank in layout.ranks:
        held = {s.fqn: s for s in rank.shards}
        for fqn, shard in held.items():
            if not fqn.endswith(".weight_scale_inv"):
                continue
            weight = held[fqn.removesuffix("_scale_inv")]  # on the same rank
            (w,), (s,) = weight.pieces, shard.pieces
            # the scale's rows/columns are the weight's, in blocks: same cut, / 128
            assert s.offsets == tuple(o // BLOCK for o in w.offsets), fqn
            assert s.sizes == tuple(math.ceil(n / BLOCK) for n in w.sizes), fqn
            if ".experts." in fqn:  # experts whole on their ep rank: e // (E / ep)
                expert = int(fqn.split(".experts.")[1].split(".")[0])
                assert expert // (EXPERTS // mesh.ep) == rank.ep, fqn
            checked += 1
    # the dense and attention groups on all 4 ranks, each expert on its ep rank's 2 tp ranks
    assert checked == 4 * OTHER_GROUPS + 2 * EXPERT_GROUPS


def test_split_merge_is_byte_identical_and_verifies(fp8: Path, tmp_path: Path) -> None:
    split = tmp_path / "split"
    reshard(fp8, split, mesh=Mesh(ep=2, tp=2))
    assert verify(fp8, split, level="bitwise").ok
    merged = tmp_path / "merged"
    reshard(split, merged)  # a shardctl layout merges back to HF by default
    same_checkpoint(fp8, merged)


def test_one_misshaped_scale_among_thousands_is_refused(fp8: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fp8.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, bad / f.name)
    victim = "model.layers.4.mlp.experts.77.down_proj.weight_scale_inv"
    with safe_open(fp8 / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[victim] = tensors[victim][:, :1].contiguous()  # [2, 2] -> [2, 1]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidInputError) as err:
        reshard(bad, tmp_path / "out", mesh=Mesh(ep=2, tp=2))
    assert victim in str(err.value) and "dim 1 is 1, expected 2" in str(err.value)
    assert not (tmp_path / "out").exists()
    cfg = json.loads((bad / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
