"""The data step of a reshard: run the copy engine over this process's output files.

Wires the run's progress, input checksums and resume journal to the
:class:`~shardctl.reshard.copy.Executor` callbacks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from shardctl.checkpoint import plan_files
from shardctl.checkpoint.input_check import InputCheck
from shardctl.checkpoint.source import Source, SourceShard
from shardctl.reshard import resume as resume_run
from shardctl.reshard.copy import Executor


def write_data(
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
    sources: Mapping[str, tuple[SourceShard, ...]] | None = None,
    order: dict[str, int] | None = None,
) -> dict[str, str]:
    """Write ``files`` into ``staging`` with one :class:`Executor`; ``name -> digest``.

    ``progress`` sees ``(bytes done, total)``, counting ``reused_bytes`` (a resumed run's
    finished files) as done; ``check`` is fed every byte read; ``journal`` hears of every file
    fsynced; ``sources``/``order``: an engine format's relabelled source shards (``Plan``)."""
    done = [reused_bytes]
    lock = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock:
                done[0] += n
                progress(done[0], total)

    paths = [f.path for f in source.files]
    if order is None:
        order = {t.fqn: i for i, t in enumerate(source.model.tensors)}

    def on_read(file: int, offset: int, data: memoryview) -> None:
        assert check is not None
        check.take(paths[file], offset, data)

    return Executor(
        staging,
        paths,
        source.shards if sources is None else sources,  # looked up per fqn, never copied
        hash_name=hash_name,
        block_bytes=block_bytes,
        progress=tick,
        order=order,
        writers=min(workers, max(1, len(files))),
        on_read=on_read if check is not None and check.feeds else None,
        on_done=journal.done if journal is not None else None,
    ).run(files)
