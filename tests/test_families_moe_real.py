"""The MoE families' forward level at real sizes, through the CLI, on real gloo process groups.

Qwen3-MoE as Qwen3-235B-A22B ships it where the layout's logic lives: its 151,936-entry
vocabulary, 64 query / 4 KV heads, 8 experts chosen per token; shrunk only in depth (2 layers),
width (hidden 256, head_dim 8), expert count (16 of 128) and width (moe_intermediate 32), which
change no placement. EP2×TP2: each ep rank holds 8 experts' tensors, tp splits heads and every
expert. gpt-oss at its 201,088-entry vocabulary with 64 / 8 heads and
its packed, interleaved experts, on TP2 (each rank's gate/up columns must pair up).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._cli import run_cli as _cli
from tests._models import make_checkpoint

REAL = {
    "qwen3_moe-152k": (
        "qwen3_moe",
        dict(
            vocab_size=151_936,
            hidden_size=256,
            head_dim=8,
            num_attention_heads=64,
            num_key_value_heads=4,
            num_experts=16,
            num_experts_per_tok=8,
            moe_intermediate_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            mlp_only_layers=[],
        ),
        ["--ep", "2", "--tp", "2"],
        4,
    ),
    "gpt_oss-201k": (
        "gpt_oss",
        dict(
            vocab_size=201_088,
            hidden_size=64,
            head_dim=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=4,
            intermediate_size=32,
            num_hidden_layers=2,
        ),
        ["--tp", "2"],
        2,
    ),
}


@pytest.mark.parametrize("name", list(REAL))
def test_moe_forward_level_at_real_vocabulary(tmp_path: Path, name: str) -> None:
    family, overrides, mesh, world = REAL[name]
    src = tmp_path / "hf"
    make_checkpoint(family, src, **overrides)
    dst = tmp_path / "split"
    done = _cli("reshard", str(src), str(dst), *mesh, "--quiet")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(src), str(dst), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "Traceback" not in done.stderr
    data = json.loads(done.stdout)
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"]
    env = data["environment"]
    assert (env["backend"], env["world_size"], env["simulated"]) == ("gloo", world, False)
    forward = next(lv for lv in data["levels"] if lv["name"] == "forward")
    assert forward["figures"]["moe_layers"] == 2  # routing pinned in both layers
    tokens = forward["figures"]["batch"] * forward["figures"]["seq_len"]
    assert tokens * overrides["vocab_size"] * 8 > 8 * 2**20, forward["figures"]
