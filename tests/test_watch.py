"""``shardctl watch`` against a real running torchrun job on CPU (host RSS per rank).

The job is a purpose-built script: rank r holds (r + 1) × 32 MiB of touched memory, writes a
ready file, and sleeps until the test writes a stop file, so the sizes are known while it runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardctl.monitor import procs
from shardctl.monitor.nvml import Nvml

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
HELD = 32 * MIB

WORKER = """
import os, pathlib, sys, time
rank = int(os.environ["RANK"])
held = bytearray(b"\\x01") * ((rank + 1) * {held})  # every page written: resident
run = pathlib.Path(sys.argv[1])
part = run / f"ready-{{rank}}.part"
part.write_text(str(os.getpid()))
part.rename(run / f"ready-{{rank}}")  # whole or absent: the test reads it the moment it appears
while not (run / "stop").exists():
    time.sleep(0.1)
"""


class Job(SimpleNamespace):
    launcher: subprocess.Popen[bytes]
    workers: dict[int, int]  # rank -> pid
    plan: Path


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    run = tmp_path_factory.mktemp("watch-job")
    script = run / "worker.py"
    script.write_text(WORKER.format(held=HELD))
    plan = run / "plan.json"
    made = shardctl("plan", str(ROOT / "manifests" / "phi-3-mini-tp2.yaml"), "--json")
    assert made.returncode == 0, made.stderr
    plan.write_text(made.stdout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launcher = subprocess.Popen(
        [*cmd, str(script), str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        ready = [run / f"ready-{r}" for r in (0, 1)]
        while not all(p.exists() for p in ready):
            assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
            time.sleep(0.1)
        workers = {r: int(p.read_text()) for r, p in enumerate(ready)}
        yield Job(launcher=launcher, workers=workers, plan=plan)
    finally:
        (run / "stop").write_text("")
        try:
            launcher.wait(timeout=60)  # cleanup only: the workers see the stop file and exit
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def shardctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, cwd=ROOT
    )


def _lines(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_torchrun_job_one_record_per_rank_with_plan_figure(job: Job) -> None:
    launcher = str(job.launcher.pid)
    proc = shardctl(
        "watch", "--torchrun", "--pid", launcher, "--plan", str(job.plan), "--count", "2",
        "--interval", "0.2", "--json", "--source", "rss",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = _lines(proc.stdout)
    samples = [r for r in records if r["event"] == "sample"]
    plan = json.loads(job.plan.read_text())
    planned = {r["rank"]: r["memory"]["total"] for r in plan["ranks"]}
    for tick in (0, 1):
        by_rank = {r["rank"]: r for r in samples if r["tick"] == tick}
        assert sorted(by_rank) == [0, 1]
        for rank, rec in by_rank.items():
            assert rec["schema"] == "shardctl.watch/1" and rec["source"] == "rss"
            assert rec["pid"] == job.workers[rank]
            assert isinstance(rec["used_bytes"], int) and rec["used_bytes"] > (rank + 1) * HELD
            assert rec["peak_bytes"] >= rec["used_bytes"]  # type: ignore[operator]
            assert rec["plan_bytes"] == planned[rank]
            assert rec["over"] is False  # MiB of RSS against GiB of plan
    summary = records[-1]
    assert summary["event"] == "summary"
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]  # type: ignore[union-attr]


def test_plain_torchrun_discovery_finds_the_job(job: Job) -> None:
    """Without a launcher pid: this job's workers, or (another job runs on this shared host)
    a usage error that names this job's launcher among several."""
    proc = shardctl("watch", "--torchrun", "--once", "--json")
    if proc.returncode == 2:
        assert "torchrun jobs" in proc.stderr and str(job.launcher.pid) in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    pids = {r["pid"] for r in _lines(proc.stdout) if r["event"] == "sample"}
    assert pids == set(job.workers.values())


def test_rank_over_its_plan_warns_and_exits_1(job: Job, tmp_path: Path) -> None:
    plan = json.loads(job.plan.read_text())
    for r in plan["ranks"]:
        r["memory"]["total"] = 8 * MIB  # below what each worker holds
    small = tmp_path / "small.json"
    small.write_text(json.dumps(plan))
    pids = [str(job.workers[r]) for r in (1, 0)]  # rank from RANK, not from the order
    proc = shardctl(
        "watch", "--pid", pids[0], "--pid", pids[1], "--plan", str(small), "--once",
        "--threshold", "10%", "--source", "rss",
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.count("warning: rank") == 2
    assert "rank 0 (pid" in proc.stderr and "threshold" in proc.stderr
    assert "summary (peak per rank vs plan):" in proc.stdout
    assert "over the threshold" in proc.stdout


def test_text_table_escapes_process_names() -> None:
    # A process named like rich markup must print as text, not be parsed as style.
    # (comm is limited to 15 bytes.)
    named = subprocess.Popen([sys.executable, "-c", _RENAME], stdout=subprocess.PIPE)
    try:
        assert named.stdout is not None
        named.stdout.readline()  # renamed
        proc = shardctl("watch", "--pid", str(named.pid), "--once")
    finally:
        named.kill()
        named.wait()
    assert proc.returncode == 0, proc.stderr
    assert "[red]x" in proc.stdout


_RENAME = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"[red]x", 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm
print("renamed", flush=True)
time.sleep(30)
"""


def test_launcher_patterns() -> None:
    assert procs.is_launcher(["/v/bin/torchrun", "--nproc-per-node", "2", "x.py"])
    assert procs.is_launcher(["/usr/bin/python3", "/v/bin/torchrun", "x.py"])
    assert procs.is_launcher(["python", "-m", "torch.distributed.run", "x.py"])
    assert not procs.is_launcher(["python", "-m", "shardctl.verify.worker"])
    assert not procs.is_launcher([])


def test_nvml_sums_a_process_over_devices() -> None:
    entry = SimpleNamespace
    per_device = {
        "h0": [entry(pid=10, usedGpuMemory=3 * MIB), entry(pid=11, usedGpuMemory=None)],
        "h1": [entry(pid=10, usedGpuMemory=5 * MIB)],
    }
    lib = SimpleNamespace(nvmlDeviceGetComputeRunningProcesses=per_device.__getitem__)
    got = Nvml(lib, ["h0", "h1"]).per_pid()
    assert got[10].used == 8 * MIB and got[10].device == 1
    assert got[11].used == 0 and got[11].device == 0


def test_usage_errors() -> None:
    assert shardctl("watch").returncode == 2
    assert shardctl("watch", "--pid", "1", "--threshold", "lots").returncode == 2
    assert shardctl("watch", "--pid", "999999999", "--once").returncode == 2
