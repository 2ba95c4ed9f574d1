"""verify's forward level is sharp for the fam-dense families: a self-consistent but wrong
layout (its record describes the bytes exactly, so structure and bitwise pass) must fail forward.

The wrong layouts come from the test-only splitter (tests/_split.py, independent of reshard):
GLM-4's fused ``gate_up_proj`` chunked whole or with gate and up swapped; kv heads replicated to
the wrong ranks at ``tp = 4 > 2`` kv heads — for OLMo-2 that also feeds its whole-projection
k norm (an all-reduce over ranks holding the wrong heads), for Gemma-3 and StableLM the per-head
norms. The same splitter without a fault passes all three levels (the controls; StableLM's
sequential-residual variant runs only here, the flow in test_families.py has the parallel one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from tests._models import make_checkpoint
from tests._split import split_checkpoint, write_record

CASES = [
    ("glm4", Mesh(tp=2), None),
    ("glm4", Mesh(tp=2), "naive-fused"),
    ("glm4", Mesh(tp=2), "swap-gate-up"),
    ("olmo2", Mesh(tp=4), None),
    ("olmo2", Mesh(tp=4), "kv-replication"),
    ("gemma3_text", Mesh(tp=4), "kv-replication"),
    ("stablelm", Mesh(tp=4), "kv-replication"),
    ("stablelm-sequential", Mesh(tp=2), None),  # post_attention_layernorm, MHA, no q/k norms
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dense-faults")


@pytest.mark.parametrize(
    ("family", "mesh", "fault"), CASES, ids=[f"{f}-{m}-{x}" for f, m, x in CASES]
)
def test_wrong_layout_fails_forward_only(
    root: Path, tmp_path: Path, family: str, mesh: Mesh, fault: str | None
) -> None:
    src = root / family
    if not src.exists():
        make_checkpoint(family, src)
    dst = tmp_path / "split"
    layout, files = split_checkpoint(src, dst, mesh, fault=fault)
    write_record(src, dst, layout, files)
    result = verify(src, dst, device="cpu", simulate=True)
    statuses = {lv.name: lv.status for lv in result.levels}
    expected = "pass" if fault is None else "fail"
    assert statuses == {"structure": "pass", "bitwise": "pass", "forward": expected}, [
        str(f) for lv in result.levels for f in lv.findings
    ]
