"""Reliability case E2 (random-kill smoke test) and E3 (a rerun removes the killed run's staging).

Named fault points (E1, ``test_reliability_reshard``) put a kill at each step of the writer;
this test kills ``python -m shardctl reshard SRC DST --tp 2`` at a uniformly random time in
``[0.5 T, 1.1 T]``, T being a measured run, so kills land in start-up, in the copy, around the
commit, and (sometimes) after a run that already finished. After each kill: the input is
byte-identical; DST is absent, or complete and ``shardctl verify --level bitwise`` exits 0; a
rerun succeeds and leaves nothing but DST in its parent (no staging, lock or ``.tmp`` file).

The seed is in every assertion message; ``SHARDCTL_E2_SEED=<n>`` replays a failing run.
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardctl.checkpoint import record
from shardctl.io.checksum import new_hash
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from tests._models import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 20


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~26 MB: the copy takes a visible share of a run that python's start-up otherwise fills.
    return make_checkpoint(
        "llama",
        tmp_path_factory.mktemp("e2") / "src",
        hidden_size=512,
        intermediate_size=1024,
        vocab_size=4096,
    )


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardctl", *args]


def timed_run(src: Path, dst: Path) -> float:
    t0 = time.monotonic()
    p = subprocess.run(
        cli("reshard", str(src), str(dst), "--tp", "2"), capture_output=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return time.monotonic() - t0


def check_complete(src: Path, dst: Path, ctx: str) -> None:
    """DST holds its record, every recorded file with its digest, and verifies bitwise."""
    rec = record.read(dst)
    names = {f.name for f in rec.files} | set(rec.raw["carried"]) | {record.RECORD_NAME}
    assert {p.name for p in dst.iterdir()} == names, ctx
    for f in rec.files:
        h = new_hash(rec.hash)
        h.update((dst / f.name).read_bytes())
        assert h.hexdigest() == f.digest, f"{ctx}: {f.name}"
    v = subprocess.run(
        cli("verify", str(src), str(dst), "--level", "bitwise", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert v.returncode == 0, f"{ctx}: verify exit {v.returncode}: {v.stderr[-2000:]}"


@pytest.mark.slow
def test_random_kill(src: Path, tmp_path: Path) -> None:
    seed = int(os.environ.get("SHARDCTL_E2_SEED") or secrets.randbits(32))
    rng = random.Random(seed)
    before = digests(src)
    # T: the faster of two runs (the first also warms the page cache)
    t = min(timed_run(src, tmp_path / f"warm{i}") for i in range(2))
    outcomes: dict[str, int] = {}
    for i in range(ITERATIONS):
        parent = tmp_path / f"run{i:02d}"
        parent.mkdir()
        dst = parent / "out"
        delay = rng.uniform(0.5 * t, 1.1 * t)
        p = subprocess.Popen(
            cli("reshard", str(src), str(dst), "--tp", "2"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, err = p.communicate(timeout=delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            _, err = p.communicate(timeout=60)
        ctx = (
            f"seed={seed} (SHARDCTL_E2_SEED) iteration={i} kill at {delay:.3f}s of "
            f"T={t:.3f}s, exit {p.returncode}"
        )
        assert p.returncode in (0, -signal.SIGKILL), f"{ctx}: {err}"
        assert digests(src) == before, f"{ctx}: the input changed"
        if os.path.lexists(dst):
            outcome = "complete"
            check_complete(src, dst, ctx)
        else:
            assert p.returncode != 0, f"{ctx}: exit 0 but no output"
            left = sorted(q.name for q in parent.iterdir())
            outcome = "staged" if any("staging" in n for n in left) else "absent"
        for key in (outcome, "killed" if p.returncode else "finished"):
            outcomes[key] = outcomes.get(key, 0) + 1
        # E3: the rerun takes the lock, removes the dead run's staging and lock file, commits
        reshard(src, dst, mesh=Mesh(tp=2), force=dst.exists())
        assert sorted(q.name for q in parent.iterdir()) == ["out"], f"{ctx}: leftovers"
        rec = record.read(dst)
        assert {q.name for q in dst.iterdir()} == {f.name for f in rec.files} | set(
            rec.raw["carried"]
        ) | {record.RECORD_NAME}, ctx
    assert digests(src) == before, f"seed={seed}: the input changed"
    # The test's own sanity: kills must land before runs end (else T was mismeasured).
    assert outcomes.get("killed", 0) > 0, f"seed={seed} T={t:.3f}s outcomes={outcomes}"
