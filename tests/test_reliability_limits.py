"""Reliability case H2: a checkpoint of 10 002 safetensors files under ``ulimit -n 256``.

A llama of 1 111 tiny layers, one tensor per file (``model-00001-of-10002.safetensors`` …),
written by the ``safetensors`` library with a standard ``model.safetensors.index.json``. Every
command that reads it runs as a subprocess whose descriptor limit (soft and hard) is 256, so
any reader that keeps one descriptor per input file fails with EMFILE after ~250 files:
``inspect``, ``reshard`` to ``--tp 2``, ``verify --level bitwise`` of that split, ``reshard``
back to an HF checkpoint of ~800 files, and ``verify`` of the merge.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
FD_LIMIT = 256
LAYERS = 1111  # 9 tensors a layer + embeddings, final norm, lm_head = 10 002 files
HIDDEN, INTER, VOCAB, HEADS = 16, 32, 32, 2


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.v_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                p + "mlp.up_proj.weight": (INTER, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTER),
            }
        )
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def write_many_files(out: Path, layers: int = LAYERS) -> int:
    """An HF llama checkpoint with one tensor per safetensors file; returns the file count."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    shapes = _shapes(layers)
    n = len(shapes)
    rng = np.random.default_rng(0)
    weight_map: dict[str, str] = {}
    total = 0
    for k, (fqn, shape) in enumerate(shapes.items()):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        a = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
        save_file({fqn: a}, str(out / name), metadata={"format": "pt"})
        weight_map[fqn] = name
        total += a.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "max_position_embeddings": 64,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config))
    return n


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def limited(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m shardctl ARGS`` with at most FD_LIMIT open descriptors."""
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        cwd=REPO,
        preexec_fn=_limit_fds,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("h2") / "src"
    assert write_many_files(src) == 10_002
    return src


def test_limit_applies() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))",
        ],
        preexec_fn=_limit_fds,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.stdout.strip() == f"({FD_LIMIT}, {FD_LIMIT})"


@pytest.mark.slow
def test_10k_files_split_and_merge_under_fd_limit(many: Path, tmp_path: Path) -> None:
    p = limited("inspect", str(many), "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["files"]) == 10_002

    split, merged = tmp_path / "tp2", tmp_path / "merged"
    p = limited("reshard", str(many), str(split), "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in split.glob("*.safetensors")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    p = limited("verify", str(many), str(split), "--level", "bitwise", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr

    # back to HF, ~800 output files of at most 8 kB: many outputs as well as many inputs
    p = limited("reshard", str(split), str(merged), "--format", "hf", "--max-shard-size", "8000")
    assert p.returncode == 0, p.stderr
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 10_002
    assert len(set(index["weight_map"].values())) > 2 * FD_LIMIT
    p = limited("verify", str(many), str(merged), "--level", "bitwise", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
