"""``shardctl plan CONFIG_OR_CHECKPOINT --tp … --gpu … --batch … --seq …`` without a manifest,
and ``--emit-manifest`` writing the manifest that gives the identical plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# meta-llama/Meta-Llama-3-8B config.json (the shape-defining fields and a few others)
LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("ck") / "tiny-llama")


FLAGS = ("--tp", "2", "--gpu", "h100-sxm", "--batch", "4", "--seq", "64")


def test_checkpoint_dir_with_flags_and_emitted_manifest_agree(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "implied.yaml"
    direct = shardctl("plan", str(checkpoint), *FLAGS, "--json", "--emit-manifest", str(out))
    assert direct.returncode == 0, direct.stderr
    text = out.read_text()
    assert "checkpoint:" in text and "tp: 2" in text and "sequence_length: 64" in text
    again = shardctl("plan", str(out), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(direct.stdout)
    doc = json.loads(direct.stdout)
    assert doc["mesh"]["tp"] == 2 and doc["model"]["source"] == "checkpoint"
    assert doc["weights_only"] is False and doc["ranks"][0]["memory"]["kv_cache"] > 0


def test_config_json_with_flags_equals_the_checkpoint(checkpoint: Path) -> None:
    by_dir = json.loads(shardctl("plan", str(checkpoint), *FLAGS, "--json").stdout)
    by_cfg = shardctl("plan", str(checkpoint / "config.json"), *FLAGS, "--json")
    assert by_cfg.returncode == 0, by_cfg.stderr
    assert json.loads(by_cfg.stdout)["ranks"] == by_dir["ranks"]


def test_text_output_and_search_from_a_checkpoint(checkpoint: Path) -> None:
    text = shardctl("plan", str(checkpoint), *FLAGS)
    assert text.returncode == 0, text.stderr
    assert "mesh PP1×DP1×EP1×TP2 = 2 GPUs" in text.stdout
    found = shardctl("plan", str(checkpoint), "--gpu", "h100-sxm", "--search", "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["candidates"]


def test_llama3_8b_config_as_accelerate_users_type_it(tmp_path: Path) -> None:
    cfg = tmp_path / "Llama-3-8B" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(LLAMA3_8B))
    args = ("--tp", "8", "--gpu", "h100-sxm", "--batch", "32", "--seq", "8192", "--json")
    proc = shardctl("plan", str(cfg), *args)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # KV per rank: 2 (K,V) · 32 layers · 1 KV head (8 / tp 8) · 128 · 2 B · 32 seqs · 8192 tokens
    assert doc["ranks"][0]["memory"]["kv_cache"] == 2 * 32 * 1 * 128 * 2 * 32 * 8192
    assert len(doc["ranks"]) == 8
    # a directory holding only config.json is not a checkpoint: the config path is the way
    assert shardctl("plan", str(cfg.parent), *args).returncode == 3


def test_mesh_beyond_one_node_derives_nodes(checkpoint: Path) -> None:
    doc = json.loads(
        shardctl(
            "plan", str(checkpoint), "--tp", "2", "--dp", "8", "--gpu", "h100-sxm", "--json"
        ).stdout
    )
    assert len(doc["ranks"]) == 16


def test_model_flags_with_a_manifest_are_usage_errors() -> None:
    proc = shardctl("plan", "manifests/llama-3-8b-tp1.yaml", "--gpu", "h100-sxm", "--seq", "9")
    assert proc.returncode == 2
    assert "--gpu, --seq: only with a config.json or checkpoint directory" in proc.stderr


def test_emit_never_overwrites_and_refused_input_writes_nothing(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "exists.yaml"
    out.write_text("keep me\n")
    proc = shardctl("plan", str(checkpoint), *FLAGS, "--emit-manifest", str(out))
    assert proc.returncode == 4 and out.read_text() == "keep me\n"
    fresh = tmp_path / "fresh.yaml"
    bad = shardctl("plan", str(checkpoint), "--tp", "3", "--emit-manifest", str(fresh))
    assert bad.returncode == 3 and not fresh.exists()


def test_flag_text_is_data_not_yaml(checkpoint: Path) -> None:
    proc = shardctl("plan", str(checkpoint), "--gpu", "h100-sxm}, nodes: 99, x: {")
    assert proc.returncode == 3
    assert "unknown GPU" in proc.stderr


def test_manifest_only_modes_with_a_checkpoint_are_usage_errors(checkpoint: Path) -> None:
    proc = shardctl("plan", str(checkpoint), "--device-map", "map.json")
    assert proc.returncode == 2
    assert "--device-map: needs a manifest" in proc.stderr and "--emit-manifest" in proc.stderr
