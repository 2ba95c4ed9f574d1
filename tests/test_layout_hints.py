"""Layout errors a user acts on: every unplaced tensor at once (as fqn patterns), and tp hints
that list the degrees every constraint allows."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from shardctl.errors import LayoutError
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh, RuleSpec
from shardctl.layout.unplaced import SHOWN, UnplacedTensorsError, fqn_pattern
from shardctl.model.types import ModelInfo
from tests._layout_models import inventory, llama3_8b

ROOT = Path(__file__).resolve().parent.parent


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def _renamed(model: ModelInfo, old: str, new: str) -> ModelInfo:
    tensors = tuple(replace(t, fqn=t.fqn.replace(old, new)) for t in model.tensors)
    return replace(model, tensors=tensors)


def test_fqn_pattern_stars_every_index() -> None:
    assert fqn_pattern("model.layers.3.mlp.experts.7.w1.weight") == (
        "model.layers.*.mlp.experts.*.w1.weight"
    )
    assert fqn_pattern("h.0.1.bias") == "h.*.*.bias"
    assert fqn_pattern("lm_head.weight") == "lm_head.weight"


def test_every_unplaced_tensor_in_one_error() -> None:
    model = _renamed(_renamed(llama3_8b(), "mlp.gate_proj", "mlp.foo"), "mlp.up_proj", "mlp.bar")
    with pytest.raises(UnplacedTensorsError) as err:
        build_layout(model, Mesh(tp=2))
    e = err.value
    assert len(e.fqns) == 64
    assert e.patterns == {"model.layers.*.mlp.bar.weight": 32, "model.layers.*.mlp.foo.weight": 32}
    line = str(e)
    assert line.startswith("rules: 64 tensors placed by no rule (2 patterns): ")
    assert "model.layers.*.mlp.foo.weight (×32), model.layers.*.mlp.bar.weight (×32)" in line
    assert "\n" not in line
    # both rules at once fix it: one rerun, not one per tensor
    rules = (
        RuleSpec("model.layers.*.mlp.foo.weight", tp="colwise"),
        RuleSpec("model.layers.*.mlp.bar.weight", tp="colwise"),
    )
    assert build_layout(model, Mesh(tp=2), rules=rules).ranks


def test_long_lists_are_truncated_with_a_count_but_carried_whole() -> None:
    base = inventory("llama", hidden=16, layers=2, heads=4, kv_heads=2, inter=32, vocab=64)
    extra = tuple(
        replace(base.tensors[0], fqn=f"model.layers.0.extra_{i}.weight", shape=(4,))
        for i in range(SHOWN + 5)
    )
    model = replace(base, tensors=base.tensors + extra)
    with pytest.raises(UnplacedTensorsError) as err:
        build_layout(model, Mesh())
    assert len(err.value.fqns) == SHOWN + 5
    assert ", … and 5 more patterns;" in str(err.value)


def test_unsupported_architecture_lists_all_patterns_via_cli(tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "exaone4",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=128,
    )
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "ck")
    (tmp_path / "m.yaml").write_text(f"model: {{checkpoint: {tmp_path / 'ck'}}}\n")
    proc = shardctl("plan", str(tmp_path / "m.yaml"))
    assert proc.returncode == 3, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardctl: error:")]
    assert len(lines) == 1
    line = lines[0]
    assert "architecture 'exaone4' has no preset" in line
    for pattern in (
        "model.embed_tokens.weight",
        "model.layers.*.self_attn.q_proj.weight (×3)",
        "model.layers.*.self_attn.q_norm.weight (×3)",
        "model.layers.*.mlp.down_proj.weight (×3)",
        "model.layers.*.post_feedforward_layernorm.weight (×3)",
        "lm_head.weight",
    ):
        assert pattern in line, pattern


# -- valid degrees from all constraints ----------------------------------------------------------


def _hinted(model: ModelInfo, tp: int) -> tuple[int, ...]:
    with pytest.raises(LayoutError) as err:
        build_layout(model, Mesh(tp=tp))
    text = str(err.value)
    assert "tp degrees that split every tensor" in text
    listed = text.split("experts): {")[1].split("}")[0]
    return tuple(int(x) for x in listed.split(", "))


@pytest.mark.parametrize(
    ("model", "bad"),
    [
        (llama3_8b(), 3),
        (
            inventory(
                "qwen2", hidden=3584, layers=1, heads=28, kv_heads=4, inter=18944, vocab=152064
            ),
            3,
        ),
        (inventory("llama", hidden=48, layers=1, heads=12, kv_heads=4, inter=24, vocab=48), 5),
        (
            inventory(
                "mixtral", hidden=64, layers=1, heads=8, kv_heads=2, inter=48, vocab=64, experts=4
            ),
            3,
        ),
    ],
    ids=["llama-3-8b", "qwen2-7b", "12-heads", "mixtral"],
)
def test_hinted_degrees_are_exactly_those_that_build(model: ModelInfo, bad: int) -> None:
    hinted = _hinted(model, bad)
    for tp in range(1, 65):
        try:
            build_layout(model, Mesh(tp=tp))
            builds = True
        except LayoutError:
            builds = False
        assert builds == (tp in hinted), tp


def test_llama3_8b_tp3_hint_never_names_a_degree_that_fails_on_heads() -> None:
    # down_proj (14336 columns) alone would suggest 7, 14, 28 ...; the heads (32) refuse those.
    hinted = _hinted(llama3_8b(), 3)
    assert hinted == (1, 2, 4, 8, 16, 32)  # 16, 32: K/V heads (8) replicated over tp
    proc = shardctl("plan", str(ROOT / "manifests" / "llama-3-8b-tp1.yaml"), "--tp", "3")
    assert proc.returncode == 3
    assert "experts): {1, 2, 4, 8, 16, 32}" in proc.stderr
    assert "use tp in" not in proc.stderr
