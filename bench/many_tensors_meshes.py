"""Peak memory of every step at many tensors, mesh by mesh: the 256 MiB promise at tp 8.

    python bench/many_tensors_meshes.py --src DIR --work DIR
    python bench/many_tensors_meshes.py --src DIR --work DIR --baseline ../old-checkout

A tp-8 split of 100,000 tensors is 800,000 shard rows, four times a tp-2 × ep-2 split's, and
the per-row columns (record, verify's walk, the tiling check) are what grows. For each mesh
(``--meshes``, default tp2·ep2, tp4·ep2, tp8, tp2·ep8) this runs, on the same filesystem:
reshard SRC → A, ``verify --level bitwise`` and ``--level structure`` SRC against A, merge A
back ``--format hf``, any-to-any A → ``--to`` (default tp4·ep4), and verify A against that
(a sharded SRC). Every command runs under ``/usr/bin/time``: wall seconds and peak RSS in MiB,
marked ``!`` above 256 MiB. ``cp -r SRC`` and ``cat`` of SRC are timed once for scale. With
``--baseline`` each step also runs from that checkout, right after this one's.

Build the checkpoint with ``bench/many_tensors_build.py DIR 1008 33 128 64`` (100,026
tensors, 1.6 GB, transformers' ``save_pretrained``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from _compiled import byte_compile
from many_tensors import run

REPO = Path(__file__).resolve().parents[1]
LIMIT_MIB = 256


def mesh_args(text: str) -> list[str]:
    """``tp4ep2`` -> ``--tp 4 --ep 2``."""
    out: list[str] = []
    rest = text
    for axis in ("tp", "pp", "ep"):
        if rest.startswith(axis):
            digits = ""
            rest = rest[len(axis) :]
            while rest[:1].isdigit():
                digits, rest = digits + rest[0], rest[1:]
            out += [f"--{axis}", digits]
    if rest or not out:
        raise SystemExit(f"mesh {text!r}: expected e.g. tp8, tp2ep2, tp2pp2ep4")
    return out


def _steps(src: Path, mesh: list[str], to: list[str]) -> list[tuple[str, Any]]:
    """(label, work dir -> the shardctl arguments) of each step, in order."""
    s = str(src)
    bitwise, structure = ["--level", "bitwise"], ["--level", "structure"]
    return [
        ("reshard", lambda w: ["reshard", s, f"{w}/a", *mesh]),
        ("verify bitwise", lambda w: ["verify", s, f"{w}/a", *bitwise]),
        ("verify structure", lambda w: ["verify", s, f"{w}/a", *structure]),
        ("merge --format hf", lambda w: ["reshard", f"{w}/a", f"{w}/m", "--format", "hf"]),
        ("any-to-any", lambda w: ["reshard", f"{w}/a", f"{w}/b", *to]),
        ("verify A vs any-to-any", lambda w: ["verify", f"{w}/a", f"{w}/b", *bitwise]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--meshes", default="tp2ep2,tp4ep2,tp8,tp2ep8")
    ap.add_argument("--to", default="tp4ep4", help="the any-to-any target mesh")
    ap.add_argument("--baseline", type=Path, help="another checkout, run step by step after")
    args = ap.parse_args()
    checkouts = [("now", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    byte_compile(*(root for _, root in checkouts))
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "time.log"
    copy = args.work / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    cp_s, _, _ = run(shlex.join(["cp", "-r", str(args.src), str(copy)]), log)
    shutil.rmtree(copy, ignore_errors=True)
    files = sorted(str(p) for p in args.src.glob("*.safetensors"))
    cat_s, _, _ = run(shlex.join(["cat", *files]) + " > /dev/null", log)
    print(f"SRC {args.src}: cp -r {cp_s:.2f} s, cat {cat_s:.2f} s (limit {LIMIT_MIB} MiB)")
    py = [sys.executable, "-m", "shardctl"]
    for mesh in args.meshes.split(","):
        print(f"\n== {mesh} (then any-to-any to {args.to})")
        print(f"{'step':<22}" + "".join(f"{name:>22}" for name, _ in checkouts))
        for name, _root in checkouts:
            shutil.rmtree(args.work / name, ignore_errors=True)
            (args.work / name).mkdir()
        steps = _steps(args.src, mesh_args(mesh), mesh_args(args.to))
        for label, cmd in steps:
            cells = []
            for name, root in checkouts:
                wall, rss, _ = run(shlex.join([*py, *cmd(str(args.work / name))]), log, cwd=root)
                mark = "!" if rss > LIMIT_MIB else " "
                cells.append(f"{wall:6.2f} s {rss:6.1f} MiB{mark}")
            print(f"{label:<22}" + "".join(f"{c:>22}" for c in cells))
        for name, _ in checkouts:
            shutil.rmtree(args.work / name, ignore_errors=True)


if __name__ == "__main__":
    main()
