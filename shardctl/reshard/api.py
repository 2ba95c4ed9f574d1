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
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardctl.checkpoint import plan_files, record
from shardctl.checkpoint.hf import INDEX_NAME, PickleInputRefused
from shardctl.checkpoint.input_check import InputCheck
from shardctl.checkpoint.source import Source, open_source
from shardctl.errors import Interrupted, ShardctlError, UsageError
from shardctl.io import atomic, faults
from shardctl.io.checksum import default_hash
from shardctl.io.lock import OutputLock
from shardctl.layout import bounds
from shardctl.layout.engine import build_layout
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RuleSpec
from shardctl.reshard import pickle_input
from shardctl.reshard import resume as resume_run
from shardctl.reshard.copy import BLOCK_BYTES, Executor
from shardctl.reshard.safety import check_output, os_failure, preflight_space

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class ReshardResult:
    dst: Path
    format: str  # "ranks" | "hf"
    mesh: Mesh | None
    source_kind: str  # "hf" | "shardctl" | "pickle"
    files: tuple[record.FileDigest, ...]
    tensor_bytes: int  # bytes of tensor data written (padding included)
    total_bytes: int  # every file written, headers, index, record and carried files included
    seconds: float
    hash: str
    carried: tuple[str, ...]
    workers: int
    resumed: tuple[str, ...] = ()  # files reused from a killed identical run (not rewritten)


@dataclass(frozen=True)
class Plan:
    """Everything decided before writing: format, layout, files and their headers."""

    fmt: str
    layout: Layout | None
    files: tuple[plan_files.OutputFile, ...]
    shard_files: dict[tuple[int, str], str]
    index: bytes | None

    @property
    def data_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan(
    source: Source,
    *,
    mesh: Mesh | None,
    rules: Sequence[RuleSpec] = (),
    options: LayoutOptions = LayoutOptions(),  # noqa: B008 - frozen
    fmt: str | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Plan:
    """The target layout and every output file's header; writes nothing."""
    if fmt is None:
        fmt = "ranks" if mesh is not None and mesh.model_parallel > 1 else "hf"
    if fmt not in ("ranks", "hf"):
        raise UsageError(f"unknown format {fmt!r}", hint="use ranks or hf")
    if max_shard_size <= 0:
        raise UsageError(f"max_shard_size must be positive, got {max_shard_size}")
    bounds.check_dtypes(source.model)
    order = {t.fqn: i for i, t in enumerate(source.model.tensors)}
    if fmt == "hf":
        if mesh is not None and mesh.model_parallel > 1:
            raise UsageError(f"format hf holds whole tensors; mesh {mesh} needs format ranks")
        files, index = plan_files.hf_files(source.model.tensors, max_shard_size)
        return Plan("hf", None, tuple(files), {}, index)
    bounds.check_mesh(source.model, mesh or Mesh())  # before build_layout materializes shards
    bounds.check_config(source.model)
    layout = build_layout(source.model, mesh or Mesh(), rules=rules, options=options)
    rfiles, where = plan_files.rank_files(layout, order, max_shard_size)
    return Plan("ranks", layout, tuple(rfiles), where, None)


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
    src, dst = Path(src), Path(dst)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise UsageError(f"workers must be >= 1, got {workers}")
    pickle_input.refuse_untrusted_formats(src)
    dst = check_output(src, dst, force=force)
    source: Source | None
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
        the_plan = plan(
            source, mesh=mesh, rules=rules, options=options, fmt=fmt, max_shard_size=max_shard_size
        )
        preflight_space(dst.parent, _need(source, the_plan))
    hash_name = hash_name or default_hash()
    dist = _distributed()
    lead = dist is None or dist.rank == 0
    with _signals():
        lock: OutputLock | None = None
        staging: Path | None = None
        journal: resume_run.Journal | None = None
        reused: dict[str, str] = {}  # files of a killed identical run: name -> digest
        try:
            if lead:
                try:
                    lock = OutputLock(dst)
                    lock.acquire()
                    ident = None
                    if resume and dist is None and source is not None:
                        ident = resume_run.run_id(source, the_plan, hash_name)
                        staging, reused = resume_run.adopt(dst, ident, hash_name)
                    atomic.recover(dst, keep=staging)
                    if os.path.lexists(dst) and not force:
                        check_output(src, dst, force=False)
                    if staging is None:
                        staging = atomic.make_staging(dst)
                        if ident is not None:
                            resume_run.start(staging, ident)
                    if ident is not None:
                        journal = resume_run.Journal(staging)
                except BaseException:
                    if dist is not None:
                        dist.share(None)
                    raise
            work = staging if dist is None else dist.share(staging)
            assert work is not None
            if source is None:  # pickle: convert weights-only into the staging area first
                conv = pickle_input.convert(
                    [src / p for p in pickle_files], src, work / ".pickle-input"
                )
                source = _with_carried(open_source(conv), src)
                the_plan = plan(
                    source,
                    mesh=mesh,
                    rules=rules,
                    options=options,
                    fmt=fmt,
                    max_shard_size=max_shard_size,
                )
                preflight_space(dst.parent, _need(source, the_plan))
            mine = list(the_plan.files) if dist is None else dist.mine(list(the_plan.files))
            mine = [f for f in mine if f.name not in reused]

            expected = source.expected_digests() if verify_input else []
            if dist is not None:  # each worker hashes its share of the inputs
                expected = expected[dist.rank :: dist.world]

            def write_mine() -> dict[str, str]:
                check = InputCheck(expected).start()
                try:
                    digests = _write_data(
                        work,
                        source,
                        mine,
                        hash_name,
                        workers,
                        block_bytes,
                        progress,
                        the_plan.data_bytes,
                        check,
                        journal,
                        sum(f.size for f in the_plan.files if f.name in reused),
                    )
                except BaseException:
                    check.cancel()
                    raise
                check.result()  # a corrupt input never commits (exit 3)
                return {**reused, **digests}

            if dist is None:
                digests = write_mine()
            else:
                # Under torchrun each worker writes its share; rank 0 gathers every digest.
                digests = dist.run_and_gather(write_mine)
                if not lead:
                    dist.done()
                    return _result(dst, the_plan, source, kind, digests, hash_name, t0, workers, 0)
            assert staging is not None
            if journal is not None:
                journal.close()
                resume_run.finish(staging)
            carried = _carry(source, staging)
            extra = 0
            if the_plan.index is not None:
                extra += atomic.write_file(staging / INDEX_NAME, the_plan.index)
                faults.point("index_written")
            source.check_unchanged()
            files = [record.FileDigest(f.name, f.size, digests[f.name]) for f in the_plan.files]
            if the_plan.index is not None:
                files.append(_digest_file(staging / INDEX_NAME, hash_name))
            rec = record.build(
                fmt=the_plan.fmt,
                architecture=source.model.architecture,
                layout=the_plan.layout,
                tensors=source.model.tensors,
                padded_shapes=dict(the_plan.layout.padded_shapes) if the_plan.layout else {},
                shard_files=the_plan.shard_files,
                source=_identity(source, src, kind),
                hash_name=hash_name,
                files=files,
                carried=carried,
            )
            shutil.rmtree(staging / ".pickle-input", ignore_errors=True)
            record.write(staging, rec)
            faults.point("record_written")
            atomic.commit(staging, dst, replace=force)
            staging = None
            if dist is not None:
                dist.done()
            return _result(
                dst, the_plan, source, kind, digests, hash_name, t0, workers, extra, reused
            )
        except (Interrupted, KeyboardInterrupt) as exc:
            # torchrun SIGTERMs the survivors as soon as one worker dies, wherever they are:
            # a lost peer explains the interrupt (exit 5 naming it), not the signal (143).
            if dist is None:
                raise
            raise dist.explain(exc) from None
        except OSError as exc:
            raise os_failure(exc) from None
        finally:
            if journal is not None:
                journal.close()
            atomic.discard(staging)
            if lock is not None:
                lock.release()


def default_workers() -> int:
    """Writer threads: one per usable core, at most 4 (the copies are memory-bound)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


# ---- pieces --------------------------------------------------------------------------------


def _need(source: Source, the_plan: Plan) -> int:
    carried = sum(os.path.getsize(source.root / p) for p in source.carried)
    return the_plan.data_bytes + carried + 2**20 + len(the_plan.index or b"")


def _write_data(
    staging: Path,
    source: Source,
    files: list[plan_files.OutputFile],
    hash_name: str,
    workers: int,
    block_bytes: int,
    progress: Callable[[int, int], None] | None,
    total: int,
    check: InputCheck | None = None,
    journal: resume_run.Journal | None = None,
    reused_bytes: int = 0,
) -> dict[str, str]:
    done = [reused_bytes]
    lock = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock:
                done[0] += n
                progress(done[0], total)

    paths = [f.path for f in source.files]
    order = {t.fqn: i for i, t in enumerate(source.model.tensors)}

    def on_read(file: int, offset: int, data: memoryview) -> None:
        assert check is not None
        check.take(paths[file], offset, data)

    return Executor(
        staging,
        paths,
        dict(source.shards),
        hash_name=hash_name,
        block_bytes=block_bytes,
        progress=tick,
        order=order,
        writers=min(workers, max(1, len(files))),
        on_read=on_read if check is not None and check.feeds else None,
        on_done=journal.done if journal is not None else None,
    ).run(files)


def _carry(source: Source, staging: Path) -> list[str]:
    """config.json, tokenizer and generation files, byte for byte (fsynced)."""
    names: list[str] = []
    for rel in source.carried:
        if rel.name == record.RECORD_NAME:
            continue
        with open(source.root / rel, "rb") as f:
            atomic.write_file(staging / rel.name, f.read())
        names.append(rel.name)
    return names


def _digest_file(path: Path, hash_name: str) -> record.FileDigest:
    from shardctl.io.checksum import new_hash

    h = new_hash(hash_name)
    data = path.read_bytes()
    h.update(data)
    return record.FileDigest(path.name, len(data), h.hexdigest())


def _with_carried(source: Source, root: Path) -> Source:
    """A converted pickle input carries the original root's files (absolute paths)."""
    from dataclasses import replace

    from shardctl.checkpoint.hf import PICKLE_SUFFIXES

    carried = tuple(
        root / n
        for n in sorted(os.listdir(root))
        if (root / n).is_file()
        and not n.startswith(".")
        and not n.endswith(PICKLE_SUFFIXES)
        and not n.endswith(".index.json")
    )
    return replace(source, carried=carried)


def _identity(source: Source, src: Path, kind: str) -> dict[str, Any]:
    ident = source.identity()
    if kind == "pickle":
        ident["kind"] = "pickle"
        ident["path"] = str(Path(os.path.abspath(src)))
        ident["files"] = []
    return ident


def _result(
    dst: Path,
    the_plan: Plan,
    source: Source,
    kind: str,
    digests: dict[str, str],
    hash_name: str,
    t0: float,
    workers: int,
    extra: int,
    reused: dict[str, str] | None = None,
) -> ReshardResult:
    files = tuple(
        record.FileDigest(f.name, f.size, digests.get(f.name, "")) for f in the_plan.files
    )
    tensor_bytes = sum(t.nbytes for f in the_plan.files for t in f.tensors)
    return ReshardResult(
        dst=dst,
        format=the_plan.fmt,
        mesh=the_plan.layout.mesh if the_plan.layout else None,
        source_kind=kind,
        files=files,
        tensor_bytes=tensor_bytes,
        total_bytes=the_plan.data_bytes + extra,
        seconds=time.monotonic() - t0,
        hash=hash_name,
        carried=tuple(p.name for p in source.carried),
        workers=workers,
        resumed=tuple(sorted(reused or {})),
    )


@contextmanager
def _signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted in the main thread (cleanup runs); SIGXFSZ -> EFBIG."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second interrupt during cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding RLIMIT_FSIZE: EFBIG, not death
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "Plan", "ReshardResult", "ShardctlError", "plan", "reshard"]
