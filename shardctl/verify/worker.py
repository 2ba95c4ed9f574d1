"""Entry point of one forward rank: ``python -m shardctl.verify.worker``.

Two ways in, both reading ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (and
``LOCAL_RANK`` for the GPU) the way ``torchrun`` sets them:

1. spawned by ``shardctl verify`` (``--serve``): take jobs from the parent's TCP store, run
   each, put the outcome (problems, timings, logits on the output rank) back;
2. multi-node, under torchrun — one process per model-parallel rank (``pp × ep × tp``), the
   same command on every node (README: static or c10d rendezvous)::

       torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK \\
           --master-addr $HEAD --master-port 29500 \\
           -m shardctl.verify.worker SRC DST --seed 0 --report verify.json

   Every rank loads only its own files from DST (same path on every node: shared storage).
   Global rank 0 first runs the structure and bitwise levels, then every rank runs the
   forward on ``cuda:$LOCAL_RANK`` (or the CPU, gloo); the output rank sends its logits to
   rank 0, which compares them with SRC's unsharded model (SRC merged first if it is itself
   sharded) and writes the report (schema ``shardctl.verify/1``). Exit: 0 equivalent, 1 not,
   3 invalid, 5 could not verify — on rank 0; other ranks exit 0 unless their run broke.
   Errors are one line on stderr, as for the CLI.

Why a module of its own rather than a ``shardctl`` subcommand: torchrun starts the same
``python -m MODULE ARGS`` on every rank of every node, and ``shardctl verify`` spawns its local
ranks the same way; both need an entry that reads torchrun's environment, joins the process
group and runs rank jobs, which is not a user command (``--serve`` speaks a private protocol
with the parent) and must not carry the CLI's option surface.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch


def _init(world: int, rank: int) -> str:
    import torch.distributed as dist

    backend = os.environ.get("SHARDCTL_VERIFY_BACKEND") or (
        "nccl" if torch.cuda.is_available() else "gloo"
    )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = None
    if os.environ.get("SHARDCTL_VERIFY_STORE") == "client":
        # The parent ``shardctl verify`` hosts the store on a port it already holds.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=120),
        )
    dist.init_process_group(
        backend, rank=rank, world_size=world, store=store, timeout=timedelta(seconds=600)
    )
    return backend


def _serve() -> int:
    """Run jobs from the parent's store until told to stop (``ProcessWorld``)."""
    import torch.distributed as dist

    from shardctl.verify.comm import DistComm, Topology
    from shardctl.verify.launch import write_outcome
    from shardctl.verify.rank import RankJob, run_rank

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init(world, rank)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(hours=24),
    )
    outdir = Path(os.environ["SHARDCTL_VERIFY_DIR"])
    k = 0
    try:
        while True:
            data = store.get(f"job/{k}/{rank}")
            if data == b"stop":
                return 0
            job = RankJob.from_json(json.loads(data))
            outcome = run_rank(job, DistComm(job.rank, Topology(*job.topo)))
            store.set(f"outcome/{k}/{rank}", write_outcome(outcome, outdir, k))
            k += 1
    finally:
        dist.destroy_process_group()


def forked(env: dict[str, str], log: str, threads: int) -> None:
    """One rank forked from the launcher's preloaded server (``launch.ProcessWorld`` on gloo):
    what ``python -m shardctl.verify.worker --serve`` does in a fresh process, with torch,
    transformers and the family's classes already imported. Output goes to ``log``; the
    environment is the parent's with the rank's variables; the thread count is set here, since
    the OpenMP runtime read ``OMP_NUM_THREADS`` when the server imported torch."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    from shardctl.console import run_cli

    run_cli(lambda: sys.exit(main(["--serve"])))


def _run_torchrun(args: argparse.Namespace) -> NoReturn:
    from shardctl.verify.distributed import run_under_torchrun

    code = run_under_torchrun(
        Path(args.src),
        Path(args.dst),
        seed=args.seed,
        report=Path(args.report) if args.report else None,
    )
    # The process group is destroyed and the report written: leave without the interpreter's
    # teardown. A rank now and then aborted in it (SIGABRT, "terminate called without an
    # active exception" from the gloo threads' destructors) even after the barrier, and
    # torchrun then failed the whole run of a verified layout (seen twice in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardctl.verify.worker")
    p.add_argument("src", nargs="?")
    p.add_argument("dst", nargs="?")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a rank prints nothing of its own: no third-party bars
    if args.serve:
        return _serve()
    if not (args.src and args.dst):
        p.error("give SRC and DST (under torchrun), or --serve")
    return _run_torchrun(args)


if __name__ == "__main__":
    from shardctl.console import run_cli

    run_cli(lambda: sys.exit(main()))  # errors: one line on stderr and the documented code
