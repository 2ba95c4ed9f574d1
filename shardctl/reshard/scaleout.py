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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardctl.checkpoint.plan_files import OutputFile
from shardctl.errors import EnvironmentFailure, Interrupted
from shardctl.reshard.peers import (
    DEFAULT_TIMEOUT_S,
    POLL_S,
    TIMEOUT_ENV,
    PeerLost,
    Peers,
    StoreLost,
    dist_timeout,
    first_line,
    store_gone,
    where_am_i,
)

JOIN_TIMEOUT_S = 300.0  # workers of one run may start this far apart (slow imports, queues)
TERM_GRACE_S = 30.0  # after a peer is lost, SIGTERMs are ignored this long while we clean up
TERM_LOOKS = 10  # torchrun's SIGTERM: look for the lost peer this many times, POLL_S apart


def share_of(files: list[OutputFile], world: int, rank: int) -> list[OutputFile]:
    """Worker ``rank``'s files: largest first, each to the least-loaded worker (greedy LPT)."""
    loads = [0] * world
    owner: dict[int, int] = {}
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        k = loads.index(min(loads))
        owner[i] = k
        loads[k] += files[i].size
    return [f for i, f in enumerate(files) if owner[i] == rank]


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
                f"cannot join the other workers at {self.addr}: {first_line(exc)}",
                hint="check MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (torchrun sets them)",
            ) from None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.link = Peers(
            PrefixStore(f"shardctl/{restart}", store),
            self.rank,
            self.world,
            self.timeout,
            self.addr,
        )
        self.lost: PeerLost | None = None  # set once a peer is found lost
        self.lost_at = 0.0
        self.working = False
        self.interruptible = threading.current_thread() is threading.main_thread()
        self.phase = "while joining"  # for messages: what the run was doing
        self.stop = threading.Event()
        self.where = where_am_i()
        me = {"pid": os.getpid(), "host": socket.gethostname(), "where": self.where}
        self._guard(self.link.publish, me)
        self.prev_term: Any = None
        if self.interruptible:  # torchrun's SIGTERM, once a peer is known lost, changes nothing
            self.prev_term = signal.signal(signal.SIGTERM, self._on_term)
        self.thread = threading.Thread(target=self._heartbeat, name="shardctl-heartbeat")
        self.thread.daemon = True
        self.thread.start()
        atexit.register(self._at_exit)
        self._guard(self.link.join, me["where"], join_s)
        # From now on a store call that takes longer than the timeout means its host (worker
        # 0, or torchrun's agent) stopped answering: fail then, instead of after join_s.
        self._guard(self.link.call, store.set_timeout, timedelta(seconds=self.timeout))

    # ---- the protocol (called by shardctl.reshard.api) -----------------------------------

    def share(self, staging: Path | None) -> Path:
        """Worker 0's staging path to everyone (None: worker 0 failed before creating it)."""
        self.phase = "before staging the output"
        if self.rank == 0:
            self._guard(self.link.put, "staging", str(staging or ""))
            if staging is None:
                self.link.leave("it failed before staging the output")
                return Path()  # the caller re-raises its own error
            return staging
        value = self._guard(self._wait, "staging")
        if not value:
            self.link.leave("worker 0 failed")
            raise EnvironmentFailure("worker 0 failed before staging the output; see its error")
        return Path(value.decode())

    def mine(self, files: list[OutputFile]) -> list[OutputFile]:
        """This worker's share of the output files."""
        self.phase = "before writing"
        return share_of(files, self.world, self.rank)

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
                self.link.leave(str(self.lost))
                raise error from None
        got: dict[int, Any] = {}
        try:
            got[self.rank] = [digests, None if error is None else first_line(error)]
            self._guard(self.link.put, f"result/{self.rank}", json.dumps(got[self.rank]))
            for r in self.link.peers:
                got[r] = json.loads(self._guard(self._wait, f"result/{r}", r))
        except BaseException as exc:
            self.link.leave("failed while gathering")
            raise (error or self.explain(exc)) from None
        if error is not None:
            self.link.leave("failed while writing")
            raise error
        failed = sorted((r, msg) for r, (_, msg) in got.items() if msg is not None)
        if failed:
            self.link.leave("another worker failed")
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
            self._guard(self.link.put, "committed", "1")
        else:
            self._guard(self._wait, "committed")
        self.close()

    def close(self) -> None:
        """Leave the run; worker 0 first waits for the others (they may still read its store)."""
        self.link.leave("done")
        if self.rank == 0 and not self.agent_store:
            self.link.linger()
        self._stop()

    def _stop(self) -> None:
        # Joined, not left as a daemon: a thread inside a store call while the interpreter
        # exits makes the C++ runtime abort ("terminate called without an active exception").
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(self.timeout + 5)

    # ---- store, waits, liveness ----------------------------------------------------------

    def _wait(self, key: str, rank: int = 0) -> bytes:
        """``key``'s value once set, while worker ``rank`` (who sets it) is alive."""
        last = 0.0
        while True:
            if self.link.has(key):
                return self.link.get(key)
            if time.monotonic() - last >= self.beat_s:
                last = time.monotonic()
                try:
                    self.link.check([rank])
                except PeerLost as lost:
                    self._set_lost(lost)
                    raise EnvironmentFailure(self._lost_line()) from None
            time.sleep(POLL_S)

    def _heartbeat(self) -> None:
        """Bump this worker's counter; while the main thread writes, watch the others."""
        n = 0
        while not self.stop.wait(self.beat_s):
            n += 1
            try:
                self.link.beat(n)
                if self.working and self.lost is None:
                    self.link.check(list(self.link.peers))
            except PeerLost as lost:
                self._interrupt(lost)
            except StoreLost:
                if self.rank != 0:
                    self._interrupt(PeerLost(0, store_gone(self.addr)))
                return

    def _interrupt(self, lost: PeerLost) -> None:
        with self.link.lock:
            if self.working and self.lost is None and self.interruptible:
                self._set_lost(lost)
                _thread.interrupt_main(signal.SIGINT)  # stop writing, as Ctrl-C does

    @contextmanager
    def _working(self) -> Iterator[None]:
        self.working = True
        try:
            yield
        finally:
            with self.link.lock:
                self.working = False

    def explain(self, exc: BaseException) -> BaseException:
        """An interrupt that a lost peer explains (ours, or torchrun's SIGTERM) -> exit 5."""
        if not isinstance(exc, (Interrupted, KeyboardInterrupt)):
            return exc
        # torchrun's agent SIGTERMs the survivors once a worker has failed, and may do so
        # before this worker can see it (the pid still readable, a store reply in flight): look
        # again for up to TERM_LOOKS × POLL_S before calling it a plain signal (exit 143)
        sigterm = isinstance(exc, Interrupted) and exc.signum == signal.SIGTERM
        looks = TERM_LOOKS if self.agent_store and sigterm else 1
        for look in range(looks):
            if self.lost is not None:
                break
            if look:
                time.sleep(POLL_S)
            try:
                if not self.link.joined:  # interrupted while joining: every peer may have come
                    if not self.link.all_published():
                        continue
                    self.link.know_peers(self.where)
                self.link.check(list(self.link.peers))
            except PeerLost as found:
                self._set_lost(found)
            except StoreLost:
                if self.rank == 0:
                    return exc
                self._set_lost(PeerLost(0, store_gone(self.addr)))
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
        except StoreLost as exc:
            self.link.leave("lost the store")
            if self.rank != 0 and not self.agent_store:
                self._set_lost(PeerLost(0, store_gone(self.addr)))
                raise EnvironmentFailure(self._lost_line()) from None
            raise EnvironmentFailure(
                self._lost_line(f"lost the rendezvous store at {self.addr} ({exc})")
            ) from None
        except (Interrupted, KeyboardInterrupt) as exc:
            err = self.explain(exc)
            self.link.leave(str(self.lost) if self.lost else "interrupted")
            raise err from None
        except EnvironmentFailure:
            self.link.leave(str(self.lost) if self.lost else "failed")
            raise

    def _set_lost(self, lost: PeerLost) -> None:
        if self.lost is None:
            self.lost, self.lost_at = lost, time.monotonic()

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
            self.link.leave("exited before the run finished")
            self.close()
        self._stop()


__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "Group", "dist_timeout"]
