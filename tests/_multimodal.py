"""What the multimodal family tests share (Gemma-3, Mistral-3, LLaVA): plan a manifest through
the CLI, read a rank's tensor shapes, and hold a bad config to one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tests._cli import run_cli


def plan_json(tmp_path: Path, text: str, *flags: str) -> dict[str, Any]:
    """``shardctl plan --json`` of the manifest ``text`` (exit 0 asserted)."""
    path = tmp_path / "manifest.yaml"
    path.write_text(text)
    done = run_cli("plan", str(path), "--json", *flags)
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def rank_shapes(directory: Path, rank: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in rank ``rank``'s files of a resharded directory."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(directory.glob(f"rank-{rank:05d}-*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def refused_in_one_line(tmp_path: Path, config: dict[str, Any], says: str) -> None:
    """``plan`` of a manifest naming ``config`` as its config.json exits 3 with one line on
    stderr that says ``says`` (no traceback)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        f"model: {{config: {path}}}\nmesh: {{tp: 2}}\nhardware: {{gpu: h100-sxm}}\n"
        'workload: {engine: vllm, vllm_version: "0.19", sequence_length: 8192}\n'
    )
    done = run_cli("plan", str(manifest))
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardctl: error:") and says in lines[0], lines


def qwen3_vl_config(
    model_type: str,
    h: int,
    i: int,
    layers: int,
    heads: int,
    kv: int,
    tied: bool,
    vision: tuple[int, int, int, list[int]],
    out: int,
) -> dict[str, Any]:
    """A published Qwen3-VL / Qwen3-VL-MoE config.json's shape keys (transformers 4.57 layout:
    nested sections); ``vision`` is the tower's (depth, width, intermediate, DeepStack blocks),
    ``out`` its merger's output width."""
    depth, width, inner, deepstack = vision
    return {
        "model_type": model_type,
        "tie_word_embeddings": tied,
        "text_config": {
            "model_type": f"{model_type}_text",
            "hidden_size": h,
            "intermediate_size": i,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": tied,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
            "rope_theta": 5000000,
        },
        "vision_config": {
            "depth": depth,
            "hidden_size": width,
            "intermediate_size": inner,
            "num_heads": 16,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "out_hidden_size": out,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "deepstack_visual_indexes": deepstack,
        },
    }
