"""Bench: the bitwise level against a plain read of the same bytes (``cat SRC DST > /dev/null``).

    python bench/verify.py [--size-mb 500] [--tp 4] [--rounds 5] [--work DIR]
    python bench/verify.py --src bench/_work/big --dst /dev/shm/v/big-tp4 --rounds 7

Without ``--src``/``--dst`` it builds a llama-shaped checkpoint with transformers'
``save_pretrained`` (random bf16 weights) and reshards it to ``tp`` ranks with shardctl.

Warm cache (one untimed pass first). Each round alternates, so a noisy neighbour hits both
sides alike:

    cat SRC/*.safetensors DST/*.safetensors > /dev/null
    bitwise level, record hashes off  (fresh process; only the level is timed)
    cat ...
    bitwise level, record hashes on   (the default of ``shardctl verify``)

Prints per-round walls, then medians: wall, CPU (user+sys, all threads), peak RSS of the
verify process (and its RSS before the level: imports), bytes read, and the read-speed ratio
``cat wall / verify wall`` of each pair — the goal is >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _compiled import byte_compile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _checkpoint(work: Path, size_mb: int) -> Path:
    from tests._models import make_checkpoint

    src = work / f"llama-{size_mb}mb"
    if not (src / "config.json").exists():
        # hidden 1024, intermediate 2816, vocab 32000: ~12.6 M params per layer, 65.5 M embed+head
        layers = max(1, round((size_mb * 2**20 / 2 - 65.5e6) / 12.6e6))
        make_checkpoint(
            "llama",
            src,
            hidden_size=1024,
            intermediate_size=2816,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            num_hidden_layers=layers,
            max_shard_size="2GB",
        )
    return src


def _child(src: Path, dst: Path, hashes: bool) -> int:
    """One timed bitwise level in this (fresh) process; prints a JSON line."""
    from shardctl.checkpoint.source import open_source
    from shardctl.verify.bitwise.level import check_bitwise
    from shardctl.verify.dst import open_destination

    source, dest = open_source(src), open_destination(dst)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    level = check_bitwise(source, dest, hashes=hashes)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(
        json.dumps(
            {
                "ok": level.ok,
                "findings": [str(f) for f in level.findings[:3]],
                "wall": wall,
                "cpu": cpu,
                "rss_before_kb": rss_before,
                "rss_peak_kb": r1.ru_maxrss,
                "bytes": level.figures["src_bytes"] + level.figures["dst_bytes"],
                "threads": level.figures.get("threads", 1),
                "rehashed_files": level.figures.get("rehashed_files", 0),
            }
        )
    )
    return 0


def _verify(src: Path, dst: Path, hashes: bool) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(src), str(dst), "--hashes", str(int(hashes))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    data: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    if not data["ok"]:
        raise SystemExit(f"verify failed: {data['findings']}")
    return data


def _cat(files: list[Path]) -> dict[str, float]:
    cat = shutil.which("cat") or "cat"
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([cat, *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "_work")
    ap.add_argument("--src", type=Path)
    ap.add_argument("--dst", type=Path)
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--hashes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    byte_compile(ROOT)
    if args.child:
        return _child(*args.child, bool(args.hashes))
    if args.build:
        from shardctl.layout.types import Mesh
        from shardctl.reshard.api import reshard

        args.work.mkdir(parents=True, exist_ok=True)
        src = _checkpoint(args.work, args.size_mb)
        dst = args.work / f"llama-{args.size_mb}mb-tp{args.tp}"
        if not dst.exists():
            reshard(src, dst, mesh=Mesh(tp=args.tp))
        return 0
    if args.src and args.dst:
        src, dst = args.src, args.dst
    else:
        # built in a child: a verify process forked from one that held the model in memory
        # inherits its peak RSS (Linux keeps the high-water mark across exec)
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--build"], check=True)
        src = args.work / f"llama-{args.size_mb}mb"
        dst = args.work / f"llama-{args.size_mb}mb-tp{args.tp}"
    files = sorted(src.glob("*.safetensors")) + sorted(dst.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    print(
        f"SRC {src}  DST {dst}: {len(files)} files, {total / 1e9:.2f} GB; "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds"
    )
    _cat(files)  # warm the page cache
    _verify(src, dst, False)
    rows: list[tuple[dict[str, float], ...]] = []
    print(
        f"{'round':>5} {'cat s':>6} {'bitwise s':>9} {'ratio':>5} "
        f"{'cat s':>6} {'+hash s':>7} {'ratio':>5}"
    )
    for i in range(args.rounds):
        c1 = _cat(files)
        v1 = _verify(src, dst, False)
        c2 = _cat(files)
        v2 = _verify(src, dst, True)
        rows.append((c1, v1, c2, v2))
        print(
            f"{i:>5} {c1['wall']:6.3f} {v1['wall']:9.3f} {c1['wall'] / v1['wall']:5.2f} "
            f"{c2['wall']:6.3f} {v2['wall']:7.3f} {c2['wall'] / v2['wall']:5.2f}"
        )

    def med(j: int, key: str) -> float:
        return statistics.median(r[j][key] for r in rows)

    def ratio(c: int, v: int) -> float:
        return statistics.median(r[c]["wall"] / r[v]["wall"] for r in rows)

    print(f"medians over {args.rounds} rounds ({total / 1e9:.2f} GB through cat):")
    cat_wall = statistics.median([r[0]["wall"] for r in rows] + [r[2]["wall"] for r in rows])
    cat_cpu = statistics.median([r[0]["cpu"] for r in rows] + [r[2]["cpu"] for r in rows])
    print(
        f"  cat              wall {cat_wall:6.3f} s  cpu {cat_cpu:6.3f} s  "
        f"{total / cat_wall / 1e9:5.2f} GB/s"
    )
    for j, name, c in ((1, "bitwise", 0), (3, "bitwise+hashes", 2)):
        print(
            f"  {name:<16} wall {med(j, 'wall'):6.3f} s  cpu {med(j, 'cpu'):6.3f} s  "
            f"{med(j, 'bytes') / med(j, 'wall') / 1e9:5.2f} GB/s  "
            f"peak RSS {med(j, 'rss_peak_kb') / 1024:.0f} MiB "
            f"({med(j, 'rss_before_kb') / 1024:.0f} before the level)  "
            f"threads {rows[0][j]['threads']:.0f}  "
            f"read-speed ratio {ratio(c, j):.2f} (goal >= 0.8)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
