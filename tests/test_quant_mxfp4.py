"""MXFP4 (gpt-oss layout: ``*_blocks`` U8 ``[E, out, in/32, 16]``, ``*_scales`` U8 e8m0
``[E, out, in/32]``, as openai/gpt-oss-20b's index lists them) placed by rules written for the
bf16 tensors (``gate_up_proj [E, H, 2I]`` S(2), ``down_proj [E, I, H]`` S(1), as the gpt_oss
family places them): the blocks and scales follow, a 32-value block is never cut.

The architecture is a made-up one placed by manifest rules, so this runs without a gpt_oss
family file; tests/_quant.py ``mxfp4_pack`` writes real MXFP4 codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardctl.errors import LayoutError
from shardctl.layout.types import Mesh, RuleSpec
from shardctl.quant.dequant import dequantize, mxfp4
from shardctl.reshard.api import reshard
from tests._quant import mxfp4_pack
from tests.test_reshard_roundtrip import same_checkpoint

EX = "model.layers.*.mlp.experts"
RULES = [
    RuleSpec(f"{EX}.gate_up_proj", tp="S(2)"),
    RuleSpec(f"{EX}.down_proj", tp="S(1)"),
    RuleSpec("model.*", tp="R", stage="all"),
]


def write(root: Path, inter: int, experts: int = 4, hidden: int = 64) -> tuple[Path, dict]:
    torch.manual_seed(0)
    bf16 = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(experts, hidden, 2 * inter),
        "model.layers.0.mlp.experts.down_proj": torch.randn(experts, inter, hidden),
    }
    out: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(hidden)}
    for name, w in bf16.items():
        out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4_pack(w)
    root.mkdir()
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "toy_mxfp4", "quantization_config": {"quant_method": "mxfp4"}}
    (root / "config.json").write_text(json.dumps(config))
    return root, bf16


def test_pack_matches_the_values(tmp_path: Path) -> None:
    src, bf16 = write(tmp_path / "m", inter=64)
    t = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    deq = mxfp4(t[f"{name}_blocks"], t[f"{name}_scales"])
    w = bf16[name]
    assert deq.shape == w.shape
    # e2m1 under one power-of-two scale per 32 values: a few percent of the weights' norm
    assert ((deq - w).norm() / w.norm()).item() < 0.15
    # and within each block, a value is off by at most the block's scale (2 ulps of e2m1 at
    # the clipped top: 8·2^e -> 6·2^e)
    scale = torch.pow(2.0, t[f"{name}_scales"].float() - 127)  # [E, out, in/32]
    bound = scale.repeat_interleave(32, -1).transpose(-1, -2) * 2
    assert ((deq - w).abs() <= bound + 1e-6).all()


def test_split_merge_and_each_rank_holds_its_blocks(tmp_path: Path) -> None:
    src, _ = write(tmp_path / "m", inter=64)
    reshard(src, tmp_path / "tp2", mesh=Mesh(tp=2), rules=RULES)
    config = json.loads((src / "config.json").read_text())
    full = dequantize(load_file(src / "model.safetensors"), config, torch.float32)
    for r, f in enumerate(sorted((tmp_path / "tp2").glob("rank-*.safetensors"))):
        local = dequantize(load_file(f), config, torch.float32)
        gu = full["model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2I] split on 2I
        assert torch.equal(
            local["model.layers.0.mlp.experts.gate_up_proj"], gu[:, :, r * 64 : (r + 1) * 64]
        )
        down = full["model.layers.0.mlp.experts.down_proj"]  # [E, I, H] split on I
        assert torch.equal(
            local["model.layers.0.mlp.experts.down_proj"], down[:, r * 32 : (r + 1) * 32]
        )
    reshard(tmp_path / "tp2", tmp_path / "merged")
    same_checkpoint(src, tmp_path / "merged")


def test_a_cut_block_is_refused(tmp_path: Path) -> None:
    src, _ = write(tmp_path / "m", inter=32)  # down_proj in-features 32: tp 2 halves a block
    with pytest.raises(LayoutError) as exc:
        reshard(src, tmp_path / "tp2", mesh=Mesh(tp=2), rules=RULES)
    assert exc.value.message.startswith(
        "MXFP4 block of 32 on in-features 32 with tp 2: 16 per rank, which is not a multiple of 32"
    ), exc.value.message
    assert not (tmp_path / "tp2").exists()
