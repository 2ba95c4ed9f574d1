"""How the forward level's CPU ranks start: forked from one preloaded server, before the
reference runs, and a rank that dies still takes the run down with its last line, not a hang.

Real gloo process groups on a real resharded checkpoint; a rank is killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from shardctl.errors import EnvironmentFailure
from shardctl.layout.types import Mesh
from shardctl.verify.api import sharded_view
from shardctl.verify.dst import open_destination
from shardctl.verify.forward import check_forward, make_jobs
from shardctl.verify.launch import ProcessWorld, _preload
from tests._verify_fixtures import Checkpoints


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-launch"))


def _ppid(pid: int) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so cut at its ")"
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_gloo_ranks_fork_from_one_preloaded_server(cks: Checkpoints) -> None:
    src, dst = cks.ckpt("qwen2"), cks.resharded("qwen2", Mesh(tp=2))
    ck = sharded_view(open_destination(dst))
    jobs = make_jobs(ck, device="cpu", simulated=False, seed=0)
    preload = _preload("gloo", "qwen2")
    assert preload is not None and "transformers.models.qwen2.modeling_qwen2" in preload
    assert _preload("nccl", "qwen2") is None  # GPU ranks: one fresh process each
    with ProcessWorld(2, backend="gloo", model_type="qwen2") as world:
        pids = [p._proc.pid for p in world._procs]  # type: ignore[attr-defined]
        parents = {_ppid(pid) for pid in pids}
        assert len(parents) == 1 and os.getpid() not in parents, parents  # one server, not us
        outcomes = world.run(jobs)
        assert [o.rank for o in outcomes] == [0, 1]
        assert not any(o.problems for o in outcomes)
        # a second job on the same group: the ranks stayed up
        assert len(world.run(jobs)) == 2
    for pid in pids:  # torn down: stopped and reaped by the server
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            assert time.monotonic() < deadline, f"rank {pid} still running"
            time.sleep(0.05)
    level, _, env = check_forward(src, ck, device="cpu", simulate=False)
    assert level.status == "pass" and env["backend"] == "gloo" and env["simulated"] is False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "Z"


def test_a_killed_rank_fails_the_run_naming_it(cks: Checkpoints) -> None:
    dst = cks.resharded("qwen2", Mesh(tp=2))
    jobs = make_jobs(sharded_view(open_destination(dst)), device="cpu", simulated=False, seed=0)
    with ProcessWorld(2, backend="gloo", model_type="qwen2") as world:
        victim = world._procs[1]._proc.pid  # type: ignore[attr-defined]
        os.kill(victim, signal.SIGKILL)
        # seen as dead (its exit status and log), not waited out: a timeout says otherwise
        with pytest.raises(EnvironmentFailure, match=r"forward rank 1 exited with -9"):
            world.run(jobs, timeout_s=300)


def test_a_world_that_cannot_start_raises_at_ready_and_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What starting the ranks raised on the starter thread is raised where the forward level
    waits for them, and the half-made world is closed (nothing started, nothing left)."""
    from shardctl.verify import launch

    def refuse(self: ProcessWorld) -> ProcessWorld:
        raise EnvironmentFailure("no free port for the TCP store")

    monkeypatch.setattr(launch.ProcessWorld, "__enter__", refuse)
    with launch.starting_world(2, backend="gloo", model_type="qwen2") as ready:
        with pytest.raises(EnvironmentFailure, match="no free port"):
            ready()
