"""Strict ``model:``: every key typed inline is a known config key of its family (shapes) or on
the family's pass-through list; configs written by transformers' ``save_pretrained`` pass,
inline or through ``model.config``; typos exit 3 with a did-you-mean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._models import CONFIGS, make_config

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = sorted(CONFIGS)

QWEN25_72B = """model:
  model_type: qwen2
  hidden_size: 8192
  intermediate_size: 29568
  num_hidden_layers: 80
  num_attention_heads: 64
  {kv_key}: 8
  vocab_size: 152064
  rope_theta: 1000000.0
  bos_token_id: 151643
mesh: {{tp: 8}}
hardware: {{gpu: h100-sxm}}
"""


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _saved_config(name: str, out: Path) -> dict[str, object]:
    make_config(name).save_pretrained(out)
    data: dict[str, object] = json.loads((out / "config.json").read_text())
    return data


def _inline_manifest(config: dict[str, object]) -> str:
    lines = ["model:"] + [f"  {k}: {json.dumps(v)}" for k, v in config.items()]
    return "\n".join(lines) + "\nhardware: {gpu: h100-sxm}\n"


def test_issue_typo_exits_3_with_did_you_mean(tmp_path: Path) -> None:
    m = tmp_path / "qwen.yaml"
    m.write_text(QWEN25_72B.format(kv_key="num_key_value_head"))
    proc = shardctl("plan", str(m))
    assert proc.returncode == 3, proc.stdout
    assert "model.num_key_value_head: unknown qwen2 config key (line 7)" in proc.stderr
    assert "did you mean 'num_key_value_heads'?" in proc.stderr
    m.write_text(QWEN25_72B.format(kv_key="num_key_value_heads"))
    assert shardctl("plan", str(m)).returncode == 0


def test_inline_quantization_config_is_read_as_a_config_json_is(tmp_path: Path) -> None:
    """A published config's ``quantization_config`` pasted inline prices the stored tensors (AWQ
    int4 here: about a quarter of the bf16 linears); a broken one is exit 3 naming it."""
    import json

    text = QWEN25_72B.format(kv_key="num_key_value_heads")
    plain, awq, bad = (tmp_path / f"{n}.yaml" for n in ("plain", "awq", "bad"))
    plain.write_text(text)
    awq.write_text(
        text.replace("  bos_token_id", "  quantization_config: {quant_method: awq}\n  bos_token_id")
    )
    bad.write_text(
        text.replace("  bos_token_id", "  quantization_config: {quant_method: q9}\n  bos_token_id")
    )
    weights = []
    for m in (plain, awq):
        proc = shardctl("plan", str(m), "--json", "--tp", "1")  # 29,568 / 8 is not in groups of 128
        assert proc.returncode in (0, 1), proc.stderr  # 1: does not fit one GPU
        weights.append(json.loads(proc.stdout)["ranks"][0]["memory"]["weights"])
    assert 0.25 < weights[1] / weights[0] < 0.35  # int4 linears, 16-bit embeddings and head
    proc = shardctl("plan", str(bad))
    assert proc.returncode == 3
    assert "quantization_config" in proc.stderr and "'q9'" in proc.stderr


def test_unknown_key_far_from_any_lists_the_shape_keys(tmp_path: Path) -> None:
    m = tmp_path / "q.yaml"
    text = QWEN25_72B.format(kv_key="num_key_value_heads")
    m.write_text(text.replace("  bos_token_id: 151643", "  frobnicate: 3"))
    proc = shardctl("plan", str(m))
    assert proc.returncode == 3
    assert "model.frobnicate" in proc.stderr and "keys that set shapes" in proc.stderr


@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_config_passes_inline_and_as_file(name: str, tmp_path: Path) -> None:
    config = _saved_config(name, tmp_path / "ck")
    inline = tmp_path / "inline.yaml"
    inline.write_text(_inline_manifest(config))
    by_inline = shardctl("plan", str(inline), "--json")
    assert by_inline.returncode == 0, by_inline.stderr
    # model.config: a real config.json, with a key no family knows: not our business there.
    config["some_future_key"] = {"nested": [1, 2]}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    as_file = tmp_path / "file.yaml"
    as_file.write_text(
        f"model: {{config: {tmp_path / 'ck' / 'config.json'}}}\nhardware: {{gpu: h100-sxm}}\n"
    )
    by_file = shardctl("plan", str(as_file), "--json")
    assert by_file.returncode == 0, by_file.stderr
    a, b = json.loads(by_inline.stdout), json.loads(by_file.stdout)
    assert a["ranks"] == b["ranks"]
    assert a["model"]["parameters"] == b["model"]["parameters"]
