"""Scale-out under ``torchrun``: workers split the output files; one commits the record.

With ``WORLD_SIZE`` > 1 every worker runs the same ``reshard`` call. Worker 0 takes the lock and
creates the staging directory, whose path it broadcasts (gloo, ``env://`` from torchrun's
``MASTER_ADDR``/``MASTER_PORT``); each worker writes its share of the files (greedy by size, the
same split on every worker) from shared storage; the digests are all-gathered — with any
worker's error, so every worker fails together instead of waiting on a dead peer — and worker 0
writes the record and commits after a barrier. torch is imported only on this path.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, ShardctlError
from shardctl.reshard.plan_files import OutputFile


class Group:
    def __init__(self, timeout_s: float = 1800.0) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.owned = not dist.is_initialized()
        if self.owned:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def share(self, staging: Path | None) -> Path:
        """Worker 0's staging path to everyone (None: worker 0 failed before creating it)."""
        box: list[Any] = [str(staging) if staging is not None else None]
        self.dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            self.close()
            raise EnvironmentFailure("worker 0 failed before staging the output; see its error")
        return Path(box[0])

    def mine(self, files: list[OutputFile]) -> list[OutputFile]:
        loads = [0] * self.world
        owner: dict[int, int] = {}
        for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
            k = loads.index(min(loads))
            owner[i] = k
            loads[k] += files[i].size
        return [f for i, f in enumerate(files) if owner[i] == self.rank]

    def run_and_gather(self, fn: Callable[[], dict[str, str]]) -> dict[str, str]:
        """Run this worker's part; all-gather digests or errors; raise if any worker failed."""
        error: BaseException | None = None
        digests: dict[str, str] = {}
        try:
            digests = fn()
        except BaseException as exc:  # shared with the others before re-raising
            error = exc
        got: list[Any] = [None] * self.world
        self.dist.all_gather_object(got, (digests, None if error is None else str(error)))
        if error is not None:
            self.close()
            raise error
        failed = [(r, msg) for r, (_, msg) in enumerate(got) if msg is not None]
        if failed:
            self.close()
            r, msg = failed[0]
            raise EnvironmentFailure(f"worker {r} failed: {msg}")
        merged: dict[str, str] = {}
        for part, _ in got:
            merged.update(part)
        return merged

    def done(self) -> None:
        """Barrier after worker 0's commit (the others return only once the output exists)."""
        self.dist.barrier()
        self.close()

    def close(self) -> None:
        if self.owned and self.dist.is_initialized():
            self.dist.destroy_process_group()


__all__ = ["Group", "ShardctlError"]
