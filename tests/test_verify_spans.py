"""verify bitwise, spans (``shardctl/verify/bitwise/spans.py``): plain small tensors checked in
batches must reach exactly the verdicts, findings and byte counts of the per-block path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from shardctl.verify.bitwise import pipeline, spans
from tests._verify_fixtures import Checkpoints


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-spans"))


def _flip(path: Path, fqn: str, byte: int, bit: int) -> None:
    header = read_header(path)
    entry = next(e for e in header.tensors if e.name == fqn)
    at = header.data_offset + entry.begin + byte % entry.nbytes
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def _run(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch, *, on: bool):  # type: ignore[no-untyped-def]
    calls = []
    real = pipeline.compare_span

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(spans, "ENABLED", on)
    monkeypatch.setattr(pipeline, "compare_span", counted)
    result = verify(src, dst, level="bitwise")
    bw = result.level_result("bitwise")
    findings = sorted((f.message, f.fqn or "", f.rank or 0, f.file or "") for f in bw.findings)
    figures = {k: bw.figures[k] for k in ("tensors", "shards", "src_bytes", "dst_bytes")}
    return result.ok, findings, figures, bw.rows, len(calls)


def test_spans_match_the_block_path_clean_and_with_flips(
    cks: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = cks.ckpt("mixtral")
    dst = cks.resharded("mixtral", Mesh(ep=2, tp=2))
    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    assert ok and not findings and calls > 0
    ok0, findings0, figures0, rows0, calls0 = _run(src, dst, monkeypatch, on=False)
    assert ok0 and calls0 == 0 and figures == figures0 and rows == rows0
    # every tensor read once from SRC (spans read each plain tensor once, replicas or not)
    tensor_bytes = sum(e.nbytes for p in src.glob("*.safetensors") for e in read_header(p).tensors)
    assert figures["src_bytes"] == tensor_bytes
    # a clean span is settled by one memcmp against what the batch fills built from SRC, so
    # every way of filling (one strided copy, a gather, box by box) must build exactly DST
    slow = []
    real_compare = spans._compare_batch
    monkeypatch.setattr(spans, "_compare_batch", lambda *a: slow.append(1) or real_compare(*a))
    for direct in (0, 1 << 40):
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        assert _run(src, dst, monkeypatch, on=True)[0]
    assert not slow
    monkeypatch.setattr(spans, "_compare_batch", real_compare)

    # flips in expert halves (w1 S(0): contiguous; w2 S(1): strided in SRC), a replicated
    # norm, and two flips in one shard (counted together, the first named)
    rng = random.Random(3)
    files = sorted(p.name for p in dst.glob("rank-*.safetensors"))
    flipped = 0
    for name in files:
        header = read_header(dst / name)
        names = [e.name for e in header.tensors]
        for pick in ("w1.weight", "w2.weight", "post_attention_layernorm.weight"):
            fqn = next(n for n in names if n.endswith(pick))
            _flip(dst / name, fqn, rng.randrange(1 << 16), rng.randrange(8))
            flipped += 1
        fqn = [n for n in names if n.endswith("w3.weight")][-1]
        _flip(dst / name, fqn, 1, 0)
        _flip(dst / name, fqn, 300, 7)
        flipped += 1
    ok, findings, figures, rows, calls = _run(src, dst, monkeypatch, on=True)
    ok0, findings0, figures0, rows0, _ = _run(src, dst, monkeypatch, on=False)
    assert not ok and not ok0 and calls > 0
    assert findings == findings0  # same shards named, same counts, same first element
    assert figures == figures0 and rows == rows0
    # the batch fills of a span (strided gather; box by box): same verdicts either way
    for direct in (0, 1 << 40):
        monkeypatch.setattr(spans, "DIRECT_BYTES", direct)
        assert _run(src, dst, monkeypatch, on=True)[1] == findings
    named = [f for f in findings if f[1]]
    assert len(named) == flipped
    assert sum(f[0].startswith("2 of") for f in named) == len(files)
