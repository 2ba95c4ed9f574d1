"""A sharded checkpoint as verify sees it: config, layout, and each rank's files.

Built from the layout record ``reshard`` writes (see ``record.py`` here), from an HF directory
(one rank holding everything), or by hand in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardctl.layout.types import Layout


@dataclass(frozen=True)
class ShardedCheckpoint:
    """``files[r]``: the safetensors files of model-parallel rank ``r`` (ordered pp, ep, tp)."""

    root: Path
    config: dict[str, Any]
    layout: Layout
    files: dict[int, tuple[Path, ...]]
    # fqn -> name of the tensor in the rank's files, when it differs from the fqn
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.layout.mesh.model_parallel
