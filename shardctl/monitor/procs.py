"""Processes to watch and their host memory, read from ``/proc`` (Linux).

A torchrun job is a launcher (``torchrun …`` or ``python -m torch.distributed.run …``) whose
direct children are the workers; each worker's rank is the ``RANK`` variable torchrun puts in
its environment (``/proc/PID/environ``, readable for our own user's processes).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from shardctl.errors import EnvironmentFailure, UsageError

PROC = Path("/proc")
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True)
class Proc:
    pid: int
    rank: int
    name: str  # /proc/PID/comm: user-controlled text, escape before printing as markup


@dataclass(frozen=True)
class HostMemory:
    rss: int  # bytes resident now (VmRSS)
    peak: int  # bytes resident at most since the process started (VmHWM)


def environ(pid: int) -> dict[str, str]:
    """The environment a process started with; ``{}`` when unreadable (another user, gone)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def cmdline(pid: int) -> list[str]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def comm(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def parent(pid: int) -> int | None:
    """PPID from ``/proc/PID/stat`` (field 4, after the parenthesised, maybe spaced, name)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def host_memory(pid: int) -> HostMemory | None:
    """RSS and peak RSS of ``pid``; ``None`` when the process is gone."""
    try:
        status = (PROC / str(pid) / "status").read_text(errors="replace")
    except OSError:
        return None
    kib = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            kib[key] = int(rest.split()[0])
    if "VmRSS" not in kib:  # a zombie: no memory left to count
        return None
    rss = kib["VmRSS"] * 1024
    return HostMemory(rss=rss, peak=max(rss, kib.get("VmHWM", 0) * 1024))


def _pids() -> list[int]:
    return sorted(int(p.name) for p in PROC.iterdir() if p.name.isdigit())


def is_launcher(argv: list[str]) -> bool:
    """``torchrun …``, ``python -m torch.distributed.run …`` (or ``.launch``)."""
    if not argv:
        return False
    if os.path.basename(argv[0]) == "torchrun":
        return True
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":  # python /…/bin/torchrun
        return True
    return any(a == "-m" and b in LAUNCHER_MODULES for a, b in itertools.pairwise(argv))


def rank_of(pid: int, default: int) -> int:
    value = environ(pid).get("RANK")
    return int(value) if value is not None and value.isdigit() else default


def from_pids(pids: list[int]) -> list[Proc]:
    """The given processes; rank from their ``RANK`` variable, else their position."""
    out = []
    for i, pid in enumerate(pids):
        if not (PROC / str(pid)).exists():
            raise UsageError(f"--pid {pid}: no such process", hint="check the id with ps")
        out.append(Proc(pid=pid, rank=rank_of(pid, i), name=comm(pid)))
    return out


def torchrun_workers(launchers: list[int] | None = None) -> list[Proc]:
    """The workers of the one torchrun job running on this host, ordered by rank.

    ``launchers`` names the job's launcher process(es) (``--torchrun --pid LAUNCHER``) when
    several jobs run. Raises :class:`EnvironmentFailure` (exit 5) when there is no such job,
    and :class:`UsageError` when there are several (name one launcher with ``--pid``).
    """
    pids = _pids()
    if launchers:
        for pid in launchers:
            if not is_launcher(cmdline(pid)):
                raise UsageError(
                    f"--torchrun --pid {pid}: not a torchrun launcher",
                    hint="give the pid of the `torchrun` process, or drop --torchrun",
                )
    else:
        launchers = [p for p in pids if is_launcher(cmdline(p))]
    if not launchers:
        raise EnvironmentFailure(
            "--torchrun: no torchrun process on this host",
            hint="start the job first, or name its worker processes with --pid",
        )
    children: dict[int, list[int]] = {p: [] for p in launchers}
    for p in pids:
        pp = parent(p)
        if pp in children:
            children[pp].append(p)
    jobs = {launcher: kids for launcher, kids in children.items() if kids}
    if len(jobs) > 1:
        raise UsageError(
            f"--torchrun: {len(jobs)} torchrun jobs (launcher pids "
            f"{', '.join(map(str, sorted(jobs)))})",
            hint="name one with --torchrun --pid LAUNCHER",
        )
    kids = next(iter(jobs.values()), [])
    procs = [
        Proc(pid=p, rank=int(env["RANK"]), name=comm(p))
        for p in kids
        if (env := environ(p)).get("RANK", "").isdigit()
    ]
    return sorted(procs, key=lambda p: p.rank)
