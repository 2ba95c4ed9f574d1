"""``workload.engine: hf``: transformers loads the HF checkpoint itself (``tp_plan="auto"``
shards it at load), so plan says no conversion is needed and how to load it; a layout
transformers cannot run (pp, ep) is named as such."""

from __future__ import annotations

import json
from pathlib import Path

from tests._cli import run_cli as _cli
from tests._models import make_checkpoint


def test_plan_engine_hf(tmp_path: Path) -> None:
    hf = make_checkpoint("llama", tmp_path / "llama")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        f"model: {{checkpoint: {json.dumps(str(hf))}}}\nmesh: {{tp: 2}}\n"
        "hardware: {gpu: h100-sxm}\nworkload: {engine: hf, sequence_length: 64}\n"
    )
    res = _cli("plan", str(manifest), "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["reshard"]
    assert (got["engine"], got["command"], got["refused"]) == ("hf", None, None)
    assert 'tp_plan="auto"' in got["load_flags"] and "--nproc-per-node 2" in got["load_flags"]
    text = _cli("plan", str(manifest)).stdout.replace("\n", " ")
    assert "hf: no conversion: transformers loads the Hugging Face checkpoint" in text
    text = _cli("plan", str(manifest), "--pp", "2").stdout.replace("\n", " ")
    assert "hf: cannot write this layout: transformers loads tensor-parallel ranks only (pp 2)" in (
        text
    )
