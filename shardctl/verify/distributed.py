"""``verify`` as a torchrun job: one process per model-parallel rank, on as many nodes as needed.

See ``worker.py`` for the invocation. Rank 0 runs the structure and bitwise levels first (the
others wait at a collective), then every rank builds and runs its part of the sharded model from
its own files; the output rank's logits go to rank 0, which loads SRC's unsharded model,
compares, and writes the report. Returns the exit code (0 equivalent, 1 not).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardctl.errors import EXIT_NEGATIVE, EXIT_OK, EnvironmentFailure
from shardctl.verify.result import VerifyResult

if TYPE_CHECKING:
    from shardctl.verify.forward import Reference


def run_under_torchrun(src: Path, dst: Path, *, seed: int, report: Path | None) -> int:
    import torch.distributed as dist

    device = local_device()
    dist.init_process_group("nccl" if device != "cpu" else "gloo", timeout=timedelta(hours=2))
    try:
        code = _run(src, dst, device, seed=seed, report=report)
        # Leave together: a rank that tore its gloo pairs down and exited while rank 0 was
        # still writing the report made rank 0 abort at exit now and then ("terminate called
        # without an active exception", SIGABRT: exit 1 for a verified layout). On an error
        # there is no barrier: torchrun's agent stops the other ranks.
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


def _run(src: Path, dst: Path, device: str, *, seed: int, report: Path | None) -> int:
    import torch.distributed as dist

    from shardctl.verify import forward as fw
    from shardctl.verify.api import sharded_view
    from shardctl.verify.comm import DistComm, Topology
    from shardctl.verify.dst import open_destination
    from shardctl.verify.rank import run_rank

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = device != "cpu"
    result, stop = _bitwise_on_rank0(src, dst, rank, cuda)
    if stop:  # not equivalent (rank 0 reports), or rank 0 could not verify
        return _finish(result, report)
    ck = sharded_view(open_destination(dst))
    if ck.world != world:
        raise EnvironmentFailure(
            f"torchrun started {world} processes, the layout has {ck.world} model-parallel "
            "ranks (pp × ep × tp)",
            hint=f"use --nnodes × --nproc-per-node = {ck.world}",
        )
    jobs = fw.make_jobs(ck, device="cuda" if cuda else "cpu", simulated=False, seed=seed)
    job = replace(jobs[rank], device=device)  # make_jobs numbers GPUs by global rank
    ref = _reference_on_rank0(src, job, result, rank)
    job = replace(job, routing=_shared(None if ref is None else ref.routing) or None)
    outcome = run_rank(job, DistComm(rank, Topology(*job.topo)))
    problems: list[list[str] | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(outcome.problems, problems, dst=0)
    logits = _logits_to_rank0(outcome.logits, ck, job, rank, device, problems)
    if rank != 0:
        return EXIT_OK
    assert result is not None and ref is not None
    _record_forward(result, problems or [], logits, ref, job, seed)
    result.environment.update(
        fw.plan_run("cuda" if cuda else "cpu", world, False),
        launcher="torchrun",
        nodes=os.environ.get("GROUP_WORLD_SIZE", "?"),
    )
    return _finish(result, report)


def _bitwise_on_rank0(
    src: Path, dst: Path, rank: int, cuda: bool
) -> tuple[VerifyResult | None, bool]:
    """Rank 0 runs structure and bitwise; every rank learns whether to go on to the forward."""
    import torch.distributed as dist

    from shardctl.verify.api import verify

    result: VerifyResult | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            result = verify(src, dst, level="bitwise", launcher="torchrun")
        except Exception as exc:  # the others wait at the broadcast: tell them first
            failure = exc
    state = 2 if failure is not None else (0 if result is None or result.ok else 1)
    flag = torch.tensor([state])
    flag = flag.cuda() if cuda else flag
    dist.broadcast(flag, 0)
    if failure is not None:
        raise failure
    return result, bool(int(flag.item()))


def _reference_on_rank0(
    src: Path, job: Any, result: VerifyResult | None, rank: int
) -> Reference | None:
    """Rank 0 runs the reference first (MoE ranks are pinned to its expert choices); a failure
    there reaches every rank before any of them starts its part."""
    import torch.distributed as dist

    from shardctl.verify import forward as fw

    ref, failure = None, None
    if rank == 0:
        try:
            assert result is not None
            ref = fw.reference_logits(src, job, result.level_result("forward").figures)
        except Exception as exc:  # the others wait at the broadcast: tell them first
            failure = exc
    failed = [failure is not None]
    dist.broadcast_object_list(failed, 0)
    if failure is not None:
        raise failure
    if failed[0]:
        raise EnvironmentFailure("rank 0 could not run the reference model")
    return ref


def _shared(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _logits_to_rank0(
    logits: torch.Tensor | None,
    ck: Any,
    job: Any,
    rank: int,
    device: str,
    problems: list[list[str] | None] | None,
) -> torch.Tensor | None:
    """The output rank's logits, on rank 0 (None elsewhere, or when a rank had a problem)."""
    import torch.distributed as dist

    mesh = ck.layout.mesh
    out_rank = (mesh.pp - 1) * mesh.ep * mesh.tp
    if out_rank == 0:
        return logits
    shape = (job.batch, job.seq_len, int(ck.config["vocab_size"]))
    # Either every rank ran its stage (no rank had a problem) or none did (comm.agree).
    if rank == out_rank and logits is not None:
        dist.send(logits.to(device), 0)
    elif rank == 0 and not any(problems or []):
        logits = torch.empty(shape, dtype=torch.float64, device=device)
        dist.recv(logits, out_rank)
    return logits


def _record_forward(
    result: VerifyResult,
    problems: list[list[str] | None],
    logits: torch.Tensor | None,
    ref: Reference,
    job: Any,
    seed: int,
) -> None:
    """Rank 0: the forward level's findings, figures and tolerances into ``result``."""
    from shardctl.verify import forward as fw

    level = result.level_result("forward")
    for r, ps in enumerate(problems):
        for p in ps or ():
            level.fail(p, rank=r)
    if not level.findings and logits is not None:
        # ``job`` is rank 0's, on the device LOCAL_RANK chose (jobs[0] says cuda:0)
        level.figures.update(seed=seed, batch=job.batch, seq_len=job.seq_len, dtype=ref.dtype)
        if ref.routing:
            level.figures.update(
                routing="pinned to the float64 reference's expert choices",
                moe_layers=len(ref.routing),
                routing_ties_flipped=ref.flips,
            )
        result.tolerances["forward"] = fw.compare(level, logits.cpu(), ref.unsharded, ref.reference)
    level.close()
    result.level = "forward"


def local_device() -> str:
    """This process's device under torchrun: ``cuda:LOCAL_RANK`` when CUDA is there, else cpu.

    LOCAL_RANK, not RANK: with ``--nnodes 2 --nproc-per-node 8`` global rank 9 is the second
    GPU of the second node, ``cuda:1``.
    """
    if not torch.cuda.is_available():
        return "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if not 0 <= local < count:
        raise EnvironmentFailure(
            f"LOCAL_RANK {local}, but this node has {count} CUDA devices",
            hint="start at most one process per GPU on each node (--nproc-per-node)",
        )
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def _finish(result: VerifyResult | None, report: Path | None) -> int:
    if result is None:
        return EXIT_OK
    if report is not None:
        report.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return EXIT_OK if result.ok else EXIT_NEGATIVE
