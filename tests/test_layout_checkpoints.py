"""The presets against real files: every tensor transformers' ``save_pretrained`` writes for each
tiny config gets a placement, and cutting the real tensors by the layout then merging them back
gives the source bit for bit (replicas identical, padding zero).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.dtypes import normalize_dtype
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Layout, LayoutOptions, Mesh
from shardctl.model.archs import dims_from_config
from shardctl.model.types import ModelInfo, TensorInfo
from tests._models import CONFIGS, make_checkpoint

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")


def load(path: Path, name: str) -> tuple[ModelInfo, dict[str, torch.Tensor]]:
    """Inventory from the safetensors header (names, shapes, dtypes) plus the real tensors."""
    tensors: dict[str, torch.Tensor] = {}
    infos: list[TensorInfo] = []
    with safetensors.safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            infos.append(TensorInfo(key, tuple(sl.get_shape()), normalize_dtype(sl.get_dtype())))
            tensors[key] = f.get_tensor(key)
    config = CONFIGS[name]
    model = ModelInfo(config["model_type"], dims_from_config(config), tuple(infos), "BF16", "test")
    return model, tensors


def roundtrip(layout: Layout, tensors: dict[str, torch.Tensor]) -> None:
    merged = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    seen: set[str] = set()
    for rank in layout.ranks:
        for shard in rank.shards:
            src = tensors[shard.fqn]
            local = torch.zeros(shard.local_shape, dtype=src.dtype)  # zero padding stays zero
            for p in shard.pieces:
                g = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))
                lo = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
                local[lo] = src[g]
            for p in shard.pieces:  # merge: each piece back where it came from
                g = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes, strict=True))
                lo = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
                if shard.placement == "R":  # a replica must equal what is already merged
                    assert shard.fqn not in seen or torch.equal(merged[shard.fqn][g], local[lo])
                merged[shard.fqn][g] = local[lo]
            seen.add(shard.fqn)
    assert seen == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(merged[k], v), k


MESHES = [Mesh(tp=1), Mesh(tp=2), Mesh(tp=4), Mesh(pp=2, tp=2), Mesh(tp=8)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_presets_place_every_saved_tensor_and_roundtrip(name: str, tmp_path: Path) -> None:
    model, tensors = load(make_checkpoint(name, tmp_path / name), name)
    meshes = [*MESHES, Mesh(ep=2, tp=2)] if name == "mixtral" else MESHES
    built = 0
    for mesh in meshes:
        dims = model.dims
        assert dims is not None
        if dims.num_heads % mesh.tp:
            continue  # e.g. 4 heads on tp 8: an error, covered elsewhere
        kv = dims.num_kv_heads
        if not (kv % mesh.tp == 0 or mesh.tp % kv == 0):
            continue
        layout = build_layout(model, mesh, options=LayoutOptions(pipeline="vllm"))
        roundtrip(layout, tensors)
        assert sum(r.nbytes for r in layout.ranks) >= model.weight_bytes
        built += 1
    assert built >= 3
