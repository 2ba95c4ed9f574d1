"""Scale-out (``WORLD_SIZE`` > 1) when a worker dies or hangs mid-run.

Each case runs two real CLI workers, ``python -m shardctl reshard SRC DST --tp 2``, either under
torchrun (``python -m torch.distributed.run``, whose agent hosts the store and stops the
survivors when one worker dies) or launched by hand with torchrun's environment (worker 0 then
hosts the store). One worker is killed or stopped at a named fault point
(``SHARDCTL_FAULT_RANK`` arms it on that worker only). The survivor must exit 5 with one
line naming the lost worker, DST must not exist, and a rerun must succeed and leave nothing
behind. ``SHARDCTL_DIST_TIMEOUT=600`` in the kill cases: the survivor must notice a dead peer
by its pid or by the store, not by waiting out a heartbeat timeout (the 120 s guard would fire).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.checkpoint import record
from shardctl.errors import UsageError
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from shardctl.reshard.scaleout import TIMEOUT_ENV, dist_timeout
from tests._models import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
GUARD_S = 120  # hang guard only; the cases finish in seconds


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("src") / "llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _launch_by_hand(
    src: Path, dst: Path, fault: str, fault_rank: int, **env: str
) -> list[subprocess.Popen[str]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        e = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SHARDCTL_FAULT": fault,
            "SHARDCTL_FAULT_RANK": str(fault_rank),
            **env,
        }
        cmd = [sys.executable, "-m", "shardctl", "reshard", str(src), str(dst), "--tp", "2"]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def _rerun_leaves_only_dst(src: Path, dst: Path) -> None:
    reshard(src, dst, mesh=Mesh(tp=2))  # takes the lock, removes the dead run's staging
    assert _leftovers(dst) == []
    assert len(record.read(dst).files) == 2


@pytest.mark.slow
def test_torchrun_worker0_killed_survivor_exits_5(llama: Path, tmp_path: Path) -> None:
    dst, logs = tmp_path / "out", tmp_path / "logs"
    env = {
        **os.environ,
        "SHARDCTL_FAULT": "shard_written:kill",
        "SHARDCTL_FAULT_RANK": "0",
        "SHARDCTL_FAULT_LOG": str(tmp_path / "reached"),
        TIMEOUT_ENV: "600",
    }
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--log-dir", str(logs), "--redirects", "3"),
        *("-m", "shardctl", "reshard", str(llama), str(dst), "--tp", "2"),
    ]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=GUARD_S)
    assert p.returncode != 0, p.stderr
    assert (tmp_path / "reached").read_text().split() == ["shard_written:1"]
    # torchrun's summary: worker 0 SIGKILLed (root cause), worker 1 exited 5 (ours, not -15)
    assert re.search(r"rank\s*:\s*1\b.*?\n\s*exitcode\s*:\s*5\b", p.stderr), p.stderr
    assert re.search(r"rank\s*:\s*0\b.*?\n\s*exitcode\s*:\s*-9\b", p.stderr), p.stderr
    (err1,) = logs.glob("*/attempt_0/1/stderr.log")
    line = _one_line(err1.read_text())
    assert re.fullmatch(
        r"shardctl: error: worker 0 died \(pid \d+ on .+\) .*; nothing was committed.*", line
    ), line
    (err0,) = logs.glob("*/attempt_0/0/stderr.log")
    assert err0.read_text().strip() == ""  # SIGKILL: no word from worker 0
    assert not os.path.lexists(dst)
    _rerun_leaves_only_dst(llama, dst)


@pytest.mark.slow
def test_worker0_killed_by_hand_store_gone(llama: Path, tmp_path: Path) -> None:
    """Without torchrun worker 0 hosts the store: the survivor loses it and names worker 0."""
    dst = tmp_path / "out"
    w0, w1 = _launch_by_hand(llama, dst, "shard_written:kill", 0, **{TIMEOUT_ENV: "600"})
    _, err = w1.communicate(timeout=GUARD_S)
    w0.communicate(timeout=GUARD_S)
    assert w0.returncode == -signal.SIGKILL
    assert w1.returncode == 5, err
    line = _one_line(err)
    assert line.startswith("shardctl: error: worker 0 is gone or stopped answering"), line
    assert "nothing was committed" in line, line
    assert not os.path.lexists(dst)
    _rerun_leaves_only_dst(llama, dst)


@pytest.mark.slow
def test_worker1_killed_worker0_cleans_up(llama: Path, tmp_path: Path) -> None:
    """Worker 0 sees worker 1's pid gone, interrupts its own share, removes the staging."""
    dst = tmp_path / "out"
    w0, w1 = _launch_by_hand(llama, dst, "shard_started:kill", 1, **{TIMEOUT_ENV: "600"})
    _, err = w0.communicate(timeout=GUARD_S)
    w1.communicate(timeout=GUARD_S)
    assert w1.returncode == -signal.SIGKILL
    assert w0.returncode == 5, err
    line = _one_line(err)
    assert re.fullmatch(r"shardctl: error: worker 1 died \(pid \d+ on .+\) .*", line), line
    assert not os.path.lexists(dst)
    assert _leftovers(dst) == []  # worker 0 held the lock and the staging: both gone
    _rerun_leaves_only_dst(llama, dst)


@pytest.mark.slow
def test_stopped_worker_declared_lost_after_timeout(llama: Path, tmp_path: Path) -> None:
    """A peer that stops answering (SIGSTOP: alive, silent) is lost after SHARDCTL_DIST_TIMEOUT."""
    dst = tmp_path / "out"
    hook = "kill -STOP $PPID"  # the hook's shell stops the worker that runs it
    w0, w1 = _launch_by_hand(
        llama, dst, "shard_written:hook", 1, SHARDCTL_FAULT_HOOK=hook, **{TIMEOUT_ENV: "2"}
    )
    try:
        _, err = w0.communicate(timeout=GUARD_S)
    finally:
        w1.kill()
        w1.communicate(timeout=GUARD_S)
    assert w0.returncode == 5, err
    line = _one_line(err)
    assert "worker 1 stopped responding (no heartbeat" in line, line
    assert f"{TIMEOUT_ENV}=2" in line, line
    assert not os.path.lexists(dst)
    assert _leftovers(dst) == []


def test_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert dist_timeout() == 60.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert dist_timeout() == 2.5
    for bad in ("abc", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(UsageError, match=TIMEOUT_ENV):
            dist_timeout()
