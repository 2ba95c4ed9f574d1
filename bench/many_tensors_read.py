"""The read side at many tensors: verify, inspect and plan against ``cat``, alternating.

    python bench/many_tensors_read.py --src /work/scratch/s14/ck90k --dst SPLIT --rounds 3
    python bench/many_tensors_read.py --src SRC --dst SPLIT --repo-b /path/to/other/checkout

``SRC`` is a checkpoint written by transformers (``bench/many_tensors_build.py``), ``SPLIT``
its ``shardctl reshard SRC SPLIT --tp 2 --ep 2`` (made once, never written here). Page cache
warm (one untimed pass first). Each round runs, in this order: ``cat`` of SRC and SPLIT to
/dev/null, ``verify SRC SPLIT --level bitwise``, ``verify --level structure``, ``inspect SRC``,
``plan SRC --tp 2 --ep 2 --gpu h100-sxm`` (``--mesh '--ep 8'`` for DeepSeek-V3 FP8, whose
experts do not split tp). Every command under ``/usr/bin/time``: wall, user+sys CPU and peak
RSS; medians printed, and verify's ratio to ``cat`` of both trees (issue 14: at most 1.5x;
inspect and plan at most 0.5 s). ``--repo-b`` runs the same commands from another checkout
right after each one (before/after figures on a busy machine, side by side).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from _compiled import byte_compile

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd: str, cwd: Path, log: Path) -> tuple[float, float, float]:
    """(wall s, user+sys s, peak RSS MiB) of ``sh -c cmd`` under /usr/bin/time."""
    p = subprocess.run(
        ["/usr/bin/time", "-o", str(log), "-f", "%e %U %S %M", "sh", "-c", cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        print(f"FAILED ({p.returncode}): {cmd}\n{p.stderr[-1500:]}", file=sys.stderr)
        return float("nan"), float("nan"), float("nan")
    wall, user, sys_, rss = log.read_text().split()[-4:]
    return float(wall), float(user) + float(sys_), float(rss) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--dst", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repo-b", type=Path, default=None, help="a second checkout to compare")
    ap.add_argument(
        "--mesh",
        default="--tp 2 --ep 2",
        help="plan's mesh flags (DeepSeek-V3 FP8, whose experts do not split tp: '--ep 8')",
    )
    ap.add_argument("--log", type=Path, default=Path("/tmp/many_tensors_read.time"))
    a = ap.parse_args()
    byte_compile(REPO)
    src, dst = a.src.resolve(), a.dst.resolve()
    sh = f"{PY} -m shardctl"
    steps = {
        "cat src+dst": f"cat {src}/* {dst}/* > /dev/null",
        "verify bitwise": f"{sh} verify {src} {dst} --level bitwise > /dev/null",
        "verify structure": f"{sh} verify {src} {dst} --level structure > /dev/null",
        "inspect src": f"{sh} inspect {src} > /dev/null",
        "plan src": f"{sh} plan {src} {a.mesh} --gpu h100-sxm > /dev/null",
    }
    repos = {"this": REPO} | ({"b": a.repo_b.resolve()} if a.repo_b else {})
    for cmd in steps.values():  # warm the page cache and the bytecode caches
        for repo in repos.values():
            run(cmd, repo, a.log)
    times: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in range(a.rounds):
        for name, cmd in steps.items():
            for label, repo in repos.items():
                if name.startswith("cat") and label != "this":
                    continue
                got = run(cmd, repo, a.log)
                times.setdefault((name, label), []).append(got)
                print(
                    f"round {r} {label:5} {name:17} {got[0]:7.2f} s  cpu {got[1]:7.2f} s  "
                    f"{got[2]:6.0f} MiB",
                    flush=True,
                )
    print("\nmedians (wall s, cpu s, peak RSS MiB):")
    med: dict[tuple[str, str], tuple[float, float, float]] = {}
    for key, rows in times.items():
        med[key] = tuple(statistics.median(x[i] for x in rows) for i in range(3))  # type: ignore[assignment]
        print(
            f"  {key[1]:5} {key[0]:17} {med[key][0]:7.2f}  {med[key][1]:7.2f}  {med[key][2]:6.0f}"
        )
    cat = med[("cat src+dst", "this")][0]
    for label in repos:
        bw = med[("verify bitwise", label)][0]
        print(f"{label}: verify bitwise / cat both trees = {bw / cat:.1f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
