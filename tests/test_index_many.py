"""A many-file checkpoint at a real tensor count: the index read and compared in bulk.

Real checkpoints come in many files with a ``model.safetensors.index.json`` (DeepSeek-V3:
163 files, ~91,000 entries). The index's file names are checked once per distinct name and
compared with the headers as one mapping, and only a mismatch walks it entry by entry; these
tests hold that to the entry-by-entry walk (the first error names the same entry, the
discrepancies are the walk's) and run a 10,000+-tensor Qwen3-MoE that transformers'
``save_pretrained`` wrote in dozens of files through open, inspect, plan, reshard and verify.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.checkpoint.hf import open_checkpoint
from shardctl.checkpoint.hf_index import check_entry, read_index
from shardctl.checkpoint.paths import PathGuard
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh
from shardctl.model.inventory import tensor_infos
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._cli import run_cli
from tests._models import make_checkpoint

INDEX = "model.safetensors.index.json"


def _walk(path: Path, weight_map: dict[str, Any]) -> None:
    """Every entry checked in order (what ``read_index`` did before it checked each distinct
    file name once): the reference for which entry its first error names."""
    guard = PathGuard(path.parent, follow=False)
    for fqn, rel in weight_map.items():
        check_entry(guard, str(path), fqn, rel)


_VALUES = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "../outside.safetensors",
    "a//b.safetensors",
    "evil.bin",
    1,
    None,
]


@given(values=st.lists(st.sampled_from(_VALUES), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_the_first_bad_entry_is_named_as_by_the_walk(
    values: list[Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("idx") / INDEX
    weight_map = {f"t{i}": v for i, v in enumerate(values)}
    path.write_text(json.dumps({"weight_map": weight_map}))
    try:
        _walk(path, weight_map)
    except InvalidInputError as expected:
        with pytest.raises(InvalidInputError) as got:
            read_index(path)
        assert str(got.value) == str(expected)
        assert got.value.hint == expected.hint
    else:
        assert read_index(path) == ({}, weight_map)


LAYERS, EXPERTS = 14, 256  # the first layer dense (tests._models): 13 MoE layers × 256 × 3


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        "qwen3_moe",
        tmp_path_factory.mktemp("many_files") / "src",
        max_shard_size="600KB",
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, vocab_size=128, num_hidden_layers=LAYERS,
        num_experts=EXPERTS, num_experts_per_tok=8,
    )  # fmt: skip


def test_many_files_open_inspect_plan_reshard_verify(many_files: Path, tmp_path: Path) -> None:
    weight_map = json.loads((many_files / INDEX).read_text())["weight_map"]
    files = set(weight_map.values())
    assert len(weight_map) > 10_000 and len(files) > 20
    ck = open_checkpoint(many_files)
    # the inventory reads the headers' entries in file order, without building the locations
    infos = tensor_infos(ck)
    assert "locations" not in vars(ck)
    assert [t.fqn for t in infos] == list(ck.locations)  # the same order, file then offset
    assert len(ck.locations) == len(weight_map)
    assert {n: loc.path.name for n, loc in ck.locations.items()} == weight_map

    inspected = run_cli("inspect", str(many_files), "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["model"]["tensors"] == len(weight_map)
    planned = run_cli("plan", str(many_files), "--tp", "2", "--ep", "2", "--json")
    assert planned.returncode in (0, 1), planned.stderr

    split = tmp_path / "split"
    reshard(many_files, split, mesh=Mesh(tp=2, ep=2))
    assert verify(many_files, split, level="bitwise").ok


def test_a_tensor_the_index_misplaces_among_ten_thousand_is_named(
    many_files: Path, tmp_path: Path
) -> None:
    bad = Path(shutil.copytree(many_files, tmp_path / "bad"))
    data = json.loads((bad / INDEX).read_text())
    weight_map = data["weight_map"]
    files = sorted(set(weight_map.values()))
    victim = "model.layers.9.mlp.experts.77.down_proj.weight"
    right = weight_map[victim]
    wrong = next(f for f in files if f != right)
    weight_map[victim] = wrong
    (bad / INDEX).write_text(json.dumps(data))
    with pytest.raises(InvalidInputError) as err:
        open_checkpoint(bad)
    assert f"{victim!r} is in {right} but the index says {wrong}" in str(err.value)
