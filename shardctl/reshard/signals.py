"""Signals during a run: SIGINT/SIGTERM raise ``Interrupted`` so cleanup runs; SIGXFSZ -> EFBIG."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardctl.errors import Interrupted


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted in the main thread (cleanup runs); SIGXFSZ -> EFBIG."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second interrupt during cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding RLIMIT_FSIZE: EFBIG, not death
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
