"""What ``reshard`` returns: the files written, their digests, and the run's figures.

JSON (``ReshardResult.to_json()``), schema ``shardctl.reshard/1``::

    {"schema": "shardctl.reshard/1", "src": "llama", "dst": "llama-tp4", "format": "ranks",
     "mesh": {"pp": 1, "dp": 1, "tp": 4, "ep": 1}, "source_kind": "hf",
     "files": [{"name": "rank-00000.safetensors", "size": 4096, "digest": "…"}, …],
     "hash": "sha256", "carried": ["config.json"], "tensor_bytes": …, "total_bytes": …,
     "seconds": 0.12, "bytes_per_second": …, "peak_rss_bytes": …, "workers": 4,
     "resumed": []}
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardctl.checkpoint.record import FileDigest
from shardctl.layout.types import Mesh

SCHEMA = "shardctl.reshard/1"


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class ReshardResult:
    dst: Path
    format: str  # "ranks" | "hf"
    mesh: Mesh | None
    source_kind: str  # "hf" | "shardctl" | "pickle"
    files: tuple[FileDigest, ...]
    tensor_bytes: int  # bytes of tensor data written (padding included)
    total_bytes: int  # every file written, headers, index, record and carried files included
    seconds: float
    hash: str
    carried: tuple[str, ...]
    workers: int
    resumed: tuple[str, ...] = ()  # files reused from a killed identical run (not rewritten)
    src: Path | None = None
    peak_rss_bytes: int = 0  # this process's peak resident set at the end of the run

    @property
    def reused_bytes(self) -> int:
        """Bytes of the files a resumed run adopted instead of writing."""
        return sum(f.size for f in self.files if f.name in self.resumed)

    @property
    def bytes_per_second(self) -> float:
        """Tensor bytes this run wrote per second (a resumed run counts only what it wrote)."""
        written = max(0, self.tensor_bytes - self.reused_bytes)
        return written / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "src": None if self.src is None else str(self.src),
            "dst": str(self.dst),
            "format": self.format,
            "mesh": None if self.mesh is None else self.mesh.as_dict(),
            "source_kind": self.source_kind,
            "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in self.files],
            "hash": self.hash,
            "carried": list(self.carried),
            "tensor_bytes": self.tensor_bytes,
            "total_bytes": self.total_bytes,
            "seconds": round(self.seconds, 4),
            "bytes_per_second": round(self.bytes_per_second),
            "peak_rss_bytes": self.peak_rss_bytes,
            "workers": self.workers,
            "resumed": list(self.resumed),
        }
