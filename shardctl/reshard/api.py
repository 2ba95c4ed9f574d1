"""``reshard(src, dst, ...)``: split, merge or convert a checkpoint, atomically, in bounded memory.

::

    result = reshard(Path("llama"), Path("llama-tp4"), mesh=Mesh(tp=4))    # HF -> ranks
    reshard(Path("llama-tp4"), Path("llama-tp2"), mesh=Mesh(tp=2))         # ranks -> ranks
    reshard(Path("llama-tp4"), Path("llama-merged"), fmt="hf")            # ranks -> HF

Order of work: validate paths and input (nothing written) → target layout and every output
header → free-space preflight → lock → staging sibling → carried files, data, index → input
re-checked → record → fsync → rename. Errors are ShardctlError subclasses (exit codes in
shardctl.errors); OSErrors become one-line exit-5 errors; SIGINT/SIGTERM clean up and raise
``Interrupted`` (130/143).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardctl.checkpoint import record, record_table, record_write
from shardctl.checkpoint.hf import INDEX_NAME, PickleInputRefused
from shardctl.checkpoint.input_check import InputCheck
from shardctl.checkpoint.source import Source, open_source
from shardctl.errors import Interrupted, UsageError
from shardctl.gcpause import gc_paused
from shardctl.io import atomic, faults
from shardctl.io.checksum import default_hash
from shardctl.io.lock import OutputLock
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec
from shardctl.reshard import pickle_input
from shardctl.reshard import resume as resume_run
from shardctl.reshard.carry import carry, digest_file, identity, with_carried
from shardctl.reshard.copy import BLOCK_BYTES
from shardctl.reshard.data import write_data
from shardctl.reshard.result import ReshardResult, peak_rss_bytes
from shardctl.reshard.safety import check_output, os_failure, preflight_space
from shardctl.reshard.signals import interrupts_raise
from shardctl.reshard.target import DEFAULT_MAX_SHARD_SIZE, Plan, plan, space_needed


@dataclass
class _Run:
    """One run's state, passed between the steps of :func:`reshard`.

    ``source``/``the_plan`` are None for a pickle input until it is converted inside staging;
    ``dist`` is the torchrun group (None for one process); ``lead`` owns lock, staging, commit.
    """

    src: Path
    dst: Path
    target: Callable[[Source], Plan]
    force: bool
    hash_name: str
    workers: int
    block_bytes: int
    progress: Callable[[int, int], None] | None
    verify_input: bool
    resume: bool
    source: Source | None
    the_plan: Plan | None
    kind: str
    pickle_files: tuple[Path, ...]
    dist: Any
    lock: OutputLock | None = None
    staging: Path | None = None
    journal: resume_run.Journal | None = None
    reused: dict[str, str] = field(default_factory=dict)  # killed identical run: name -> digest

    @property
    def lead(self) -> bool:
        return self.dist is None or self.dist.rank == 0


@gc_paused
def reshard(
    src: Path,
    dst: Path,
    *,
    mesh: Mesh | None = None,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen
    fmt: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    workers: int | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    follow_external_symlinks: bool = False,
    progress: Callable[[int, int], None] | None = None,
    hash_name: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    verify_input: bool = True,
    resume: bool = True,
) -> ReshardResult:
    """Write ``src`` re-laid-out as ``mesh`` (``ranks``) or whole (``hf``) to ``dst``.

    ``resume``: reuse the finished files of an identical run that was killed hard
    (:mod:`shardctl.reshard.resume`); False always starts clean."""
    t0 = time.monotonic()
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise UsageError(f"workers must be >= 1, got {workers}")

    def target(source: Source) -> Plan:
        return plan(
            source, mesh=mesh, rules=rules, options=options, fmt=fmt, max_shard_size=max_shard_size
        )

    run = _prepare(
        Path(src),
        Path(dst),
        target,
        force=force,
        allow_pickle=allow_pickle,
        follow_external_symlinks=follow_external_symlinks,
    )
    run.hash_name = hash_name or default_hash()
    run.workers, run.block_bytes, run.progress = workers, block_bytes, progress
    run.verify_input, run.resume = verify_input, resume
    with interrupts_raise():
        try:
            work = _open_staging(run)
            if run.source is None:
                _convert_pickle(run, work)
            digests = _write(run, work)
            if not run.lead:
                run.dist.done()
                return _result(run, digests, t0, 0)
            extra = _commit(run, digests)
            if run.dist is not None:
                run.dist.done()
            return _result(run, digests, t0, extra)
        except (Interrupted, KeyboardInterrupt) as exc:
            # torchrun SIGTERMs the survivors as soon as one worker dies, wherever they are:
            # a lost peer explains the interrupt (exit 5 naming it), not the signal (143).
            if run.dist is None:
                raise
            raise run.dist.explain(exc) from None
        except OSError as exc:
            raise os_failure(exc) from None
        finally:
            if run.journal is not None:
                run.journal.close()
            atomic.discard(run.staging)
            if run.lock is not None:
                run.lock.release()


# ---- the steps of a run --------------------------------------------------------------------


def _prepare(
    src: Path,
    dst: Path,
    target: Callable[[Source], Plan],
    *,
    force: bool,
    allow_pickle: bool,
    follow_external_symlinks: bool,
) -> _Run:
    """Validate paths and input, decide every output file, check free space; nothing written."""
    pickle_input.refuse_untrusted_formats(src)
    dst = check_output(src, dst, force=force)
    source: Source | None
    the_plan: Plan | None = None
    try:
        source = open_source(src, follow_external_symlinks=follow_external_symlinks)
        kind = source.kind
        pickle_files: tuple[Path, ...] = ()
    except PickleInputRefused as exc:
        if not allow_pickle:
            raise
        pickle_files, source, kind = exc.files, None, "pickle"
    if source is not None:
        check_output(src, dst, force=force, input_files=[f.path for f in source.files])
        the_plan = target(source)
        preflight_space(dst.parent, space_needed(source, the_plan))
    return _Run(
        src=src,
        dst=dst,
        target=target,
        force=force,
        hash_name="",
        workers=1,
        block_bytes=BLOCK_BYTES,
        progress=None,
        verify_input=True,
        resume=True,
        source=source,
        the_plan=the_plan,
        kind=kind,
        pickle_files=pickle_files,
        dist=_distributed(),
    )


def _open_staging(run: _Run) -> Path:
    """Lock DST, adopt a killed identical run's staging (resume) or make a fresh one.

    Under torchrun rank 0 does this and shares the staging path with the other workers."""
    if run.lead:
        try:
            run.lock = OutputLock(run.dst)
            run.lock.acquire()
            ident = None
            if run.resume and run.dist is None and run.source is not None:
                assert run.the_plan is not None
                ident = resume_run.run_id(run.source, run.the_plan, run.hash_name)
                run.staging, run.reused = resume_run.adopt(run.dst, ident, run.hash_name)
            atomic.recover(run.dst, keep=run.staging)
            if os.path.lexists(run.dst) and not run.force:
                check_output(run.src, run.dst, force=False)
            if run.staging is None:
                run.staging = atomic.make_staging(run.dst)
                if ident is not None:
                    resume_run.start(run.staging, ident)
            if ident is not None:
                run.journal = resume_run.Journal(run.staging)
        except BaseException:
            if run.dist is not None:
                run.dist.share(None)
            raise
    work = run.staging if run.dist is None else run.dist.share(run.staging)
    assert work is not None
    return work


def _convert_pickle(run: _Run, work: Path) -> None:
    """A pickle input: convert it weights-only into the staging area, then plan as usual."""
    conv = pickle_input.convert(
        [run.src / p for p in run.pickle_files], run.src, work / ".pickle-input"
    )
    run.source = with_carried(open_source(conv), run.src)
    run.the_plan = run.target(run.source)
    preflight_space(run.dst.parent, space_needed(run.source, run.the_plan))


def _write(run: _Run, work: Path) -> dict[str, str]:
    """Write this process's share of the files; every file's digest (rank 0 gathers them)."""
    source, the_plan = run.source, run.the_plan
    assert source is not None and the_plan is not None
    mine = list(the_plan.files) if run.dist is None else run.dist.mine(list(the_plan.files))
    mine = [f for f in mine if f.name not in run.reused]
    expected = source.expected_digests() if run.verify_input else []
    if run.dist is not None:  # each worker hashes its share of the inputs
        expected = expected[run.dist.rank :: run.dist.world]

    def write_mine() -> dict[str, str]:
        check = InputCheck(expected).start()
        try:
            digests = write_data(
                work,
                source,
                mine,
                run.hash_name,
                run.workers,
                run.block_bytes,
                run.progress,
                the_plan.data_bytes,
                check,
                run.journal,
                sum(f.size for f in the_plan.files if f.name in run.reused),
                the_plan.sources,
                the_plan.order,
            )
        except BaseException:
            check.cancel()
            raise
        check.result()  # a corrupt input never commits (exit 3)
        return {**run.reused, **digests}

    if run.dist is None:
        return write_mine()
    # Under torchrun each worker writes its share; rank 0 gathers every digest.
    digests: dict[str, str] = run.dist.run_and_gather(write_mine)
    return digests


def _commit(run: _Run, digests: dict[str, str]) -> int:
    """Carried files, index, input re-check, record, rename into place; the extra bytes."""
    source, the_plan, staging = run.source, run.the_plan, run.staging
    assert source is not None and the_plan is not None and staging is not None
    if run.journal is not None:
        run.journal.close()
        resume_run.finish(staging)
    carried = carry(source, staging)
    extra = 0
    if the_plan.index is not None:
        extra += atomic.write_file(staging / INDEX_NAME, the_plan.index)
        faults.point("index_written")
    source.check_unchanged()
    if the_plan.fmt == "vllm":  # vLLM reads only its own files; shardctl reads them back by name
        shutil.rmtree(staging / ".pickle-input", ignore_errors=True)
        for name, data in the_plan.extra_files:
            extra += atomic.write_file(staging / name, data)
        atomic.commit(staging, run.dst, replace=run.force)
        run.staging = None
        return extra
    files = [record.FileDigest(f.name, f.size, digests[f.name]) for f in the_plan.files]
    if the_plan.index is not None:
        files.append(digest_file(staging / INDEX_NAME, run.hash_name))
    rec = record_write.build(
        fmt=the_plan.fmt,
        architecture=source.model.architecture,
        layout=the_plan.layout,
        tensors=source.model.tensors,
        padded_shapes=dict(the_plan.layout.padded_shapes) if the_plan.layout else {},
        shard_files=the_plan.shard_files,
        source=identity(source, run.src, run.kind),
        hash_name=run.hash_name,
        files=files,
        carried=carried,
        # the planner's order is positions in source.model.tensors (target._order)
        tindex=the_plan.shard_files.order
        if isinstance(the_plan.shard_files, record_table.PlannedFiles)
        else None,
    )
    shutil.rmtree(staging / ".pickle-input", ignore_errors=True)
    record_write.write(staging, rec)
    faults.point("record_written")
    atomic.commit(staging, run.dst, replace=run.force)
    run.staging = None
    return extra


def default_workers() -> int:
    """Writer threads: one per usable core, at most 4 (the copies are memory-bound)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _result(run: _Run, digests: dict[str, str], t0: float, extra: int) -> ReshardResult:
    the_plan, source = run.the_plan, run.source
    assert the_plan is not None and source is not None
    files = tuple(
        record.FileDigest(f.name, f.size, digests.get(f.name, "")) for f in the_plan.files
    )
    # a file is its header then its tensors back to back (they tile the data region exactly)
    tensor_bytes = sum(f.size - f.header_size for f in the_plan.files)
    return ReshardResult(
        dst=run.dst,
        format=the_plan.fmt,
        mesh=the_plan.layout.mesh if the_plan.layout else None,
        source_kind=run.kind,
        files=files,
        tensor_bytes=tensor_bytes,
        total_bytes=the_plan.data_bytes + extra,
        seconds=time.monotonic() - t0,
        hash=run.hash_name,
        carried=tuple(p.name for p in source.carried),
        workers=run.workers,
        resumed=tuple(sorted(run.reused)),
        src=run.src,
        peak_rss_bytes=peak_rss_bytes(),
    )


def world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it; anything else (``abc``, ``-1``) is exit 3."""
    from shardctl.errors import InvalidInputError

    text = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 2**20:
        raise InvalidInputError(
            f"WORLD_SIZE={text[:40]!r} is not a world size (an integer 1..{2**20})",
            where="environment",
            hint="unset it, or run under torchrun",
        )
    return int(text)


def _distributed() -> Any:
    """Under torchrun (``WORLD_SIZE`` > 1): a gloo group that splits the output files."""
    if world_size() <= 1:
        return None
    from shardctl.reshard.scaleout import Group

    return Group()


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "Plan", "ReshardResult", "plan", "reshard"]
