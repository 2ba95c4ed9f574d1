"""Scale-out under ``torchrun``: workers split the output files; worker 0 commits the record.

With ``WORLD_SIZE`` > 1 every worker runs the same ``reshard`` call. The workers exchange no
tensor data (each reads the input and writes its files on shared storage), so they coordinate
through the rendezvous key-value store alone (``env://``: torchrun's agent store, or one that
worker 0 hosts at ``MASTER_ADDR:MASTER_PORT``), never through a collective that can hang::

    join     every worker publishes its host and pid, and waits for the others
    share    worker 0 takes the lock, creates the staging directory, publishes its path
    gather   each worker writes its share (greedy by size), then publishes digests or error
    done     worker 0 writes the record, commits, publishes "committed"; the others wait for it

Every wait polls the store and watches the workers it waits on; a heartbeat thread in each
worker bumps a counter every second. A watched worker is declared lost — and the waiter stops
with exit 5 and one line ``worker N died (pid P on HOST) while writing; nothing was
committed ...`` — when

- its process is gone and it ran on this host (same kernel and pid namespace): at once;
- its heartbeat has not moved for ``SHARDCTL_DIST_TIMEOUT`` seconds (default 60): another
  host lost, a stopped process;
- the store stops answering: it lived in worker 0, which is then gone.

A worker still writing its share when a peer is lost is interrupted as Ctrl-C would (its
files are in the staging directory, which worker 0 or the next run removes). torchrun itself
stops the surviving workers with SIGTERM as soon as one dies; that SIGTERM is reported as the
lost peer's error when the peer is found gone. A slow worker is not a lost one: while its
heartbeat moves, the waits have no deadline. torch is imported only on this path.
"""

from __future__ import annotations

import _thread
import atexit
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardctl.checkpoint.plan_files import OutputFile
from shardctl.errors import EnvironmentFailure, Interrupted, ShardctlError, UsageError

TIMEOUT_ENV = "SHARDCTL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 300.0  # workers of one run may start this far apart (slow imports, queues)
POLL_S = 0.1
TERM_GRACE_S = 30.0  # after a peer is lost, SIGTERMs are ignored this long while we clean up


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


class _PeerLost(Exception):
    """A watched worker is gone; ``str``: which and how."""

    def __init__(self, rank: int, how: str):
        self.rank = rank
        super().__init__(f"worker {rank} {how}")


class _StoreLost(Exception):
    pass


@dataclass
class _Peer:
    rank: int
    pid: int = 0
    host: str = "?"
    local: bool = False  # same kernel and pid namespace: its pid means the same here
    beats: bytes = b""
    seen: float = field(default_factory=time.monotonic)  # when its heartbeat last moved


def _where() -> str:
    """This kernel's boot id and pid namespace: equal strings mean comparable pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}|{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"unknown|{socket.gethostname()}|{os.getpid()}|{time.time_ns()}"  # unique


def _pid_gone(pid: int) -> bool:
    """The process has exited (or is a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


def _first_line(exc: BaseException) -> str:
    text = exc.render() if isinstance(exc, ShardctlError) else str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


class Group:
    """The workers of one scale-out run (protocol: the module docstring)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d socket warnings: not ours
        from torch.distributed import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        self.timeout = timeout_s if timeout_s is not None else dist_timeout()
        self.beat_s = min(1.0, self.timeout / 5)
        self.addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        join_s = max(self.timeout, JOIN_TIMEOUT_S)
        try:
            store, self.rank, self.world = next(
                rendezvous("env://", timeout=timedelta(seconds=join_s))
            )
        except (RuntimeError, ValueError) as exc:
            raise EnvironmentFailure(
                f"cannot join the other workers at {self.addr}: {_first_line(exc)}",
                hint="check MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (torchrun sets them)",
            ) from None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = PrefixStore(f"shardctl/{restart}", store)
        self.lock = threading.Lock()  # one store call at a time: heartbeat and main thread
        self.peers = {r: _Peer(r) for r in range(self.world) if r != self.rank}
        self.lost: _PeerLost | None = None  # set once a peer is found lost
        self.lost_at = 0.0
        self.joined = False
        self.working = False
        self.interruptible = threading.current_thread() is threading.main_thread()
        self.left = False
        self.phase = "while joining"  # for messages: what the run was doing
        self.stop = threading.Event()
        self.where = _where()
        me = {"pid": os.getpid(), "host": socket.gethostname(), "where": self.where}
        self._guard(self._publish, me)
        self.prev_term: Any = None
        if self.interruptible:  # torchrun's SIGTERM, once a peer is known lost, changes nothing
            self.prev_term = signal.signal(signal.SIGTERM, self._on_term)
        self.thread = threading.Thread(target=self._heartbeat, name="shardctl-heartbeat")
        self.thread.daemon = True
        self.thread.start()
        atexit.register(self._at_exit)
        self._guard(self._join, me["where"], join_s)
        # From now on a store call that takes longer than the timeout means its host (worker
        # 0, or torchrun's agent) stopped answering: fail then, instead of after join_s.
        self._guard(self._call, store.set_timeout, timedelta(seconds=self.timeout))

    # ---- the protocol (called by shardctl.reshard.api) -----------------------------------

    def share(self, staging: Path | None) -> Path:
        """Worker 0's staging path to everyone (None: worker 0 failed before creating it)."""
        self.phase = "before staging the output"
        if self.rank == 0:
            self._guard(self._call, self.store.set, "staging", str(staging or ""))
            if staging is None:
                self._leave("it failed before staging the output")
                return Path()  # the caller re-raises its own error
            return staging
        value = self._guard(self._wait, "staging")
        if not value:
            self._leave("worker 0 failed")
            raise EnvironmentFailure("worker 0 failed before staging the output; see its error")
        return Path(value.decode())

    def mine(self, files: list[OutputFile]) -> list[OutputFile]:
        self.phase = "before writing"
        loads = [0] * self.world
        owner: dict[int, int] = {}
        for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
            k = loads.index(min(loads))
            owner[i] = k
            loads[k] += files[i].size
        return [f for i, f in enumerate(files) if owner[i] == self.rank]

    def run_and_gather(self, fn: Callable[[], dict[str, str]]) -> dict[str, str]:
        """Run this worker's part; gather every worker's digests; raise if any worker failed."""
        self.phase = "while writing"
        error: BaseException | None = None
        digests: dict[str, str] = {}
        try:
            with self._working():
                digests = fn()
        except BaseException as exc:
            error = self.explain(exc)
            if self.lost is not None:  # nobody to share it with: stop now
                self._leave(str(self.lost))
                raise error from None
        got: dict[int, Any] = {}
        try:
            got[self.rank] = [digests, None if error is None else _first_line(error)]
            self._guard(
                self._call, self.store.set, f"result/{self.rank}", json.dumps(got[self.rank])
            )
            for r in self.peers:
                got[r] = json.loads(self._guard(self._wait, f"result/{r}", r))
        except BaseException as exc:
            self._leave("failed while gathering")
            raise (error or self.explain(exc)) from None
        if error is not None:
            self._leave("failed while writing")
            raise error
        failed = sorted((r, msg) for r, (_, msg) in got.items() if msg is not None)
        if failed:
            self._leave("another worker failed")
            r, msg = failed[0]
            raise EnvironmentFailure(f"worker {r} failed: {msg}")
        merged: dict[str, str] = {}
        for r in sorted(got):
            merged.update(got[r][0])
        return merged

    def done(self) -> None:
        """Worker 0: after its commit. The others: return once worker 0 has committed."""
        self.phase = "before confirming the commit"
        if self.rank == 0:
            self._guard(self._call, self.store.set, "committed", "1")
        else:
            self._guard(self._wait, "committed")
        self.close()

    def close(self) -> None:
        """Leave the run; worker 0 first waits for the others (they may still read its store)."""
        self._leave("done")
        if self.rank == 0 and not self.agent_store:
            self._linger()
        self._stop()

    def _stop(self) -> None:
        # Joined, not left as a daemon: a thread inside a store call while the interpreter
        # exits makes the C++ runtime abort ("terminate called without an active exception").
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(self.timeout + 5)

    # ---- store, waits, liveness ----------------------------------------------------------

    def _publish(self, me: dict[str, Any]) -> None:
        # beat and left exist before who: a peer that sees who can multi_get both
        self._call(self.store.set, f"beat/{self.rank}", "0")
        self._call(self.store.set, f"left/{self.rank}", "")
        self._call(self.store.set, f"who/{self.rank}", json.dumps(me))

    def _join(self, where: str, join_s: float) -> None:
        """Every worker's identity, or exit 5 naming those that never came."""
        start = time.monotonic()
        keys = [f"who/{r}" for r in self.peers]
        while keys and not self._call(self.store.check, keys):
            if time.monotonic() - start > join_s:
                missing = [r for r in self.peers if not self._has(f"who/{r}")]
                raise EnvironmentFailure(
                    f"workers {missing} did not join within {join_s:.0f} s", where=self.addr
                )
            time.sleep(POLL_S)
        self._know_peers(where)

    def _know_peers(self, where: str) -> None:
        for r, p in self.peers.items():
            who = json.loads(self._call(self.store.get, f"who/{r}"))
            p.pid, p.host, p.local = int(who["pid"]), str(who["host"]), who["where"] == where
            p.seen = time.monotonic()
        self.joined = True

    def _wait(self, key: str, rank: int = 0) -> bytes:
        """``key``'s value once set, while worker ``rank`` (who sets it) is alive."""
        last = 0.0
        while True:
            if self._has(key):
                return bytes(self._call(self.store.get, key))
            if time.monotonic() - last >= self.beat_s:
                last = time.monotonic()
                try:
                    self._check([rank])
                except _PeerLost as lost:
                    self._set_lost(lost)
                    raise EnvironmentFailure(self._lost_line()) from None
            time.sleep(POLL_S)

    def _check(self, ranks: Sequence[int]) -> None:
        """Raise _PeerLost for the first of ``ranks`` that left early or is gone."""
        keys = [f"beat/{r}" for r in ranks] + [f"left/{r}" for r in ranks]
        values = self._call(self.store.multi_get, keys)
        now = time.monotonic()
        for i, r in enumerate(ranks):
            p = self.peers[r]
            beats, left = values[i], values[len(ranks) + i]
            if left:
                raise _PeerLost(r, f"stopped ({left.decode(errors='replace')}; see its error)")
            if beats != p.beats:
                p.beats, p.seen = beats, now
            if p.local and _pid_gone(p.pid):
                raise _PeerLost(r, f"died (pid {p.pid} on {p.host})")
            if now - p.seen > self.timeout:
                raise _PeerLost(
                    r,
                    f"stopped responding (no heartbeat from {p.host} for {now - p.seen:.0f} s; "
                    f"{TIMEOUT_ENV}={self.timeout:g})",
                )

    def _linger(self) -> None:
        """Worker 0 hosts the store: keep it up until every live peer has left."""
        pending = set(self.peers)
        while pending:
            for r in sorted(pending):
                try:
                    self._check([r])
                except (_PeerLost, _StoreLost):
                    pending.discard(r)  # left (or gone): done with the store
            if pending:
                time.sleep(POLL_S)

    def _heartbeat(self) -> None:
        """Bump this worker's counter; while the main thread writes, watch the others."""
        n = 0
        while not self.stop.wait(self.beat_s):
            n += 1
            try:
                self._call(self.store.set, f"beat/{self.rank}", str(n))
                if self.working and self.lost is None:
                    self._check(list(self.peers))
            except _PeerLost as lost:
                self._interrupt(lost)
            except _StoreLost:
                if self.rank != 0:
                    self._interrupt(_PeerLost(0, _store_gone(self.addr)))
                return

    def _interrupt(self, lost: _PeerLost) -> None:
        with self.lock:
            if self.working and self.lost is None and self.interruptible:
                self._set_lost(lost)
                _thread.interrupt_main(signal.SIGINT)  # stop writing, as Ctrl-C does

    @contextmanager
    def _working(self) -> Iterator[None]:
        self.working = True
        try:
            yield
        finally:
            with self.lock:
                self.working = False

    def explain(self, exc: BaseException) -> BaseException:
        """An interrupt that a lost peer explains (ours, or torchrun's SIGTERM) -> exit 5."""
        if not isinstance(exc, (Interrupted, KeyboardInterrupt)):
            return exc
        if self.lost is None:
            try:
                if not self.joined:  # interrupted while joining: every peer may have come
                    if not self._call(self.store.check, [f"who/{r}" for r in self.peers]):
                        return exc
                    self._know_peers(self.where)
                self._check(list(self.peers))
            except _PeerLost as found:
                self._set_lost(found)
            except _StoreLost:
                if self.rank == 0:
                    return exc
                self._set_lost(_PeerLost(0, _store_gone(self.addr)))
        if self.lost is None:
            return exc
        return EnvironmentFailure(self._lost_line())

    def _lost_line(self, what: str | None = None) -> str:
        """``worker 0 died (pid 7 on h) while writing; nothing was committed (...)``."""
        if "commit" in self.phase:
            then = "the output may or may not be in place: inspect it, or rerun with --force"
        else:
            then = "nothing was committed (a rerun removes the staging directory)"
        return f"{what or self.lost} {self.phase}; {then}"

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a store step; store loss and explained interrupts become one-line errors."""
        try:
            return fn(*args)
        except _StoreLost as exc:
            self._leave("lost the store")
            if self.rank != 0 and not self.agent_store:
                self._set_lost(_PeerLost(0, _store_gone(self.addr)))
                raise EnvironmentFailure(self._lost_line()) from None
            raise EnvironmentFailure(
                self._lost_line(f"lost the rendezvous store at {self.addr} ({exc})")
            ) from None
        except (Interrupted, KeyboardInterrupt) as exc:
            err = self.explain(exc)
            self._leave(str(self.lost) if self.lost else "interrupted")
            raise err from None
        except EnvironmentFailure:
            self._leave(str(self.lost) if self.lost else "failed")
            raise

    def _set_lost(self, lost: _PeerLost) -> None:
        if self.lost is None:
            self.lost, self.lost_at = lost, time.monotonic()

    def _has(self, key: str) -> bool:
        return bool(self._call(self.store.check, [key]))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            try:
                return fn(*args)
            except RuntimeError as exc:  # DistNetworkError, DistStoreError: the store is gone
                raise _StoreLost(_first_line(exc)) from None

    def _leave(self, reason: str) -> None:
        if self.left:
            return
        self.left = True
        try:
            self._call(self.store.set, f"left/{self.rank}", reason or "left")
        except _StoreLost:
            pass

    def _on_term(self, signum: int, frame: Any) -> None:
        """SIGTERM: ignored once a lost peer is being reported (torchrun stops the survivors
        right after one dies, then SIGKILLs after 30 s; the exit code and line stay ours), else
        the previous handler."""
        if self.lost is not None and time.monotonic() - self.lost_at < TERM_GRACE_S:
            return
        prev = self.prev_term
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _at_exit(self) -> None:
        """A worker that exits without ``done`` (an error after the gather) still says so."""
        if self.lost is not None and self.interruptible:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # also while the interpreter exits
        if not self.stop.is_set():
            self._leave("exited before the run finished")
            self.close()
        self._stop()


def _store_gone(addr: str) -> str:
    return f"is gone or stopped answering (it hosts the rendezvous store at {addr})"


__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "Group", "ShardctlError", "dist_timeout"]
