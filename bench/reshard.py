"""Reshard speed and memory against the physical limit and the peers, side by side.

    python bench/reshard.py                  # ~4.2 GB and ~0.67 GB Llama-like, disk and /dev/shm
    python bench/reshard.py --only small --rounds 1 --no-peers      # a quick look
    python bench/reshard.py --disk /work/me/b --shm /dev/shm/me/b   # own work dirs

Checkpoints are written by transformers' ``save_pretrained`` (meta-device init, then filled), in
``bench/_work`` (disk) and copied to ``/dev/shm/shardctl-bench`` (tmpfs). Per location and size,
runs alternate round by round: ``cp -r``, shardctl split TP=4, merge back to HF, TP4→TP2; then the
peers once each. On disk every command is followed by ``sync DST/*`` (a durable copy; shardctl
fsyncs anyway). Each command runs under ``/usr/bin/time``: wall, user+sys CPU, peak RSS (for
torchrun'd DCP: the largest single process). Ratios are to ``cp -r`` in the same location.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _compiled import byte_compile

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "big": (3072, 8192, 19, 24, 8, 32000),  # ≈4.22 GB BF16
    "small": (2048, 5632, 4, 16, 16, 32000),  # ≈0.67 GB BF16
}

BUILD = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
h, i, n, a, kv, v = map(int, sys.argv[2:8])
cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=a,
                  num_key_value_heads=kv, vocab_size=v, tie_word_embeddings=False)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.uniform_(-0.02, 0.02)
model.save_pretrained(sys.argv[1], max_shard_size="2GB")
"""


def build(path: Path, size: str) -> None:
    if (path / "config.json").exists():
        return
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [PY, "-c", BUILD, str(tmp), *map(str, SIZES[size])], check=True, capture_output=True
    )
    tmp.rename(path)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(cmd: str, dst: Path, durable: bool) -> dict[str, float]:
    """Run ``cmd`` (shell) under /usr/bin/time; remove ``dst`` afterwards."""
    shutil.rmtree(dst, ignore_errors=True)
    full = f"{cmd} && sync {dst}/*" if durable else cmd
    out = dst.parent / ".time"
    t0 = time.monotonic()
    p = subprocess.run(
        ["/usr/bin/time", "-o", str(out), "-f", "%e %U %S %M", "sh", "-c", full],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if p.returncode != 0:
        print(f"  FAILED ({p.returncode}): {cmd}\n{p.stderr[-2000:]}", file=sys.stderr)
        return {"wall": float("nan"), "cpu": float("nan"), "rss": float("nan")}
    _, user, sys_, rss = out.read_text().split()[-4:]
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    return {"wall": wall, "cpu": float(user) + float(sys_), "rss": float(rss) / 1024}


def run_location(
    loc: str, root: Path, size: str, rounds: int, peers: bool
) -> list[tuple[str, ...]]:
    durable = loc == "disk"
    src = root / size
    keep = root / f"{size}-tp4"
    out = root / "out"
    sh = f"{PY} -m shardctl reshard"
    if not keep.exists():
        subprocess.run(f"{sh} {src} {keep} --tp 4 --quiet", shell=True, check=True, cwd=REPO)
    ops = {
        "cp -r": f"cp -r {src} {out}",
        "shardctl split TP=4": f"{sh} {src} {out} --tp 4 --quiet",
        "shardctl merge TP4→HF": f"{sh} {keep} {out} --format hf --quiet",
        "shardctl TP4→TP2": f"{sh} {keep} {out} --tp 2 --quiet",
    }
    peer_ops = {
        "naive load→chunk→save TP=4": f"{PY} bench/peers.py naive-split {src} {out} 4",
        "streaming get_slice TP=4": f"{PY} bench/peers.py stream-split {src} {out} 4",
        "naive merge TP4→HF": f"{PY} bench/peers.py naive-merge {keep} {out}",
        "torch DCP TP=4 (4 procs)": f"{PY} -m torch.distributed.run --nproc-per-node 4 "
        f"bench/peers.py dcp-split {src} {out} 4",
        "transformers save_pretrained": f"{PY} bench/peers.py hf-resave {src} {out}",
    }
    results: dict[str, list[dict[str, float]]] = {k: [] for k in ops}
    measure(ops["cp -r"], out, durable)  # warm-up: page cache and tmpfs page allocation
    for _ in range(rounds):
        for name, cmd in ops.items():
            results[name].append(measure(cmd, out, durable))
    if peers:
        for name, cmd in peer_ops.items():
            results[name] = [measure(cmd, out, durable)]
    base = statistics.median(r["wall"] for r in results["cp -r"])
    rows = []
    gb = du(src) / 1e9
    for name, rs in results.items():
        wall = statistics.median(r["wall"] for r in rs)
        cpu = statistics.median(r["cpu"] for r in rs)
        rss = max(r["rss"] for r in rs)
        each = "/".join(f"{r['wall']:.2f}" for r in rs)
        rows.append(
            (
                loc,
                f"{gb:.2f} GB",
                name,
                f"{wall:.2f}",
                each,
                f"{cpu:.2f}",
                f"{rss:.0f}",
                f"{wall / base:.2f}×",
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=list(SIZES), action="append")
    ap.add_argument("--where", choices=["disk", "shm"], action="append")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peers-on", choices=["big", "small", "both"], default="both")
    # separate work dirs, so that two people benchmarking at once do not delete each other's
    ap.add_argument("--disk", type=Path, default=HERE / "_work")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm/shardctl-bench"))
    args = ap.parse_args()
    byte_compile(REPO)
    disk, shm = args.disk, args.shm
    disk.mkdir(parents=True, exist_ok=True)
    shm.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    try:
        for size in args.only or ["small", "big"]:
            t0 = time.monotonic()
            build(disk / size, size)
            if "shm" in (args.where or ["shm"]) and not (shm / size).exists():
                shutil.copytree(disk / size, shm / size)
            print(f"# {size}: ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            for loc in args.where or ["disk", "shm"]:
                root = disk if loc == "disk" else shm
                peers = not args.no_peers and args.peers_on in (size, "both")
                rows += run_location(loc, root, size, args.rounds, peers)
                print(f"# {size} {loc} done", file=sys.stderr)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    head = (
        "where",
        "size",
        "command",
        "wall s (median)",
        "runs",
        "CPU s",
        "peak RSS MiB",
        "÷ cp -r",
    )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
