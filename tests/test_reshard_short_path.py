"""The small-tensor short path (``Batching._fast``: inline boxes, bytes out of source windows)
writes exactly the bytes of the general path (``plan_boxes`` + block copies), for splits,
ranks -> ranks and merges, on real tiny checkpoints written by transformers.

The general path is forced with a block smaller than every matrix (``block_bytes=64``: a
tensor over one block never takes the short path). The columnar path (which would take an HF
source's small tensors before either) is off here: ``test_reshard_columnar`` holds it to these
two."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.layout.types import Mesh
from shardctl.reshard import batching, columnar
from shardctl.reshard.api import reshard
from tests._models import make_checkpoint
from tests.test_reshard_roundtrip import same_checkpoint

CASES = {
    # experts S(0)/S(1) + EP, 1-D norms, replicas over ep (first holder wins on merge)
    "mixtral": (Mesh(tp=2, ep=2), Mesh(tp=4)),
    # Conv1D [in, out]: S(1) of c_attn/c_fc, 1-D biases split and replicated
    "gpt2": (Mesh(tp=2), Mesh(tp=4)),
    # fused gate_up / qkv: several pieces per shard, the general path inside the same batches
    "phi3": (Mesh(tp=2), Mesh(tp=4)),
    # packed experts [E, H, 2I] cut on E (ep) and on the last dim (tp): E/ep · H strided rows
    "gpt_oss": (Mesh(tp=2, ep=2), Mesh(tp=2)),
}


@pytest.fixture(autouse=True)
def _per_target_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columnar, "ENABLED", False)


def data_files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.glob("*.safetensors"))}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_short_path_writes_the_general_paths_bytes(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_checkpoint(arch, tmp_path / "src")
    first, second = CASES[arch]
    taken = []
    parts = batching.Batching._parts

    def spy(self: batching.Batching, t: object, srcs: object) -> object:
        got = parts(self, t, srcs)  # type: ignore[arg-type]
        taken.append(got is not None)
        return got

    monkeypatch.setattr(batching.Batching, "_parts", spy)
    outs: dict[int, list[dict[str, bytes]]] = {}
    for block in (1 << 20, 64):
        taken.clear()
        a = reshard(src, tmp_path / f"a{block}", mesh=first, block_bytes=block).dst
        b = reshard(a, tmp_path / f"b{block}", mesh=second, block_bytes=block).dst
        c = reshard(b, tmp_path / f"c{block}", fmt="hf", block_bytes=block).dst
        outs[block] = [data_files(a), data_files(b), data_files(c)]
        if block > 64:
            assert sum(taken) > len(taken) // 2  # most tensors went the short way
    for fast, general in zip(outs[1 << 20], outs[64], strict=True):
        assert fast.keys() == general.keys()
        for name in fast:
            assert fast[name] == general[name], name
    same_checkpoint(src, tmp_path / f"c{1 << 20}")
