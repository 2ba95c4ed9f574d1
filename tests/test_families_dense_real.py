"""The fam-dense families' forward level at real sizes, on real gloo process groups via the CLI.

Gemma-3 ships a 262,208-row vocabulary (tied): one forward's float64 logits at 16 tokens are
32 MiB, four times what the rendezvous store can carry. OLMo-2's q/k norm spans the whole
projection, so a tp rank's norm needs an all-reduce across the real process group — here at
OLMo-2-13B's 40 heads on tp 2 with its 100,352-token vocabulary. Real vocabularies and head
counts; only depth, head_dim and widths are shrunk (they do not change the layout's logic).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._cli import run_cli as _cli
from tests._models import make_checkpoint

REAL: dict[str, tuple[str, int, dict[str, Any]]] = {
    # Gemma-3-27B's text config: 32 q heads, 16 kv heads, vocab 262,208 (the 262,144-token
    # tokenizer plus 64 rows; transformers' Gemma3TextConfig default too). Six layers: five
    # sliding-window layers and one global, the real 5:1 pattern.
    "gemma3-262k": (
        "gemma3_text",
        2,
        dict(
            vocab_size=262_208,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=8,
            num_hidden_layers=6,
            sliding_window=4,
        ),
    ),
    # allenai/OLMo-2-1124-13B: 40 heads (MHA), vocab 100,352; head_dim shrunk to 4.
    "olmo2-100k": (
        "olmo2",
        2,
        dict(
            vocab_size=100_352,
            hidden_size=160,
            intermediate_size=320,
            num_attention_heads=40,
            num_key_value_heads=40,
            num_hidden_layers=2,
        ),
    ),
}


@pytest.mark.parametrize("name", list(REAL))
def test_forward_level_at_real_size(tmp_path: Path, name: str) -> None:
    family, tp, overrides = REAL[name]
    src = tmp_path / "hf"
    make_checkpoint(family, src, **overrides)
    dst = tmp_path / f"tp{tp}"
    done = _cli("reshard", str(src), str(dst), "--tp", str(tp), "--quiet")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(src), str(dst), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    data = json.loads(done.stdout)
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"]
    env = data["environment"]
    assert (env["backend"], env["world_size"], env["simulated"]) == ("gloo", tp, False)
    forward = next(lv for lv in data["levels"] if lv["name"] == "forward")
    tokens = forward["figures"]["batch"] * forward["figures"]["seq_len"]
    assert tokens * overrides["vocab_size"] * 8 > 8 * 2**20, forward["figures"]
