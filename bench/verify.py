"""Bench: the bitwise level against a plain read of the same bytes (``cat SRC DST > /dev/null``).

    python bench/verify.py [--size-mb 500] [--tp 4] [--runs 3] [--work DIR]

Builds a llama-shaped checkpoint with transformers' ``save_pretrained`` (random bf16 weights),
reshards it to ``tp`` ranks with shardctl, then alternates, warm cache: ``cat`` of every SRC
and DST safetensors file, and ``verify --level bitwise`` (structure + bitwise; the bitwise
level's own time is what is compared). Prints wall times, bytes and the ratio
``cat / bitwise`` — the goal is >= 0.8 (bitwise at least 80 % of the speed of reading).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "_work")
    args = ap.parse_args()
    from shardctl.layout.types import Mesh
    from shardctl.reshard.api import reshard
    from shardctl.verify.api import verify

    args.work.mkdir(parents=True, exist_ok=True)
    src = _checkpoint(args.work, args.size_mb)
    dst = args.work / f"llama-{args.size_mb}mb-tp{args.tp}"
    if not dst.exists():
        reshard(src, dst, mesh=Mesh(tp=args.tp))
    files = sorted(src.glob("*.safetensors")) + sorted(dst.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    cat = shutil.which("cat") or "cat"
    rows = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run([cat, *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        t_cat = time.perf_counter() - t0
        result = verify(src, dst, level="bitwise", hashes=False)
        assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
        bw = result.level_result("bitwise")
        hashed = verify(src, dst, level="bitwise").level_result("bitwise").seconds
        rows.append((t_cat, bw.seconds, bw.figures["src_bytes"] + bw.figures["dst_bytes"], hashed))
    print(
        f"{'run':>3} {'cat s':>7} {'bitwise s':>9} {'+hash s':>8} {'MB':>7} "
        f"{'cat MB/s':>8} {'bitwise MB/s':>12} {'ratio':>5} {'w/ hash':>7}"
    )
    for i, (tc, tb, nb, th) in enumerate(rows):
        print(
            f"{i:>3} {tc:7.3f} {tb:9.3f} {th:8.3f} {nb / 1e6:7.1f} {total / tc / 1e6:8.0f} "
            f"{nb / tb / 1e6:12.0f} {tc / tb * nb / total:5.2f} {tc / th * nb / total:7.2f}"
        )
    best_cat = min(r[0] for r in rows)
    best_bw = min(r[1] for r in rows)
    best_h = min(r[3] for r in rows)
    scale = rows[0][2] / total  # bytes bitwise reads / bytes cat reads (1.0: same bytes)
    print(
        f"best: cat {best_cat:.3f} s for {total / 1e6:.0f} MB; bitwise {best_bw:.3f} s "
        f"(speed ratio {best_cat / best_bw * scale:.2f}, goal >= 0.8); with record hashes "
        f"{best_h:.3f} s (ratio {best_cat / best_h * scale:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
