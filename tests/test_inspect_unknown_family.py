"""An architecture with no family file (``nemotron``: transformers 5.23 has it, shardctl has no
file for it), through the real CLI: ``inspect`` shows the manifest ``rules:`` that transformers'
``base_model_tp_plan`` implies (never applied), ``reshard`` refuses in one line naming the
closest family and those rules, and a manifest made of the suggested rules reshards and passes
the bitwise level (the forward level cannot run it: exit 5, "could not verify", never 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._cli import run_cli as _cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("unknown") / "nemotron"
    cfg = AutoConfig.for_model(
        "nemotron", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def suggested(nemotron: Path) -> dict[str, Any]:
    done = _cli("inspect", str(nemotron), "--json")
    assert done.returncode == 0, done.stderr
    sug: dict[str, Any] = json.loads(done.stdout)["suggested_rules"]
    return sug


def test_inspect_shows_rules_from_the_tp_plan(nemotron: Path, suggested: dict[str, Any]) -> None:
    sug = suggested
    assert "NemotronConfig.base_model_tp_plan" in sug["source"]
    assert sug["applied"] is False
    rules = set(sug["rules"])
    assert '{match: "model.layers.*.self_attn.q_proj.weight", tp: colwise}' in rules
    assert '{match: "model.layers.*.self_attn.o_proj.weight", tp: rowwise}' in rules
    assert '{match: "model.layers.*.mlp.up_proj.weight", tp: colwise}' in rules
    assert '{match: "model.layers.*.mlp.down_proj.weight", tp: rowwise}' in rules
    assert '{match: "model.embed_tokens.weight", tp: vocab, stage: embedding}' in rules
    assert '{match: "model.norm.weight", tp: R, stage: last}' in rules
    human = _cli("inspect", str(nemotron))
    assert "not applied" in human.stdout and "rules:" in human.stdout


def test_unknown_family_refused_naming_rules_then_manifest_works(
    nemotron: Path, suggested: dict[str, Any], tmp_path: Path
) -> None:
    done = _cli("reshard", str(nemotron), str(tmp_path / "refused"), "--tp", "2")
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "closest known family" in lines[0]
    assert '{match: "model.layers.*.mlp.up_proj.weight", tp: colwise}' in lines[0]
    assert not (tmp_path / "refused").exists()

    sug = suggested
    manifest = tmp_path / "nemotron-tp2.yaml"
    body = "\n".join(f"  - {r}" for r in sug["rules"])
    manifest.write_text(f"model:\n  checkpoint: {nemotron}\nmesh: {{tp: 2}}\nrules:\n{body}\n")
    out = tmp_path / "tp2"
    done = _cli("reshard", str(nemotron), str(out), "--manifest", str(manifest), "--quiet")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(nemotron), str(out), "--level", "bitwise", "--json")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(nemotron), str(out), "--device", "cpu")
    assert done.returncode == 5, done.stderr  # forward cannot run it: could not verify
    assert "could not verify" in done.stderr


def test_suggestions_without_dims_never_chunk_a_fused_tensor() -> None:
    """No head counts (a checkpoint of an unknown architecture): a family rule with fused
    parts becomes R, never a plain colwise chunk of [Q; K; V]; ``heads`` is dropped."""
    from shardctl.archs.suggest import suggest_rules

    names = [
        ("transformer.word_embeddings.weight", (100, 8)),
        ("transformer.h.0.self_attention.query_key_value.weight", (24, 8)),
        ("transformer.h.0.self_attention.dense.weight", (8, 8)),
        ("transformer.h.1.self_attention.dense.weight", (8, 8)),
        ("transformer.h.0.mlp.gelu_proj.weight", (32, 8)),
        ("transformer.ln_f.weight", (8,)),
    ]
    got = suggest_rules("bloom", names, vocab_size=100, use_transformers=False)
    by = {r.match: r for r in got.rules}
    assert len(got.rules) == 5  # one per pattern: layers 0 and 1 share one
    qkv = by["transformer.h.*.self_attention.query_key_value.weight"]
    assert (qkv.tp, qkv.parts, qkv.groups) == ("R", None, None)
    dense = by["transformer.h.*.self_attention.dense.weight"]
    assert (dense.tp, dense.heads) == ("rowwise", None)
    assert by["transformer.h.*.mlp.gelu_proj.weight"].tp == "R"  # no rule, in a layer: by shape
    emb = by["transformer.word_embeddings.weight"]
    assert (emb.tp, emb.stage) == ("vocab", "embedding")
    assert (by["transformer.ln_f.weight"].tp, by["transformer.ln_f.weight"].stage) == ("R", "last")
    with_dims = suggest_rules(
        "bloom", names, vocab_size=100, use_transformers=False, dims_known=True
    )
    qkv = next(r for r in with_dims.rules if "query_key_value" in r.match)
    assert (qkv.tp, qkv.parts, qkv.groups) == ("colwise", ("q", "kv", "kv"), "kv")
