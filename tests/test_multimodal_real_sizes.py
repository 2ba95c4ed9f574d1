"""verify's forward level on the multimodal families at the sizes users have.

Every image-text family ran its forward level only at vocabulary 256 before (their real sizes
were covered by inventory, layout and plan tests only). Here each runs the real CLI — reshard,
then verify's three levels on real gloo process groups, against the
``*ForConditionalGeneration`` logits transformers computes from the checkpoint its own
``save_pretrained`` wrote — with the published vocabulary and the published head counts of
both the language model and the vision tower, shrunk only in head width and depth (which do
not change the layout's logic):

- Qwen2-VL-7B / Qwen2.5-VL-7B: vocabulary 152,064, 28 query / 4 KV heads, a 16-head tower;
- Qwen3-VL-8B: 151,936, 32 / 8 heads, a 16-head tower with its 2,304-entry position table;
- Qwen3-VL-30B-A3B (MoE): 151,936, 32 / 4 heads, 128 packed experts, top 8, at tp 2 × ep 2;
- Gemma-3 (4B): 262,208, 8 / 4 heads, a 16-head SigLIP tower on 896-pixel images;
- Mistral-Small-3.1: 131,072, 32 / 8 heads, a 16-head Pixtral tower;
- Llama-4-Scout: 202,048, 40 / 8 heads, 16 experts, a 16-head tower on 336-pixel tiles;
- LLaVA-1.5-7B: 32,064, 32 heads, a 16-head CLIP tower (336 pixels);
- granite-vision-3.2 (LLaVA-NeXT): 49,156, 32 / 8 heads, a 16-head SigLIP tower.

The forward level runs the language model (the towers are compared bit for bit, every tensor
counted); its logits are ``tokens × vocabulary`` float64, several MiB at these vocabularies (the
size that once broke every vocabulary above ~8k: tests/test_verify_real_sizes.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._cli import run_cli as _cli
from tests._models import CONFIGS, make_checkpoint


def _nested(name: str, text: dict[str, Any], vision: dict[str, Any], **top: Any) -> dict:
    """``CONFIGS[name]``'s overrides: its text and vision sections updated, top-level keys."""
    return {
        "text_config": {**CONFIGS[name]["text_config"], **text},
        "vision_config": {**CONFIGS[name]["vision_config"], **vision},
        **top,
    }


# head_dim 8 (of 128): the multimodal rotary sections scaled with it, 16/24/24 of 64 -> 1/1/2 of 4
MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}
QWEN_TEXT = dict(num_hidden_layers=2, intermediate_size=448, rope_scaling=MROPE)
QWEN3_ROPE = {
    "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [1, 1, 2],
    "mrope_interleaved": True,
}  # fmt: skip
# shape -> (tests._models config, tp, ep, overrides)
# fmt: off
REAL: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "qwen2-vl-7b-shape": (
        "qwen2_vl",
        2,
        1,
        _nested(
            "qwen2_vl",
            dict(QWEN_TEXT, vocab_size=152_064, hidden_size=224, num_attention_heads=28,
                 num_key_value_heads=4),
            dict(depth=2, embed_dim=64, num_heads=16, hidden_size=224, mlp_ratio=4),
        ),
    ),
    "qwen2.5-vl-7b-shape": (
        "qwen2_5_vl",
        2,
        1,
        _nested(
            "qwen2_5_vl",
            dict(QWEN_TEXT, vocab_size=152_064, hidden_size=224, num_attention_heads=28,
                 num_key_value_heads=4),
            dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=16,
                 out_hidden_size=224, fullatt_block_indexes=[1]),
        ),
    ),
    "qwen3-vl-8b-shape": (
        "qwen3_vl",
        4,
        1,
        _nested(
            "qwen3_vl",
            dict(num_hidden_layers=2, vocab_size=151_936, hidden_size=256, intermediate_size=512,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=8,
                 rope_parameters=QWEN3_ROPE),
            dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=16, out_hidden_size=256,
                 deepstack_visual_indexes=[0, 2], num_position_embeddings=2304),
        ),
    ),
    "qwen3-vl-30b-a3b-shape": (
        "qwen3_vl_moe",
        2,
        2,
        _nested(
            "qwen3_vl_moe",
            dict(num_hidden_layers=2, vocab_size=151_936, hidden_size=256, intermediate_size=512,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=8,
                 moe_intermediate_size=16, num_experts=128, num_experts_per_tok=8,
                 mlp_only_layers=[], rope_parameters=QWEN3_ROPE),
            dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=16, out_hidden_size=256,
                 deepstack_visual_indexes=[0], num_position_embeddings=2304),
        ),
    ),
    "gemma-3-4b-shape": (
        "gemma3",
        2,
        1,
        _nested(
            "gemma3",
            dict(num_hidden_layers=2, vocab_size=262_208, hidden_size=128, intermediate_size=256,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                 query_pre_attn_scalar=8, sliding_window=8),
            dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=16, image_size=896, patch_size=14),
            mm_tokens_per_image=256, image_token_index=262_144, boi_token_index=255_999,
            eoi_token_index=256_000,
        ),
    ),
    "mistral-small-3.1-shape": (
        "mistral3",
        2,
        1,
        _nested(
            "mistral3",
            dict(num_hidden_layers=2, vocab_size=131_072, hidden_size=256, intermediate_size=512,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=8),
            dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=16, head_dim=4, image_size=1540, patch_size=14),
        ),
    ),
    "llama-4-scout-shape": (
        "llama4",
        2,
        1,
        _nested(
            "llama4",
            dict(num_hidden_layers=2, vocab_size=202_048, hidden_size=320, intermediate_size=16,
                 intermediate_size_mlp=64, num_attention_heads=40, num_key_value_heads=8,
                 head_dim=8, num_local_experts=16, num_experts_per_tok=1,
                 interleave_moe_layer_step=1),
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=16, image_size=336, patch_size=14),
        ),
    ),
    "llava-1.5-7b-shape": (
        "llava",
        2,
        1,
        _nested(
            "llava",
            dict(num_hidden_layers=2, vocab_size=32_064, hidden_size=256, intermediate_size=512,
                 num_attention_heads=32, num_key_value_heads=32),
            dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=16, image_size=336, patch_size=14, projection_dim=64),
            image_token_index=32_000,
        ),
    ),
    "granite-vision-3.2-shape": (
        "llava_next",
        2,
        1,
        _nested(
            "llava_next",
            dict(num_hidden_layers=2, vocab_size=49_156, hidden_size=256, intermediate_size=512,
                 num_attention_heads=32, num_key_value_heads=8),
            dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=16, image_size=384, patch_size=14),
            image_token_index=49_155, image_grid_pinpoints=[[384, 768], [768, 384], [768, 768]],
        ),
    ),
}
# fmt: on


@pytest.mark.parametrize("name", list(REAL))
def test_forward_level_at_real_vocabulary_and_heads(tmp_path: Path, name: str) -> None:
    family, tp, ep, overrides = REAL[name]
    src = tmp_path / "hf"
    make_checkpoint(family, src, **overrides)
    config = json.loads((src / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    assert vocab == overrides["text_config"]["vocab_size"]  # written as given, not defaulted
    dst = tmp_path / f"tp{tp}ep{ep}"
    done = _cli("reshard", str(src), str(dst), "--tp", str(tp), "--ep", str(ep), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    done = _cli("verify", str(src), str(dst), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    data = json.loads(done.stdout)
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"], data["levels"]
    assert data["environment"]["backend"] == "gloo"
    assert data["environment"]["world_size"] == tp * ep
    assert data["environment"]["simulated"] is False
    bitwise = next(lv for lv in data["levels"] if lv["name"] == "bitwise")
    names = json.loads((dst / "shardctl.layout.json").read_text())["tensors"]["fqn"]
    towers = [f for f in names if "vision" in f or "visual" in f]
    assert towers and bitwise["figures"]["tensors"] == len(names)  # the tower compared too
    forward = next(lv for lv in data["levels"] if lv["name"] == "forward")
    tokens = forward["figures"]["batch"] * forward["figures"]["seq_len"]
    assert tokens * vocab * 8 > 4 * 2**20, forward["figures"]
