"""Cold-process wall time of ``shardctl plan`` on the 405B manifest, and of the layout search
over 1,024 GPUs (targets: ≤ 0.3 s and ≤ 2 s). Medians over ``--runs`` runs.

Each figure is a fresh ``python -m shardctl`` process (imports included).

    python bench/plan_speed.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _compiled import byte_compile

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "manifests" / "llama-3.1-405b-tp8-pp2.yaml"


def _time(cmd: list[str]) -> tuple[float, bool]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True)
    return time.perf_counter() - t0, proc.returncode in (0, 1)


def _median(cmd: list[str], runs: int) -> float | None:
    times = []
    for _ in range(runs):
        t, ok = _time(cmd)
        if not ok:
            return None
        times.append(t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    byte_compile(ROOT)
    py = sys.executable
    rows = [
        (
            "plan 405B TP8×PP2 (CLI --json)",
            [py, "-m", "shardctl", "plan", str(MANIFEST), "--json"],
            0.3,
        ),
        (
            "search 405B over 1,024 GPUs (CLI)",
            [py, "-m", "shardctl", "plan", str(MANIFEST), "--search", "--gpus", "1024", "--json"],
            2.0,
        ),
    ]
    baseline = _median([py, "-c", "pass"], args.runs) or 0.0
    print(f"python start-up alone: {baseline * 1e3:.0f} ms (median of {args.runs})")
    for name, cli, target in rows:
        t = _median(cli, args.runs)
        assert t is not None, f"{name}: the command failed"
        verdict = "ok" if t <= target else "OVER"
        print(f"{name:<40} {t * 1e3:7.0f} ms  target ≤ {target:.1f} s  {verdict}")


if __name__ == "__main__":
    main()
