"""Run the forward level's rank jobs: one process per rank, or threads in one process.

- :func:`run_processes`: one ``python -m shardctl.verify.worker`` subprocess per rank, the
  environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``),
  rendezvous through a TCP store this process hosts on a free port (no port race). gloo on CPU,
  NCCL with one GPU per rank. A rank that dies takes the run down with exit 5, never a hang.
- :func:`run_threads`: the *simulation* — every rank a thread of this process on one device,
  collectives through :class:`~shardctl.verify.comm.ThreadComm`. Used when there are fewer
  GPUs than ranks (and by tests that want many layouts without process start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from shardctl.errors import EnvironmentFailure
from shardctl.io.tempdirs import owned_tempdir
from shardctl.verify.comm import ThreadComm, ThreadHub, Topology
from shardctl.verify.rank import RankJob, RankOutcome, run_rank
from shardctl.verify.tp_model import warm_imports

DEFAULT_TIMEOUT_S = 600.0


def run_threads(jobs: list[RankJob]) -> list[RankOutcome]:
    warm_imports(str(jobs[0].config.get("model_type")))
    hub = ThreadHub(Topology(*jobs[0].topo))
    outcomes: dict[int, RankOutcome] = {}
    errors: list[str] = []

    def one(job: RankJob) -> None:
        try:
            outcomes[job.rank] = run_rank(job, ThreadComm(job.rank, hub))
        except Exception as exc:
            errors.append(f"rank {job.rank}: {type(exc).__name__}: {exc}")
            hub.abort()

    threads = [threading.Thread(target=one, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise EnvironmentFailure(f"simulated forward failed: {errors[0]}")
    return [outcomes[j.rank] for j in jobs]


def run_processes(
    jobs: list[RankJob], *, backend: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[RankOutcome]:
    """One process per rank for this one run (start-up included)."""
    with ProcessWorld(len(jobs), backend=backend) as world:
        return world.run(jobs, timeout_s=timeout_s)


class ProcessWorld:
    """``world`` worker processes in one process group, kept alive to run many jobs.

    Jobs travel through the TCP store this process hosts (``job/<k>/<rank>``); outcomes, which
    carry logits (``tokens × vocab`` float64: 16 MiB at 16 tokens of a 128k vocabulary), are
    files in this run's private temporary directory, and the store only says which file is
    done (``outcome/<k>/<rank>``): torch's TCPStore drops values over 8 MiB with a reset
    connection. The gloo/NCCL group is formed once, so a test module pays the start-up (~1 s
    for gloo, plus torch's import) once, not per layout.
    """

    def __init__(self, world: int, *, backend: str) -> None:
        self.world = world
        self.backend = backend
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []
        self._tmp: AbstractContextManager[Path] | None = None
        self._tmp_path = Path()
        self._store: Any = None
        self._next = 0

    def __enter__(self) -> ProcessWorld:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # owner-locked: a killed run's directory is reaped by the next one (io.tempdirs)
        self._tmp = owned_tempdir("shardctl-verify-")
        self._tmp_path = self._tmp.__enter__()
        threads = max(1, (os.cpu_count() or 1) // self.world)
        for rank in range(self.world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(self.world),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self._store.port),
                OMP_NUM_THREADS=str(threads),
                SHARDCTL_VERIFY_BACKEND=self.backend,
                SHARDCTL_VERIFY_STORE="client",
                SHARDCTL_VERIFY_DIR=str(self._tmp_path),
            )
            log = self._tmp_path / f"rank{rank}.log"
            self._logs.append(log)
            cmd = [sys.executable, "-m", "shardctl.verify.worker", "--serve"]
            with open(log, "wb") as fh:
                self._procs.append(
                    subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
                )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._store is not None and all(p.poll() is None for p in self._procs):
            for rank in range(self.world):
                self._store.set(f"job/{self._next}/{rank}", b"stop")
        deadline = time.monotonic() + 10
        for p in self._procs:  # only the workers this world started
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        if self._tmp is not None:
            self._tmp.__exit__(None, None, None)
            self._tmp = None

    def run(
        self, jobs: list[RankJob], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[RankOutcome]:
        if len(jobs) != self.world:
            raise ValueError(f"{len(jobs)} jobs for a world of {self.world}")
        k = self._next
        self._next += 1
        for job in jobs:
            self._store.set(f"job/{k}/{job.rank}", json.dumps(job.to_json()))
        keys = [f"outcome/{k}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            dead = next((i for i, p in enumerate(self._procs) if p.poll() is not None), None)
            if dead is not None or time.monotonic() > deadline:
                self._abort(dead, timeout_s)
            time.sleep(0.02)
        assert self._tmp is not None
        return [
            read_outcome(r, self._tmp_path, k, self._store.get(key)) for r, key in enumerate(keys)
        ]

    def _abort(self, dead: int | None, timeout_s: float) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._store = None
        if dead is None:
            raise EnvironmentFailure(
                f"forward ranks did not finish within {timeout_s:.0f} s",
                hint="a collective is stuck; rerun with SHARDCTL_DEBUG=1",
            )
        lines = self._logs[dead].read_text(errors="replace").strip().splitlines() or ["?"]
        raise EnvironmentFailure(
            f"forward rank {dead} exited with {self._procs[dead].returncode}: {lines[-1]}"
        )


def write_outcome(outcome: RankOutcome, directory: Path, job: int) -> str:
    """Save one rank's outcome as ``outcome-<job>-<rank>.pt`` in ``directory``; its name.

    Written under a temporary name and renamed, so the parent never reads half a file.
    """
    name = f"outcome-{job}-{outcome.rank}.pt"
    tmp = directory / f".{name}.tmp"
    torch.save(
        {
            "problems": outcome.problems,
            "load_s": outcome.load_s,
            "forward_s": outcome.forward_s,
            "logits": outcome.logits,
        },
        tmp,
    )
    os.replace(tmp, directory / name)
    return name


def read_outcome(rank: int, directory: Path, job: int, name: bytes) -> RankOutcome:
    """The outcome a worker wrote (:func:`write_outcome`); ``name`` is what it put in the store."""
    expected = f"outcome-{job}-{rank}.pt"
    if name != expected.encode():
        raise EnvironmentFailure(f"forward rank {rank} reported outcome {name!r}, not {expected!r}")
    d = torch.load(directory / expected, weights_only=True)
    return RankOutcome(
        rank,
        problems=list(d["problems"]),
        logits=d["logits"],
        load_s=float(d["load_s"]),
        forward_s=float(d["forward_s"]),
    )
