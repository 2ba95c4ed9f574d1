"""Run the forward level's rank jobs: one process per rank, or threads in one process.

- :func:`run_processes`: one process per rank, the environment ``torchrun`` would give it
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``), rendezvous through a TCP store this
  process hosts on a free port (no port race). gloo on CPU, NCCL with one GPU per rank. A rank
  that dies takes the run down with exit 5, never a hang. On gloo the ranks are forked from one
  server that imported torch, transformers and the family's classes once (multiprocessing's
  forkserver): each rank's ~2 s of torch import and ~1-3 s of transformers' were paid per
  rank, on as few cores as the machine has. With NCCL each rank is its own
  ``python -m shardctl.verify.worker`` (a process forked after anything touched CUDA could
  not use it).
- :func:`run_threads`: the *simulation* — every rank a thread of this process on one device,
  collectives through :class:`~shardctl.verify.comm.ThreadComm`. Used when there are fewer
  GPUs than ranks (and by tests that want many layouts without process start-up).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardctl.errors import EnvironmentFailure
from shardctl.io.tempdirs import owned_tempdir
from shardctl.verify.comm import ThreadComm, ThreadHub, Topology
from shardctl.verify.rank import RankJob, RankOutcome, run_rank
from shardctl.verify.tp_model import modeling_module, warm_imports

# at import, not on the thread that starts a world (``starting_world``): imports made on two
# threads at once, while the reference loads transformers, are best avoided
from shardctl.verify.worker import forked

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
    model_type = str(jobs[0].config.get("model_type"))
    with ProcessWorld(len(jobs), backend=backend, model_type=model_type) as world:
        return world.run(jobs, timeout_s=timeout_s)


@contextmanager
def starting_world(
    world: int, *, backend: str, model_type: str | None = None
) -> Iterator[Callable[[], ProcessWorld]]:
    """Start a :class:`ProcessWorld` on a thread now; yield the call that waits for it (and
    raises what starting it raised). The forward level starts its ranks before it runs the
    unsharded reference, so their start-up (imports, the process group) overlaps it."""
    pending = ProcessWorld(world, backend=backend, model_type=model_type)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            pending.__enter__()
        except BaseException as exc:  # handed to the caller by ready()
            failed.append(exc)

    starter = threading.Thread(target=start, name="verify-world-start", daemon=True)
    starter.start()

    def ready() -> ProcessWorld:
        starter.join()
        if failed:
            raise failed[0]
        return pending

    try:
        yield ready
    finally:
        starter.join()
        pending.close()


class _Rank(Protocol):
    """What the world asks of a rank's process: ``subprocess.Popen``'s names."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Forked:
    """A rank forked from the forkserver, under ``subprocess.Popen``'s names."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self._proc = proc

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"verify rank {self._proc.name}", timeout or 0.0)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def _preload(backend: str, model_type: str | None) -> list[str] | None:
    """What the gloo ranks' forkserver imports before it forks them; None where ranks are
    spawned one by one. Run in the thread that makes the world: resolving a transformers
    module name imports transformers, whose lazy attributes are not safe to resolve from two
    threads at once (the reference loads a model meanwhile)."""
    if backend != "gloo" or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    preload = ["torch", "transformers", "shardctl.verify.worker", "shardctl.verify.rank"]
    if model_type:
        try:
            preload.append(modeling_module(model_type))
        except (KeyError, ValueError, ImportError):
            pass  # an unknown type: the rank imports (and reports) it itself
    return preload


def _forkserver(preload: list[str]) -> Any:
    """The multiprocessing context the gloo ranks fork from. Its server starts once per
    process, with the first ``preload`` asked (a later world's family is imported by its ranks
    themselves)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


class ProcessWorld:
    """``world`` worker processes in one process group, kept alive to run many jobs.

    Jobs travel through the TCP store this process hosts (``job/<k>/<rank>``); outcomes, which
    carry logits (``tokens × vocab`` float64: 16 MiB at 16 tokens of a 128k vocabulary), are
    files in this run's private temporary directory, and the store only says which file is
    done (``outcome/<k>/<rank>``): torch's TCPStore drops values over 8 MiB with a reset
    connection. The gloo/NCCL group is formed once, so a test module pays the start-up (~1 s
    for gloo, plus torch's import) once, not per layout. ``model_type``: the family whose
    transformers classes the gloo ranks' forkserver imports before forking them.
    """

    def __init__(self, world: int, *, backend: str, model_type: str | None = None) -> None:
        self.world = world
        self.backend = backend
        self._preload = _preload(backend, model_type)  # the forkserver's imports, or None
        self._procs: list[_Rank] = []
        self._logs: list[Path] = []
        self._tmp: AbstractContextManager[Path] | None = None
        self._tmp_path = Path()
        self._store: Any = None
        self._next = 0

    def __enter__(self) -> ProcessWorld:
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # owner-locked: a killed run's directory is reaped by the next one (io.tempdirs)
        self._tmp = owned_tempdir("shardctl-verify-")
        self._tmp_path = self._tmp.__enter__()
        threads = max(1, (os.cpu_count() or 1) // self.world)
        forks = _forkserver(self._preload) if self._preload is not None else None
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
            if forks is not None:
                log.touch()
                proc = forks.Process(
                    target=forked, args=(env, str(log), threads), name=f"rank{rank}", daemon=True
                )
                proc.start()
                self._procs.append(_Forked(proc))
                continue
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
