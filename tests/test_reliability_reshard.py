"""Reliability groups E and F (and B7–B9) for ``reshard``: kills at every named point,
disk full, read-only, permission denied, EFBIG, fsync/close errors, signals, two concurrent
runs, torchrun scale-out. Subprocess cases run ``python -m shardctl reshard`` (what
the CLI does); the rest run in-process. Invariants: exit code, one line on stderr, the input's
sha256 unchanged, the output absent or complete (every file's digest matches the record)."""

from __future__ import annotations

import errno
import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardctl.checkpoint import record
from shardctl.errors import EnvironmentFailure, OutputConflictError
from shardctl.io import faults
from shardctl.io.checksum import new_hash
from shardctl.io.lock import OutputLock
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.layout.types import Mesh
from shardctl.reshard import copy as copy_module
from shardctl.reshard.api import reshard
from tests._models import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, setpriv)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("src") / "llama")


def synthetic(path: Path, mib: int, *, tensors: int = 8) -> Path:
    """An HF-style directory of ``mib`` MiB of U8 tensors (no transformers needed)."""
    path.mkdir(parents=True)
    n = mib * 2**20 // tensors
    entries = [HeaderEntry(f"w{i}", "U8", (n,), i * n, (i + 1) * n) for i in range(tensors)]
    with open(path / "model.safetensors", "wb") as f:
        f.write(header_bytes(entries, {"format": "pt"}))
        for i in range(tensors):
            f.write(bytes([i + 1]) * n)
    (path / "config.json").write_text("{}")
    return path


def sha(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def complete(dst: Path) -> dict:
    """Assert ``dst`` is a complete output: every recorded file present with its digest."""
    rec = record.read(dst)
    for f in rec.files:
        h = new_hash(rec.hash)
        h.update((dst / f.name).read_bytes())
        assert h.hexdigest() == f.digest, f.name
    return record.load_json(dst / record.RECORD_NAME)


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, pre: list[str] = ()
) -> subprocess.CompletedProcess[str]:
    cmd = [*pre, sys.executable, "-m", "shardctl", "reshard", *args]
    return subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


# ---- E1 / B8 / E3 / F2: kill -9 at every named point, replacing an existing output ---------


@pytest.mark.parametrize("point", faults.POINTS)
def test_kill_at_each_point_leaves_old_or_new(llama: Path, tmp_path: Path, point: str) -> None:
    before = sha(llama)
    dst = tmp_path / "out"
    reshard(llama, dst, mesh=Mesh(tp=2))  # the previous output, replaced with --force
    old = complete(dst)
    log = tmp_path / "reached"
    p = run(
        str(llama),
        str(dst),
        "--format",
        "hf",
        "--max-shard-size",
        "100000",
        "--force",
        env={"SHARDCTL_FAULT": f"{point}:kill", "SHARDCTL_FAULT_LOG": str(log)},
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert log.read_text().split() == [f"{point}:1"]  # the configured point was reached
    now = complete(dst)  # never a mix, never neither
    assert now["format"] == ("ranks" if point != "after_rename" else "hf")
    assert now == old or point == "after_rename"
    assert sha(llama) == before
    # clean restart under the lock: stale staging removed, output replaced, nothing left over
    reshard(llama, dst, fmt="hf", max_shard_size=100_000, force=True)
    assert complete(dst)["format"] == "hf"
    assert leftovers(dst) == []


def test_kill_without_previous_output_leaves_nothing(llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    p = run(str(llama), str(dst), "--tp", "2", env={"SHARDCTL_FAULT": "shard_written:2:kill"})
    assert p.returncode == -signal.SIGKILL
    assert not dst.exists()
    reshard(llama, dst, mesh=Mesh(tp=2))  # F2: the dead run's lock does not block; staging cleaned
    complete(dst)
    assert leftovers(dst) == []


# ---- E4 / E5 / E6 / E7: disk full, file too large, read-only, permission denied -------------


@root_only
def test_enospc_preflight_and_mid_run(tmp_path: Path) -> None:
    big = synthetic(tmp_path / "big", 12)
    small = synthetic(tmp_path / "small", 6)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=8M tmpfs {mnt} && "
        f"{sys.executable} -m shardctl reshard {big} {mnt}/a; echo rc=$?; ls -A {mnt}; "
        f"SHARDCTL_FAULT=shard_written:1:hook SHARDCTL_FAULT_HOOK='fallocate -l 7M {mnt}/filler' "
        f"{sys.executable} -m shardctl reshard {small} {mnt}/b --format hf "
        f"--max-shard-size 1000000 --workers 1; echo rc=$?; ls -A {mnt}"
    )
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    out = p.stdout.split()
    assert out[0] == "rc=5", p.stdout + p.stderr
    assert out[1] == "rc=5" and out[2:] == ["filler"], p.stdout + p.stderr
    errs = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "need 13.0 MiB, 8.0 MiB available" in errs[0], errs
    assert "no space left on device" in errs[1] and len(errs) == 2


def test_efbig(tmp_path: Path) -> None:
    src = synthetic(tmp_path / "src", 4)
    p = run(str(src), str(tmp_path / "out"), pre=["prlimit", "--fsize=1048576"])
    assert p.returncode == 5, p.stderr
    assert "file too large" in one_line_error(p)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@root_only
def test_read_only_output(llama: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (
        f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && "
        f"{sys.executable} -m shardctl reshard {llama} {ro}/out --tp 2"
    )
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 5, p.stderr
    assert "read-only file system" in one_line_error(p).lower()


@root_only
def test_permission_denied_as_nobody(tmp_path: Path) -> None:
    """E7 as an unprivileged user, whatever the checkout's own permissions.

    The checkout (a ``mktemp -d`` clone is 0700), its virtualenv and pyenv under ``/root`` may be
    unreachable for ``nobody``; inside a private mount namespace the package, the environment's
    site-packages and the interpreter's prefix are bind-mounted into a world-readable directory,
    so nothing outside the test's own directory changes.
    """
    import sysconfig

    base = Path(os.path.realpath("/tmp")) / f"shardctl-e7-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    try:
        src = synthetic(base / "src", 1)
        os.chmod(base, 0o755)
        (base / "locked").mkdir(mode=0o755)  # root-owned: nobody cannot create entries in it
        for d in ("py/shardctl", "site", "pyenv"):
            (base / d).mkdir(parents=True, mode=0o755)
        python = Path(os.path.realpath(sys.executable))
        prefix = Path(sys.base_prefix).parents[1]  # e.g. /root/.pyenv, under /root (0700)
        mounts = [
            f"mount --bind {REPO / 'shardctl'} {base}/py/shardctl",
            f"mount --bind {sysconfig.get_paths()['purelib']} {base}/site",
        ]
        if str(prefix).startswith("/root/"):  # reach the interpreter as nobody; /root untouched
            mounts += [
                f"mount --bind {prefix} {base}/pyenv",
                "mount -t tmpfs -o mode=0755 tmpfs /root",
                f"mkdir -p {prefix}",
                f"mount --bind {base}/pyenv {prefix}",
            ]
        script = " && ".join(
            [
                *mounts,
                f"PYTHONPATH={base}/py:{base}/site setpriv --reuid=65534 --regid=65534 "
                f"--clear-groups {python} -m shardctl reshard {src} {base}/locked/out",
            ]
        )
        p = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            cwd=base,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 5, p.stdout + p.stderr
        assert "permission denied" in one_line_error(p).lower()
        assert os.listdir(base / "locked") == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- E9 / E10: fsync and close errors (in-process fault points and monkeypatch) ------------


def test_fsync_eio_commits_nothing(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults.reset()
    monkeypatch.setenv("SHARDCTL_FAULT", "shard_fsynced:1:raise:EIO")
    with pytest.raises(EnvironmentFailure, match="I/O error"):
        reshard(llama, tmp_path / "out", mesh=Mesh(tp=2))
    assert faults.reached == ["shard_fsynced:1"]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_error_at_close_commits_nothing(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_close = os.close
    calls = {"n": 0}

    def failing_close(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            real_close(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_close(fd)

    monkeypatch.setattr(copy_module.os, "close", failing_close)
    with pytest.raises(EnvironmentFailure, match="no space left"):
        reshard(llama, tmp_path / "out", mesh=Mesh(tp=4))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_input_truncated_during_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A18/F3: the input shrinks under us -> exit 5 ``input changed during run``, no output."""
    src = synthetic(tmp_path / "src", 2)
    faults.reset()
    faults.add_hook(lambda point, n: os.truncate(src / "model.safetensors", 4096))
    monkeypatch.setenv("SHARDCTL_FAULT", "shard_started:1:hook")
    with pytest.raises(EnvironmentFailure, match="input changed during run"):
        reshard(src, tmp_path / "out", fmt="hf", block_bytes=65536)
    faults.reset()
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_input_touched_during_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same size, new mtime (a downloader rewrote it): caught by the end-of-run re-check."""
    src = synthetic(tmp_path / "src", 1)
    faults.reset()
    faults.add_hook(lambda point, n: os.utime(src / "model.safetensors", ns=(1, 1)))
    monkeypatch.setenv("SHARDCTL_FAULT", "shard_written:1:hook")
    with pytest.raises(EnvironmentFailure, match="input changed during run"):
        reshard(src, tmp_path / "out", fmt="hf")
    faults.reset()
    assert not (tmp_path / "out").exists()


# ---- E11: signals -----------------------------------------------------------------------


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_cleans_up(llama: Path, tmp_path: Path, sig: int, code: int) -> None:
    dst, log = tmp_path / "out", tmp_path / "reached"
    cmd = [sys.executable, "-m", "shardctl", "reshard", str(llama), str(dst), "--tp", "2"]
    env = {
        **os.environ,
        "SHARDCTL_FAULT": "staging_created:sleep:30",
        "SHARDCTL_FAULT_LOG": str(log),
    }
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(dst)  # lock and staging exist while it sleeps
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    assert "interrupted" in err and len(err.strip().splitlines()) == 1
    assert not dst.exists() and leftovers(dst) == []


# ---- F1: two concurrent runs ------------------------------------------------------------


def test_second_run_is_locked_out(llama: Path, tmp_path: Path) -> None:
    # B runs from A's fault hook, while A holds the lock after writing its first shard: no race
    # with the machine's load (a sleep-and-poll version lost it when B's start-up outlasted
    # the sleep).
    other = make_checkpoint("llama", tmp_path / "other", seed=1)
    dst, b_err, b_rc, a_pid = (tmp_path / n for n in ("out", "b.err", "b.rc", "a.pid"))
    b_cmd = " ".join(
        shlex.quote(a) for a in (sys.executable, "-m", "shardctl", "reshard", str(other), str(dst))
    )
    env = {
        **os.environ,
        "SHARDCTL_FAULT": "shard_written:1:hook",
        "SHARDCTL_FAULT_HOOK": f"env -u SHARDCTL_FAULT -u SHARDCTL_FAULT_HOOK {b_cmd} --tp 2 "
        f"2>{shlex.quote(str(b_err))}; echo $? >{shlex.quote(str(b_rc))}; "
        f"echo $PPID >{shlex.quote(str(a_pid))}",  # the hook's shell is A's child
    }
    a = run(str(llama), str(dst), "--tp", "2", env=env, timeout=600)
    assert a.returncode == 0, a.stderr
    assert b_rc.read_text().strip() == "4"
    b = subprocess.CompletedProcess([], 4, "", b_err.read_text())
    assert f"output locked by pid {a_pid.read_text().strip()}" in one_line_error(b)
    raw = complete(dst)  # A's output, from A's source
    assert raw["source"]["path"] == str(llama)
    reshard(dst, tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (
        llama / "model.safetensors"
    ).read_bytes()


def test_lock_in_process(llama: Path, tmp_path: Path) -> None:
    with OutputLock(tmp_path / "out"):
        with pytest.raises(OutputConflictError, match=f"locked by pid {os.getpid()}"):
            reshard(llama, tmp_path / "out", mesh=Mesh(tp=2))
    assert not (tmp_path / "out").exists()


# ---- B7 / B9: output location ------------------------------------------------------------


def test_output_overlapping_input_refused(llama: Path, tmp_path: Path) -> None:
    before = sha(llama)
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    (tmp_path / "link").symlink_to(src)
    (tmp_path / "parent-link").symlink_to(src)
    os.link(src / "model.safetensors", tmp_path / "hard.safetensors")
    bad = [src, src / "out", tmp_path, tmp_path / "link", tmp_path / "parent-link" / "out"]
    for dst in bad:
        with pytest.raises(OutputConflictError):
            reshard(src, dst, mesh=Mesh(tp=2), force=True)
    with pytest.raises(OutputConflictError, match="hard link"):
        reshard(src, tmp_path / "hard.safetensors", mesh=Mesh(tp=2), force=True)
    with pytest.raises(OutputConflictError, match="output exists"):
        (tmp_path / "exists").mkdir()
        reshard(src, tmp_path / "exists", mesh=Mesh(tp=2))
    assert list((tmp_path / "exists").iterdir()) == []
    with pytest.raises(EnvironmentFailure, match="parent directory does not exist"):
        reshard(src, tmp_path / "missing" / "out", mesh=Mesh(tp=2))
    assert sha(src) == before


def test_different_mount_output(llama: Path) -> None:
    """E8: output on tmpfs, input on disk: staging is a sibling, so no EXDEV."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    dst = shm / f"shardctl-e8-{os.getpid()}"
    try:
        reshard(llama, dst, mesh=Mesh(tp=2))
        complete(dst)
    finally:
        shutil.rmtree(dst, ignore_errors=True)


# ---- E13: durability ordering ------------------------------------------------------------


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_fsync_before_rename(llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    trace = tmp_path / "trace"
    p = run(
        str(llama),
        str(dst),
        "--tp",
        "2",
        pre=["strace", "-f", "-o", str(trace), "-e", "trace=fsync,rename,renameat,renameat2"],
    )
    assert p.returncode == 0, p.stderr
    calls = [
        ln.split(None, 1)[1]
        for ln in trace.read_text().splitlines()
        if "fsync" in ln or "rename" in ln
    ]
    calls = [c for c in calls if "resumed" not in c]
    renames = [i for i, c in enumerate(calls) if c.startswith("rename")]
    assert renames, calls
    fsyncs = [i for i, c in enumerate(calls) if c.startswith("fsync")]
    # 2 rank files + 2 carried + record + staging dir, all fsynced before the rename; parent after
    assert len([i for i in fsyncs if i < renames[-1]]) >= 6
    assert any(i > renames[-1] for i in fsyncs)


# ---- item 8: scale-out under torchrun's environment ---------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_workers_split_the_files(llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "shardctl", "reshard", str(llama), str(dst), "--tp", "4"]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    raw = complete(dst)
    assert len(raw["files"]) == 4
    reshard(llama, tmp_path / "single", mesh=Mesh(tp=4))
    for f in raw["files"]:
        assert (dst / f["name"]).read_bytes() == (tmp_path / "single" / f["name"]).read_bytes()
    assert leftovers(dst) == []
