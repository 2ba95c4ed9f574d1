"""Quantized checkpoints of the families whose published weights ship quantized: DeepSeek-V3
in FP8 (128x128 ``weight_scale_inv`` on MLA projections, shared and routed experts), Qwen3-MoE
in FP8 (the block format of Qwen3-*-FP8) and gpt-oss in MXFP4 (packed experts' ``*_blocks`` /
``*_scales``). Split (tp, ep x tp) -> merge is byte-identical, plan bytes are the written
bytes, verify's forward level passes on the dequantized weights.

The family files come from other branches (deepseek_v3, gpt_oss): each test skips, naming the
missing family, until its file is registered in shardctl.archs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardctl.archs import find
from shardctl.layout.engine import rank_weight_bytes
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_checkpoint, from_config_file
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests import _quant
from tests._models import make_checkpoint
from tests.test_reshard_roundtrip import same_checkpoint, tensors_of_file

# DeepSeek-V3's geometry scaled down so every 128x128 block still splits at tp=2, as the real
# one does at tp=8: per rank 2 heads x 192 q_b rows, 2 x 256 kv_b rows, 2 x 128 o_proj columns,
# moe_intermediate 256 -> 128.
DEEPSEEK = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=256, n_routed_experts=4,
    n_shared_experts=1, first_k_dense_replace=1, vocab_size=128,
)  # fmt: skip


def _need(family: str) -> None:
    if find(family) is None:
        pytest.skip(f"no {family} family file in shardctl.archs on this branch")


def _round_trip(src: Path, tmp: Path, mesh: Mesh) -> None:
    out = tmp / f"s{mesh.ep}{mesh.tp}"
    reshard(src, out, mesh=mesh)
    written = sorted(
        sum(len(b) for b in tensors_of_file(f).values()) for f in out.glob("rank-*.safetensors")
    )
    assert sorted(rank_weight_bytes(from_checkpoint(src), mesh).values()) == written
    reshard(out, tmp / f"m{mesh.ep}{mesh.tp}")
    same_checkpoint(src, tmp / f"m{mesh.ep}{mesh.tp}")
    result = verify(src, out, device="cpu", simulate=True)
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]


def test_deepseek_v3_fp8(tmp_path: Path) -> None:
    _need("deepseek_v3")
    src = _quant.fp8_block(
        make_checkpoint("deepseek_v3", tmp_path / "bf16", **DEEPSEEK), tmp_path / "fp8"
    )
    # flagships: DeepSeek's FP8 release stores the router's correction bias in F32 (the config
    # inventory says so, tests/test_flagships.py); save_pretrained from bf16 wrote it BF16
    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    for k in state:
        if k.endswith("e_score_correction_bias"):
            state[k] = state[k].float()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    _round_trip(src, tmp_path, Mesh(ep=2, tp=2))  # experts over ep, every tensor over tp
    # plan from the config alone: the same tensors (MLA's kv_a_proj_with_mqa quantized too)
    assert sorted(map(str, from_config_file(src / "config.json").tensors)) == sorted(
        map(str, from_checkpoint(src).tensors)
    )


def test_qwen3_moe_fp8(tmp_path: Path) -> None:
    """Qwen3-MoE in FP8 with 128x128 blocks (as Qwen/Qwen3-30B-A3B-FP8 ships): experts over ep,
    attention, dense layer and expert matrices over tp, each block whole on one rank."""
    _need("qwen3_moe")
    geometry = dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, moe_intermediate_size=256, vocab_size=128, num_hidden_layers=2,
        mlp_only_layers=[0],
    )  # fmt: skip
    src = _quant.fp8_block(
        make_checkpoint("qwen3_moe", tmp_path / "bf16", **geometry), tmp_path / "fp8"
    )
    _round_trip(src, tmp_path, Mesh(ep=2, tp=2))
    assert sorted(map(str, from_config_file(src / "config.json").tensors)) == sorted(
        map(str, from_checkpoint(src).tensors)
    )


def test_minimax_m2_fp8(tmp_path: Path) -> None:
    """MiniMax-M2 in FP8 with 128x128 blocks, as MiniMaxAI/MiniMax-M2 ships: experts over ep,
    attention and expert matrices over tp; the router, its correction bias and the split q/k
    norms stay 16-bit."""
    _need("minimax_m2")
    geometry = dict(
        hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, rotary_dim=64, vocab_size=128, num_hidden_layers=2, num_local_experts=4,
    )  # fmt: skip
    src = _quant.fp8_block(
        make_checkpoint("minimax_m2", tmp_path / "bf16", **geometry), tmp_path / "fp8"
    )
    _round_trip(src, tmp_path, Mesh(ep=2, tp=2))
    assert sorted(map(str, from_config_file(src / "config.json").tensors)) == sorted(
        map(str, from_checkpoint(src).tensors)
    )


def test_gpt_oss_mxfp4(tmp_path: Path) -> None:
    _need("gpt_oss")
    from safetensors.torch import load_file, save_file

    bf16 = make_checkpoint("gpt_oss", tmp_path / "bf16", intermediate_size=64)
    out: dict[str, object] = {}
    for k, v in load_file(bf16 / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{k}_blocks"], out[f"{k}_scales"] = _quant.mxfp4_pack(v)
        else:
            out[k] = v
    src = tmp_path / "mxfp4"
    src.mkdir()
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    for f in bf16.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, src / f.name)
    cfg = json.loads((src / "config.json").read_text())
    # as openai/gpt-oss-20b's config.json says it
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (src / "config.json").write_text(json.dumps(cfg))
    _round_trip(src, tmp_path, Mesh(ep=2, tp=2))
    assert sorted(map(str, from_config_file(src / "config.json").tensors)) == sorted(
        map(str, from_checkpoint(src).tensors)
    )  # experts over ep, every tensor over tp
