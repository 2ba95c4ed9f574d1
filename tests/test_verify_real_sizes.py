"""verify's forward level at the sizes users have: real vocabularies and head counts.

The logits of one forward are ``tokens × vocab`` float64 — 16 MiB at 16 tokens of Llama-3's
128,256-entry vocabulary. They once travelled through torch's TCPStore, which drops values over
8 MiB: every vocabulary above ~8k failed with "Connection reset by peer" while the suite, at
vocab 256, passed. These tests run the real CLI on real process groups (gloo) with the real
vocabulary and head counts, shrunk only in depth and width (which do not change the layout's
logic): hidden 256 keeps 32 query heads and 8 KV heads of head_dim 8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._cli import run_cli as _cli
from tests._models import LLAMA3_VOCAB, make_checkpoint

# (family, vocab, overrides): Llama-3's vocabulary and head counts; Qwen2's 151,936 vocabulary
# with its 28/4 heads and biases.
REAL = {
    "llama3-128k": ("llama", LLAMA3_VOCAB),
    "qwen2-152k": (
        "qwen2",
        dict(
            vocab_size=151_936,
            hidden_size=224,
            intermediate_size=448,
            num_attention_heads=28,
            num_key_value_heads=4,
            num_hidden_layers=2,
        ),
    ),
}


@pytest.mark.parametrize(
    ("name", "tp"),
    [("llama3-128k", 4), ("qwen2-152k", 2)],
    ids=["llama3-128k-tp4", "qwen2-152k-tp2"],
)
def test_forward_level_at_real_vocabulary(tmp_path: Path, name: str, tp: int) -> None:
    family, overrides = REAL[name]
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
    assert data["environment"]["backend"] == "gloo"
    assert data["environment"]["world_size"] == tp
    assert data["environment"]["simulated"] is False
    forward = next(lv for lv in data["levels"] if lv["name"] == "forward")
    # the logits really were vocabulary-sized: above the store's 8 MiB, so the old path failed
    tokens = forward["figures"]["batch"] * forward["figures"]["seq_len"]
    assert tokens * overrides["vocab_size"] * 8 > 8 * 2**20, forward["figures"]


def test_forward_level_at_real_vocabulary_catches_a_wrong_layout(tmp_path: Path) -> None:
    """Sharp at size too: o_proj split on the wrong dim, recorded as such (so structure and
    bitwise pass: the record describes the bytes exactly), must fail the forward level."""
    from shardctl.layout.types import Mesh
    from tests._split import split_checkpoint, write_record

    family, overrides = REAL["llama3-128k"]
    src = tmp_path / "hf"
    make_checkpoint(family, src, **overrides)
    dst = tmp_path / "tp2-wrong"
    layout, files = split_checkpoint(src, dst, Mesh(tp=2), fault="rowwise-dim0")
    write_record(src, dst, layout, files)
    done = _cli("verify", str(src), str(dst), "--device", "cpu", "--json")
    assert done.returncode == 1, done.stderr[-3000:]
    data = json.loads(done.stdout)
    statuses = {lv["name"]: lv["status"] for lv in data["levels"]}
    assert statuses == {"structure": "pass", "bitwise": "pass", "forward": "fail"}
