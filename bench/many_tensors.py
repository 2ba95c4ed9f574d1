"""Many-tensor MoE checkpoints: reshard, merge and verify against cp, parallel cp and cat.

    python bench/many_tensors.py --src /work/bench-scale/mix12k --work /work/bench-scale/w
    python bench/many_tensors.py --src DIR --rounds 3 --tp 2 --ep 2
    python bench/many_tensors.py --src DIR --work DIR --baseline ../main   # before/after

Build the checkpoints first with ``bench/many_tensors_build.py`` (transformers'
``save_pretrained``, random bf16): ``DIR 256 16 256 512`` gives 12,403 tensors / 3.1 GB,
``DIR 1000 30 128 64`` gives 90,213 tensors / 1.5 GB.

Page cache warm (one untimed pass of everything first). Each round runs, in this order and on
the same filesystem: ``cp -r SRC`` (plain, and durable: ``&& sync`` of the copy, as shardctl
fsyncs what it writes), ``xargs -P <cores> cp`` of SRC's files, shardctl reshard ``--tp --ep``,
``cp -r`` of the split output (plain and durable), merge back ``--format hf``, ``cat`` of SRC
and the split output, ``verify --level bitwise``, ``inspect SRC``, and ``plan SRC`` of the same
mesh on an H100 (exit 1, "does not fit", counts as a run: the figure is the time to the
verdict). Every command runs under ``/usr/bin/time`` (wall, peak RSS, kernel CPU). Prints
per-command medians and the ratios the issue asks for: reshard and merge to ``cp -r`` of what
they read and of what they write (the two differ where an ep split replicates the dense
tensors), reshard to a parallel cp, verify to ``cat`` of both trees, inspect and plan to their
0.5 s goal. The checkouts are byte-compiled first (``_compiled``), as a pip install leaves
them.

The kernel CPU column is there for the writing steps. On a VM that returns freed guest memory
to its host at once (Firecracker's free page reporting, ``page_reporting.min_free_ms=0`` on
the machine of session 50), every page a step writes to tmpfs may fault in from the host. The
same ``cp -r`` of a 2.9 GB split then took from 1.5 s to 11 s, nearly all of it kernel time,
depending on what the run before had freed. A write step's wall time there measures the host
as much as the tool: compare its sys column with the copy's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from _compiled import byte_compile

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd: str, log: Path, cwd: Path = REPO) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, kernel CPU seconds) of ``sh -c cmd`` under /usr/bin/time,
    run in ``cwd``."""
    p = subprocess.run(
        ["/usr/bin/time", "-o", str(log), "-f", "%e %M %S", "sh", "-c", cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        print(f"FAILED ({p.returncode}): {cmd}\n{p.stderr[-1500:]}", file=sys.stderr)
        return float("nan"), float("nan"), float("nan")
    wall, rss, kernel = log.read_text().split()[-3:]
    return float(wall), float(rss) / 1024, float(kernel)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of shardctl (say main): its reshard, merge, verify and inspect "
        "run too, right after this checkout's, each round (before/after, same conditions)",
    )
    a = ap.parse_args()
    byte_compile(REPO, *([a.baseline.resolve()] if a.baseline is not None else []))
    src, w = a.src.resolve(), a.work.resolve()
    w.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    sh = f"{PY} -m shardctl"
    mesh = f"--tp {a.tp} --ep {a.ep}"
    names = ("split", "merged", "cp", "pcp", "cpsplit", "dcp", "dcpsplit")
    split, merged, cp1, cp2, cp3, dcp1, dcp3 = (w / n for n in names)
    steps = {
        "cp -r src": (f"cp -r {src} {cp1}", [cp1]),
        # durable: shardctl fsyncs every file it writes (a no-op on tmpfs, not on disk)
        "cp -r src + sync": (f"cp -r {src} {dcp1} && sync {dcp1}/* {dcp1}", [dcp1]),
        f"xargs -P{cores} cp src": (
            f"mkdir {cp2} && ls {src}/* | xargs -P{cores} -I{{}} cp {{}} {cp2}/",
            [cp2],
        ),
        "reshard": (f"{sh} reshard {src} {split} --tp {a.tp} --ep {a.ep}", [split]),
        "cp -r split": (f"cp -r {split} {cp3}", [cp3]),
        "cp -r split + sync": (f"cp -r {split} {dcp3} && sync {dcp3}/* {dcp3}", [dcp3]),
        "merge": (f"{sh} reshard {split} {merged} --format hf", [merged]),
        "cat src+split": (f"cat {src}/*.safetensors {split}/*.safetensors > /dev/null", []),
        "verify bitwise": (f"{sh} verify {src} {split} --level bitwise > /dev/null", []),
        "inspect src": (f"{sh} inspect {src} > /dev/null", []),
        "plan src": (f"{sh} plan {src} {mesh} --gpu h100-sxm > /dev/null; [ $? -le 1 ]", []),
    }
    if a.baseline is not None:
        base = a.baseline.resolve()
        bsh = f"cd {base} && {PY} -m shardctl"
        bsplit, bmerged = w / "split-baseline", w / "merged-baseline"
        shardctl_steps = {
            "reshard": f"{bsh} reshard {src} {bsplit} --tp {a.tp} --ep {a.ep}",
            "merge": f"{bsh} reshard {bsplit} {bmerged} --format hf",
            "verify bitwise": f"{bsh} verify {src} {bsplit} --level bitwise > /dev/null",
            "inspect src": f"{bsh} inspect {src} > /dev/null",
            "plan src": f"{bsh} plan {src} {mesh} --gpu h100-sxm > /dev/null; [ $? -le 1 ]",
        }
        interleaved = {}
        for name, step in steps.items():
            interleaved[name] = step
            if name in shardctl_steps:
                outs = {"reshard": [bsplit], "merge": [bmerged]}.get(name, [])
                interleaved[f"{name} (baseline)"] = (shardctl_steps[name], outs)
        steps = interleaved
        extra = [bsplit, bmerged]
    else:
        extra = []
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in steps}
    for r in range(a.rounds + 1):  # round 0: warm-up, not counted
        for d in (cp1, cp2, cp3, dcp1, dcp3, merged, split, *extra):
            shutil.rmtree(d, ignore_errors=True)
        for name, (cmd, outs) in steps.items():
            copies = ("cp -r src", "cp -r src + sync", f"xargs -P{cores} cp src")
            if name in copies:
                for d in outs:
                    shutil.rmtree(d, ignore_errors=True)
            got = run(cmd, w / ".time")
            if r:
                times[name].append(got)
            print(
                f"round {r} {name:22s} {got[0]:7.2f} s {got[1]:7.1f} MiB  sys {got[2]:5.2f} s",
                flush=True,
            )
            if name in (*copies, "cp -r split", "cp -r split + sync"):
                for d in outs:
                    shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(x[0] for x in v) for k, v in times.items()}
    rss = {k: max(x[1] for x in v) for k, v in times.items()}
    kernel = {k: statistics.median(x[2] for x in v) for k, v in times.items()}
    print(f"\n{'step':24s} {'median s':>9s} {'peak MiB':>9s} {'sys s':>6s}  ratio")
    pc = f"xargs -P{cores} cp src"
    # Each step against copies of what it reads and of what it writes: an ep split replicates
    # the dense tensors on every ep rank (DeepSeek-V3 FP8 at --ep 8: 1.6 GB in, 2.9 GB out), so
    # reshard writes the split's bytes and merge the source's.
    ratio = {
        "reshard": f"{med['reshard'] / med['cp -r src']:.2f}× cp -r, "
        f"{med['reshard'] / med[pc]:.2f}× parallel cp, "
        f"{med['reshard'] / med['cp -r src + sync']:.2f}× cp -r + sync; "
        f"{med['reshard'] / med['cp -r split']:.2f}× cp -r of its output",
        "merge": f"{med['merge'] / med['cp -r split']:.2f}× cp -r (split), "
        f"{med['merge'] / med['cp -r split + sync']:.2f}× cp -r + sync; "
        f"{med['merge'] / med['cp -r src']:.2f}× cp -r of its output",
        "verify bitwise": f"{med['verify bitwise'] / med['cat src+split']:.2f}× cat",
        # the goal for both at ~90,000 tensors: 0.5 s, imports included
        "inspect src": f"{med['inspect src'] / 0.5:.2f}× the 0.5 s goal",
        "plan src": f"{med['plan src'] / 0.5:.2f}× the 0.5 s goal",
    }
    if a.baseline is not None:
        ref = {"reshard": "cp -r src", "merge": "cp -r split", "verify bitwise": "cat src+split"}
        for k, v in list(ratio.items()):
            if k not in ref:
                continue
            b = f"{k} (baseline)"
            ratio[b] = f"{med[b] / med[ref[k]]:.2f}× (baseline), this checkout {v.split(',')[0]}"
    for k in steps:
        print(f"{k:24s} {med[k]:9.2f} {rss[k]:9.1f} {kernel[k]:6.2f}  {ratio.get(k, '')}")


if __name__ == "__main__":
    main()
