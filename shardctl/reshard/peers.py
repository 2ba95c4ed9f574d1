"""The other workers of a scale-out run, as seen through the rendezvous store.

Keys (under the run's prefix): ``who/R`` (pid, host, kernel and pid namespace), ``beat/R`` (a
counter bumped every second), ``left/R`` (why it left; empty while it works). A worker is lost
when it left early, when its process is gone on this host, or when its heartbeat has not moved
for ``SHARDCTL_DIST_TIMEOUT`` seconds (protocol: :mod:`shardctl.reshard.scaleout`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardctl.errors import EnvironmentFailure, ShardctlError, UsageError

TIMEOUT_ENV = "SHARDCTL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
POLL_S = 0.1


def dist_timeout() -> float:
    """``SHARDCTL_DIST_TIMEOUT`` in seconds (default 60): how long a silent worker is waited for."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UsageError(f"{TIMEOUT_ENV}: expected a number of seconds > 0, got {text!r}")
    return value


class PeerLost(Exception):
    """A watched worker is gone; ``str``: which and how."""

    def __init__(self, rank: int, how: str):
        self.rank = rank
        super().__init__(f"worker {rank} {how}")


class StoreLost(Exception):
    """The store stopped answering (its host, worker 0 or torchrun's agent, is gone)."""


@dataclass
class _Peer:
    rank: int
    pid: int = 0
    host: str = "?"
    local: bool = False  # same kernel and pid namespace: its pid means the same here
    beats: bytes = b""
    seen: float = field(default_factory=time.monotonic)  # when its heartbeat last moved


def where_am_i() -> str:
    """This kernel's boot id and pid namespace: equal strings mean comparable pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}|{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"unknown|{socket.gethostname()}|{os.getpid()}|{time.time_ns()}"  # unique


def pid_gone(pid: int) -> bool:
    """The process has exited (or is a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True  # ProcessLookupError (ESRCH): reaped between the open and the read
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def first_line(exc: BaseException) -> str:
    text = exc.render() if isinstance(exc, ShardctlError) else str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def store_gone(addr: str) -> str:
    return f"is gone or stopped answering (it hosts the rendezvous store at {addr})"


class Peers:
    """The other workers as this one sees them through the store: who and where they are,
    their heartbeats, whether they left. Every store call goes through ``call`` (one at a time:
    the heartbeat thread and the main thread share the connection)."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float, addr: str) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout, self.addr = timeout, addr
        self.lock = threading.Lock()
        self.peers = {r: _Peer(r) for r in range(world) if r != rank}
        self.joined = False
        self.left = False

    def beat(self, n: int) -> None:
        self.put(f"beat/{self.rank}", str(n))

    def put(self, key: str, value: str) -> None:
        self.call(self.store.set, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.call(self.store.get, key))

    def all_published(self) -> bool:
        """Every peer has published its identity (``who/R``)."""
        return bool(self.call(self.store.check, [f"who/{r}" for r in self.peers]))

    def publish(self, me: dict[str, Any]) -> None:
        # beat and left exist before who: a peer that sees who can multi_get both
        self.call(self.store.set, f"beat/{self.rank}", "0")
        self.call(self.store.set, f"left/{self.rank}", "")
        self.call(self.store.set, f"who/{self.rank}", json.dumps(me))

    def join(self, where: str, join_s: float) -> None:
        """Every worker's identity, or exit 5 naming those that never came."""
        start = time.monotonic()
        keys = [f"who/{r}" for r in self.peers]
        while keys and not self.call(self.store.check, keys):
            if time.monotonic() - start > join_s:
                missing = [r for r in self.peers if not self.has(f"who/{r}")]
                raise EnvironmentFailure(
                    f"workers {missing} did not join within {join_s:.0f} s", where=self.addr
                )
            time.sleep(POLL_S)
        self.know_peers(where)

    def know_peers(self, where: str) -> None:
        for r, p in self.peers.items():
            who = json.loads(self.get(f"who/{r}"))
            p.pid, p.host, p.local = int(who["pid"]), str(who["host"]), who["where"] == where
            p.seen = time.monotonic()
        self.joined = True

    def check(self, ranks: Sequence[int]) -> None:
        """Raise PeerLost for the first of ``ranks`` that left early or is gone."""
        keys = [f"beat/{r}" for r in ranks] + [f"left/{r}" for r in ranks]
        values = self.call(self.store.multi_get, keys)
        now = time.monotonic()
        for i, r in enumerate(ranks):
            p = self.peers[r]
            beats, left = values[i], values[len(ranks) + i]
            if left:
                raise PeerLost(r, f"stopped ({left.decode(errors='replace')}; see its error)")
            if beats != p.beats:
                p.beats, p.seen = beats, now
            if p.local and pid_gone(p.pid):
                raise PeerLost(r, f"died (pid {p.pid} on {p.host})")
            if now - p.seen > self.timeout:
                raise PeerLost(
                    r,
                    f"stopped responding (no heartbeat from {p.host} for {now - p.seen:.0f} s; "
                    f"{TIMEOUT_ENV}={self.timeout:g})",
                )

    def linger(self) -> None:
        """Worker 0 hosts the store: keep it up until every live peer has left."""
        pending = set(self.peers)
        while pending:
            for r in sorted(pending):
                try:
                    self.check([r])
                except (PeerLost, StoreLost):
                    pending.discard(r)  # left (or gone): done with the store
            if pending:
                time.sleep(POLL_S)

    def has(self, key: str) -> bool:
        return bool(self.call(self.store.check, [key]))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            try:
                return fn(*args)
            except RuntimeError as exc:  # DistNetworkError, DistStoreError: the store is gone
                raise StoreLost(first_line(exc)) from None

    def leave(self, reason: str) -> None:
        if self.left:
            return
        self.left = True
        try:
            self.call(self.store.set, f"left/{self.rank}", reason or "left")
        except StoreLost:
            pass
