"""The inventory against reality: what transformers' ``save_pretrained`` actually writes.

For every config in ``tests/_models.py`` (GQA and MHA, tied and untied, biases, MoE, fused
parts, Conv1D, head_dim != hidden/heads): ``tensors_from_config(config.to_dict())`` equals the
real file's tensors — names, shapes, dtypes, and order — read with safetensors' own
``safe_open``; and ``from_checkpoint`` equals ``from_config`` for the same model.
"""

from __future__ import annotations

from operator import attrgetter
from pathlib import Path

import pytest

from shardctl.model.archs import tensors_from_config
from shardctl.model.inventory import from_checkpoint, from_config, from_config_file
from tests._models import CONFIGS, make_checkpoint, make_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real")
    return {name: make_checkpoint(name, root / name) for name in CONFIGS}


def _on_disk(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) in file order, as safetensors itself reads them."""
    from safetensors import safe_open

    out = []
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            s = f.get_slice(name)
            out.append((name, tuple(s.get_shape()), s.get_dtype()))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_inventory_equals_save_pretrained(name: str, checkpoints: dict[str, Path]) -> None:
    config = make_config(name).to_dict()
    ours = [(t.fqn, t.shape, t.dtype) for t in tensors_from_config(config, "BF16")]
    real = _on_disk(checkpoints[name] / "model.safetensors")
    assert sorted(ours) == sorted(real)  # names, shapes, dtypes
    assert [n for n, _, _ in ours] == [n for n, _, _ in real]  # and save_pretrained's order


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_inventory_equals_config_inventory(
    name: str, checkpoints: dict[str, Path]
) -> None:
    root = checkpoints[name]
    disk = from_checkpoint(root)
    conf = from_config_file(root / "config.json")
    # in name order: a file holds its tensors by dtype, then name (safetensors' order), and
    # transformers >= 5.24 saves DeepSeek's router in F32 (first in the file)
    assert tuple(sorted(disk.tensors, key=attrgetter("fqn"))) == conf.tensors
    assert disk.dims == conf.dims
    assert (
        (disk.architecture, disk.dtype)
        == (conf.architecture, conf.dtype)
        == (
            CONFIGS[name]["model_type"],
            "BF16",
        )
    )
    assert disk.parameters == conf.parameters
    assert (
        disk.weight_bytes
        == conf.weight_bytes
        == (root / "model.safetensors").stat().st_size
        - (8 + int.from_bytes((root / "model.safetensors").read_bytes()[:8], "little"))
    )


def test_sharded_checkpoint_inventory(tmp_path: Path) -> None:
    """Several shards + index: same tensors as the config, in index-file then offset order."""
    root = make_checkpoint("llama", tmp_path / "m", max_shard_size="20KB")
    assert len(list(root.glob("*.safetensors"))) > 1
    disk = from_checkpoint(root)
    conf = from_config_file(root / "config.json")
    assert sorted(disk.tensors, key=lambda t: t.fqn) == list(conf.tensors)
    real = [t for f in sorted(root.glob("model-*.safetensors")) for t in _on_disk(f)]
    # safe_open lists names sorted; within one file that is the offset order for one dtype.
    assert [(t.fqn, t.shape, t.dtype) for t in disk.tensors] == real


def test_float32_checkpoint_dtype(tmp_path: Path) -> None:
    root = make_checkpoint("qwen2-tied", tmp_path / "m", dtype="float32")
    disk = from_checkpoint(root)
    assert disk.dtype == "F32"
    assert from_config_file(root / "config.json").tensors == disk.tensors


def test_llama3_8b_exact() -> None:
    """The issue's check: Llama-3-8B, untied, bf16."""
    config = dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=8192,
    )  # fmt: skip
    info = from_config(config)
    assert info.parameters == 8_030_261_248
    assert info.weight_bytes == 16_060_522_496
    assert info.dtype == "BF16"
    assert info.tensor("model.layers.31.self_attn.k_proj.weight").shape == (1024, 4096)
    assert info.tensor("lm_head.weight").shape == (128256, 4096)
    assert len(info.tensors) == 2 + 1 + 32 * 9
