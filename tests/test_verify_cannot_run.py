"""A verifier that cannot check says so: exit 5 naming the level, never exit 1.

Qwen3 and Gemma-2 used to get NOT EQUIVALENT (exit 1) for correct shards because the forward
level had no adapter for them (they now run: tests/test_verify_forward.py). EXAONE-4 (a real
transformers 5.23 architecture: OLMo-2-style post norms, per-head q/k norms) has no family file,
but a manifest's ``rules:`` place its tensors, so reshard and the structure and bitwise levels
work — and the forward level, which cannot run it, must exit 5. (This test used OLMo-2 until
OLMo-2 got its family file.) When the forward level learns EXAONE-4, move this test to a family
it still cannot run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests._cli import run_cli as _cli

RULES = """\
model:
  config: {config}
mesh: {{tp: 2}}
rules:
  - {{match: "model.embed_tokens.weight", tp: vocab}}
  - {{match: "lm_head.weight", tp: vocab}}
  - {{match: "model.layers.*.self_attn.[qkv]_proj.weight", tp: colwise}}
  - {{match: "model.layers.*.self_attn.[qk]_norm.weight", tp: R}}
  - {{match: "model.layers.*.self_attn.o_proj.weight", tp: rowwise}}
  - {{match: "model.layers.*.mlp.gate_proj.weight", tp: colwise}}
  - {{match: "model.layers.*.mlp.up_proj.weight", tp: colwise}}
  - {{match: "model.layers.*.mlp.down_proj.weight", tp: rowwise}}
  - {{match: "model.layers.*.post_*_layernorm.weight", tp: R}}
  - {{match: "model.norm.weight", tp: R}}
"""


def _save_exaone4(out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "exaone4",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)


def test_forward_level_it_cannot_run_exits_5(tmp_path: Path) -> None:
    src, dst = tmp_path / "hf", tmp_path / "tp2"
    _save_exaone4(src)
    manifest = tmp_path / "exaone4.yaml"
    manifest.write_text(RULES.format(config=src / "config.json"))
    done = _cli("reshard", str(src), str(dst), "--manifest", str(manifest), "--quiet")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(src), str(dst), "--device", "cpu")
    assert done.returncode == 5, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("shardctl: error:")]
    assert len(lines) == 1 and "could not verify the forward level" in lines[0]
    assert "'exaone4'" in lines[0] and "structure and bitwise passed" in lines[0]
    assert "Traceback" not in done.stderr
    # the levels that can run still gate: bitwise alone passes
    assert _cli("verify", str(src), str(dst), "--level", "bitwise").returncode == 0
