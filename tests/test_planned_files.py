"""The planned ``(rank, fqn) -> file`` mapping (``record_table.PlannedFiles``) is the dict it
replaced: same keys, same names, same misses, and the record built from it is the same.

A real Mixtral written by ``save_pretrained``, planned TP2×EP2 with files capped small so every
rank's shards come in several parts (the part boundaries are what the mapping searches)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardctl.checkpoint import record_table, record_write
from shardctl.checkpoint.record import FileDigest
from shardctl.checkpoint.source import open_source
from shardctl.layout.types import Mesh
from shardctl.reshard.target import plan
from tests._models import make_checkpoint


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("planned") / "src",
        hidden_size=16,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=8,
        vocab_size=64,
    )


def _naive(files: tuple) -> dict[tuple[int, str], str]:
    """The dict ``rank_files`` used to return, from the planned files' own tensors."""
    return {(f.rank, t.fqn): f.name for f in files for t in f.tensors}


def test_planned_files_equal_the_dict(moe: Path) -> None:
    source = open_source(moe)
    the_plan = plan(source, mesh=Mesh(tp=2, ep=2), max_shard_size=1024)
    got, want = the_plan.shard_files, _naive(the_plan.files)
    assert isinstance(got, record_table.PlannedFiles)
    names_per_rank = {f.rank: set() for f in the_plan.files}
    for f in the_plan.files:
        names_per_rank[f.rank].add(f.name)
    assert all(len(n) >= 3 for n in names_per_rank.values())  # several parts per rank
    assert len(got) == len(want)
    assert dict(got) == want
    assert len(set(got)) == len(list(got))  # every key once
    for (rank, fqn), name in want.items():
        assert got[(rank, fqn)] == name and (rank, fqn) in got
    # a rank's names for its shards at once, in the layout's order, as one lookup each
    assert the_plan.layout is not None
    for i, rl in enumerate(the_plan.layout.ranks):
        assert record_table.planned_names(got, i, rl.shards) == [
            want[(i, s.fqn)] for s in rl.shards
        ]
    # misses: an fqn the rank does not hold (an expert of the other ep group), a rank out of
    # range, an unknown name, a key of the wrong shape
    expert = next(fqn for (r, fqn) in want if ".experts." in fqn and r == 0)
    other = next(r for r in range(4) if (r, expert) not in want)
    for key in [(other, expert), (4, expert), (-1, expert), (0, "no.such.tensor")]:
        assert key not in got
        with pytest.raises(KeyError):
            got[key]
    assert "x" not in got and (0,) not in got
    with pytest.raises(KeyError):
        got.names(other, [expert])


def test_record_from_planned_files_is_the_record_from_the_dict(moe: Path) -> None:
    source = open_source(moe)
    the_plan = plan(source, mesh=Mesh(tp=2, ep=2), max_shard_size=1024)
    files = [FileDigest(f.name, f.size, "0" * 64) for f in the_plan.files]

    def build(shard_files: object, tindex: object = None) -> str:
        rec = record_write.build(
            fmt="ranks",
            architecture=source.model.architecture,
            layout=the_plan.layout,
            tensors=source.model.tensors,
            padded_shapes={},
            shard_files=shard_files,  # type: ignore[arg-type]
            source={},
            hash_name="sha256",
            files=files,
            carried=[],
            tindex=tindex,  # type: ignore[arg-type]
        )
        rec.pop("created")
        return record_write._dumps(rec).decode()

    want = build(_naive(the_plan.files))
    assert build(the_plan.shard_files) == want
    # reshard hands the planner's own order over: one lookup a shard for tensor and file
    planned = the_plan.shard_files
    assert isinstance(planned, record_table.PlannedFiles)
    assert build(planned, planned.order) == want


def test_copy_walk_merges_as_heapq_does(moe: Path, tmp_path: Path) -> None:
    """The engine's walk over a batch of output files (one ``np.lexsort`` over planned files)
    yields the targets in the order and with the fields the ``heapq.merge`` of their
    ``LocalTensor`` lists gives (the path any other file list still takes)."""
    import os
    from dataclasses import replace

    from shardctl.reshard.copy import Executor
    from shardctl.reshard.writer import OutFile

    source = open_source(moe)
    the_plan = plan(source, mesh=Mesh(tp=2, ep=2), max_shard_size=1024)
    order = {t.fqn: i for i, t in enumerate(source.model.tensors)}
    ex = Executor(tmp_path, [f.path for f in source.files], source.shards, hash_name="sha256")
    planned = [OutFile(tmp_path / f.name, f, "sha256", ex.writers[0]) for f in the_plan.files]
    plain = [
        OutFile(
            tmp_path / ("plain-" + f.name),
            replace(f, tensors=list(f.tensors)),
            "sha256",
            ex.writers[0],
        )
        for f in the_plan.files
    ]
    try:
        fast = [(o.file.name, f, last) for o, f, last in ex._walk(planned, order)]
        slow = [(o.file.name, f, last) for o, f, last in ex._walk(plain, order)]
    finally:
        for o in planned + plain:
            os.close(o.fd)
    assert len(fast) == sum(len(f.tensors) for f in the_plan.files) > 100
    assert fast == slow
    # each fqn's targets are adjacent (what the engine's groups need), files end once each
    fqns = [f[0] for _, f, _ in fast]
    assert len({x for x in fqns}) == len(
        [x for i, x in enumerate(fqns) if i == 0 or x != fqns[i - 1]]
    )
    assert sum(last for _, _, last in fast) == len(the_plan.files)


@pytest.mark.parametrize("size", [1, 7, 4096, 2**16, 2**22])
def test_header_pieces_are_the_header(size: int) -> None:
    # what a writer thread writes, a piece at a time, is the header byte for byte
    import os
    import zlib

    from shardctl.checkpoint.plan_files import OutputFile

    raw = (b'{"a":{"dtype":"BF16"}}' * 9000) + os.urandom(70_000)
    f = OutputFile("f", len(raw), [], len(raw), header_z=zlib.compress(raw, 1))
    pieces = list(f.header_pieces(size))
    assert b"".join(pieces) == raw == f.header
    assert max(map(len, pieces)) <= max(size, 1)
    short = OutputFile("f", len(raw) + 1, [], len(raw), header_z=zlib.compress(raw, 1))
    with pytest.raises(AssertionError):
        list(short.header_pieces(size))
