"""Reliability cases A15/A16: a flipped bit or a zero-filled data region in an *input* whose
digest is known (a shardctl layout record, an HF-cache blob name) is exit 3 ``input hash
mismatch``, with nothing written and the input untouched; without a known digest the input is
accepted (only a hash can catch it — the README says so)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardctl.checkpoint.input_check import Expected, InputCheck
from shardctl.errors import InvalidInputError
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from tests._models import make_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("a15")
    src = make_checkpoint("llama", root / "llama")
    out = root / "tp2"
    reshard(src, out, mesh=Mesh(tp=2))
    return out


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def data_offset(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def first_tensor(path: Path) -> str:
    """The name of the tensor whose bytes come first in a safetensors file."""
    import json

    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return min(header, key=lambda k: header[k]["data_offsets"][0])


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", "reshard", *args, "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "SHARDCTL_DEBUG"},
    )


def refused(p: subprocess.CompletedProcess[str], dst: Path, what: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 3, p.stderr
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "input hash mismatch" in lines[0] and what in lines[0], lines[0]
    assert not dst.exists()
    assert not [q for q in dst.parent.iterdir() if q.name.startswith(f".{dst.name}.")]


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_bit_in_layout_input_is_exit_3(tp2: Path, tmp_path: Path, where: str) -> None:
    src = copy_dir(tp2, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[1]
    rng = random.Random(15)
    if where == "data":
        at = rng.randrange(data_offset(victim), victim.stat().st_size)
    else:  # a byte inside a header string value: still valid JSON, same shapes and offsets
        head = victim.read_bytes()[: data_offset(victim)]
        at = head.index(b'"format":"pt"') + len(b'"format":"p')
    flip(victim, at)
    before = digests(src)
    dst = tmp_path / "out"
    p = cli(str(src), str(dst), "--format", "hf")
    refused(p, dst, victim.name)
    assert "layout record" in p.stderr, f"seed 15, byte {at}"
    assert digests(src) == before  # the input is read, never written


def test_zero_filled_data_region_is_exit_3(tp2: Path, tmp_path: Path) -> None:
    """A16: header kept, data region a hole of zeros (sparse file of the same size)."""
    src = copy_dir(tp2, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[0]
    size, head = victim.stat().st_size, victim.read_bytes()[: data_offset(victim)]
    victim.write_bytes(head)
    os.truncate(victim, size)
    dst = tmp_path / "out"
    refused(cli(str(src), str(dst), "--tp", "1"), dst, victim.name)


def test_no_verify_input_skips_the_check(tp2: Path, tmp_path: Path) -> None:
    src = copy_dir(tp2, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[0]
    flip(victim, victim.stat().st_size - 1)
    dst = tmp_path / "out"
    p = cli(str(src), str(dst), "--format", "hf", "--no-verify-input")
    assert p.returncode == 0, p.stderr
    assert (dst / "model.safetensors").exists()


def test_intact_layout_input_passes_and_api_raises_invalid_input(tp2: Path, tmp_path: Path) -> None:
    reshard(tp2, tmp_path / "ok", fmt="hf")  # the fixture itself verifies
    src = copy_dir(tp2, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[0]
    flip(victim, data_offset(victim))
    with pytest.raises(InvalidInputError, match="input hash mismatch"):
        reshard(src, tmp_path / "bad", mesh=Mesh(tp=4))
    assert not (tmp_path / "bad").exists()


def _rewrite_record(src: Path, hash_name: str, rehash: bool) -> None:
    import json

    from shardctl.io.checksum import new_hash

    path = src / "shardctl.layout.json"
    rec = json.loads(path.read_text())
    rec["hash"] = hash_name
    if rehash:
        for f in rec["files"]:
            h = new_hash(hash_name)
            h.update((src / f["name"]).read_bytes())
            f["digest"] = h.hexdigest()
    path.write_text(json.dumps(rec))


@pytest.mark.parametrize("algo", ["blake3", "sha256"])
def test_layouts_with_other_recorded_hashes_are_checked(
    tp2: Path, tmp_path: Path, algo: str
) -> None:
    """Layouts written with BLAKE3 (before XXH3-128 was the default) or sha256 are checked too."""
    src = copy_dir(tp2, tmp_path / "src")
    _rewrite_record(src, algo, rehash=True)
    assert cli(str(src), str(tmp_path / "ok"), "--format", "hf").returncode == 0
    victim = sorted(src.glob("*.safetensors"))[0]
    flip(victim, data_offset(victim) + 1)
    dst = tmp_path / "bad"
    refused(cli(str(src), str(dst), "--format", "hf"), dst, victim.name)


def test_unknown_recorded_hash_is_exit_3(tp2: Path, tmp_path: Path) -> None:
    src = copy_dir(tp2, tmp_path / "src")
    _rewrite_record(src, "md4", rehash=False)
    dst = tmp_path / "out"
    p = cli(str(src), str(dst), "--format", "hf")
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "unknown checksum algorithm 'md4'" in lines[0] and "xxh3-128" in lines[0], lines[0]
    assert not dst.exists()


def hf_cache(hf: Path, cache: Path) -> Path:
    """An HF hub cache snapshot: LFS files are symlinks to ``blobs/<sha256>``."""
    blobs = cache / "models--t--tiny" / "blobs"
    snap = cache / "models--t--tiny" / "snapshots" / ("ab" * 20)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted(hf.iterdir()):
        data = p.read_bytes()
        if p.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:  # small files are git blobs, named by their sha1-based git oid
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / name).write_bytes(data)
        (snap / p.name).symlink_to(Path("../../blobs") / name)
    return snap


def test_hf_cache_blob_sha256_checked(tmp_path: Path) -> None:
    hf = make_checkpoint("qwen2", tmp_path / "qwen2")
    snap = hf_cache(hf, tmp_path / "cache")
    ok = tmp_path / "ok"
    assert cli(str(snap), str(ok), "--tp", "2").returncode == 0
    blob = (snap / "model.safetensors").resolve()
    flip(blob, blob.stat().st_size // 2)
    dst = tmp_path / "out"
    p = cli(str(snap), str(dst), "--tp", "2")
    refused(p, dst, "model.safetensors")
    assert "HF-cache blob name" in p.stderr


def test_plain_hf_input_without_digest_is_accepted(tmp_path: Path) -> None:
    """Documented limit: a bit flip in a plain HF directory (no digest anywhere) goes through."""
    hf = make_checkpoint("llama", tmp_path / "llama")
    w = hf / "model.safetensors"
    flip(w, w.stat().st_size - 1)
    assert cli(str(hf), str(tmp_path / "out"), "--tp", "2").returncode == 0


# -- the input hashes fed from the copy's own reads ------------------------------------------------


def _expected(path: Path) -> Expected:
    return Expected(path, path.stat().st_size, "xxh3-128", _xxh(path.read_bytes()), "the test")


def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _reads(check: InputCheck, path: Path, spans: list[tuple[int, int]]) -> None:
    data = path.read_bytes()
    for lo, hi in spans:
        check.take(path, lo, memoryview(data)[lo:hi])


def whole_file_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files ``input_check`` hashes whole from here on (a second read of each), in order."""
    from shardctl.checkpoint import input_check

    whole: list[Path] = []
    real = input_check.hash_file

    def spy(path: Path, *args: Any) -> str | None:
        whole.append(path)
        return real(path, *args)

    monkeypatch.setattr(input_check, "hash_file", spy)
    return whole


def test_in_order_reads_feed_the_hash_without_a_second_read(
    tp2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    whole = whole_file_hashes(monkeypatch)
    path = sorted(tp2.glob("*.safetensors"))[0]
    size, start = path.stat().st_size, data_offset(path)
    check = InputCheck([_expected(path)]).start()
    # the header (a gap, read on the spot), a read twice, an overlap, and a tail left unread
    third = start + (size - start) // 3
    _reads(check, path, [(start, third), (start, third), (third - 7, size - 5)])
    check.result()
    assert path in check.feeds and whole == []


def test_out_of_order_reads_hand_the_file_to_the_thread(
    tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardctl.checkpoint import input_check

    monkeypatch.setattr(input_check, "GAP_MAX", 16)
    src = copy_dir(tp2, tmp_path / "src")
    good, bad = sorted(src.glob("*.safetensors"))[:2]
    unread = src / "config.json"
    files = [_expected(good), _expected(bad), _expected(unread)]
    flip(bad, bad.stat().st_size - 3)  # after the digests were taken
    check = InputCheck(files).start()
    for path in (good, bad):
        size, start = path.stat().st_size, data_offset(path)
        a, b = start + (size - start) // 3, start + 2 * (size - start) // 3
        # the first third, then the last (a big gap after the first read), then the middle
        _reads(check, path, [(start, a), (b, size), (a, b)])
    assert list(check.feeds) == [unread]  # both handed off; the unread one goes at result()
    with pytest.raises(InvalidInputError, match="input hash mismatch") as err:
        check.result()
    assert bad.name in str(err.value.where)


def test_a_gap_before_the_first_read_is_read_on_the_spot(
    tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge of an ``--ep`` split takes the replicas at the front of ranks 1..n's files from
    rank 0: their first read is far into the file, yet the rest is read in order. That gap is
    hashed on the spot (once), not by a second read of the whole file; a flip in it is caught."""
    from shardctl.checkpoint import input_check

    monkeypatch.setattr(input_check, "GAP_MAX", 16)
    whole = whole_file_hashes(monkeypatch)
    src = copy_dir(tp2, tmp_path / "src")
    good, bad = sorted(src.glob("*.safetensors"))[:2]
    files = [_expected(good), _expected(bad)]
    flip(bad, data_offset(bad) + 1)  # in the skipped front, after the digests were taken
    check = InputCheck(files).start()
    for path in (good, bad):
        size, start = path.stat().st_size, data_offset(path)
        half = (start + size) // 2
        _reads(check, path, [(half, size), (start, half)])  # the front is never read by the copy
    assert set(check.feeds) == {good, bad}  # neither handed off
    with pytest.raises(InvalidInputError, match="input hash mismatch") as err:
        check.result()
    assert bad.name in str(err.value.where) and whole == []


def test_reshard_merge_reads_its_input_once(
    tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge (and a flipped bit it must still catch) without a second read of any input."""

    whole = whole_file_hashes(monkeypatch)
    reshard(tp2, tmp_path / "ok", fmt="hf")
    src = copy_dir(tp2, tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[1]
    flip(victim, victim.stat().st_size - 1)  # the last byte: the last read of the file
    with pytest.raises(InvalidInputError, match="input hash mismatch"):
        reshard(src, tmp_path / "bad", fmt="hf")
    assert whole == [] and not (tmp_path / "bad").exists()


def test_merging_an_ep_split_reads_each_rank_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merging an ``--ep`` split to HF: ranks 1..n's files begin with the replicated tensors,
    which the merge takes from rank 0. The front is hashed on the spot, so no rank file is read
    a second time, and a flip in a rank-1 replica the merge never copies still fails the run.

    ``GAP_MAX`` is set between one layer's replicas (attention and norms, a few KB, skipped
    after the first read) and the front (embeddings of a 4,096 vocabulary, ~256 KB)."""
    from shardctl.checkpoint import input_check

    moe = make_checkpoint(
        "mixtral",
        tmp_path / "moe",
        hidden_size=16,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        vocab_size=4096,
    )
    split = reshard(moe, tmp_path / "ep2", mesh=Mesh(ep=2)).dst
    monkeypatch.setattr(input_check, "GAP_MAX", 64 * 1024)
    whole = whole_file_hashes(monkeypatch)
    reshard(split, tmp_path / "hf", fmt="hf")
    assert whole == []
    src = copy_dir(split, tmp_path / "src")
    rank1 = src / "rank-00001-of-00002.safetensors"
    front = first_tensor(rank1)
    assert front == first_tensor(src / "rank-00000-of-00002.safetensors")  # replicated
    flip(rank1, data_offset(rank1) + 1)  # in rank 1's replica of it, which rank 0 supplies
    with pytest.raises(InvalidInputError, match="input hash mismatch"):
        reshard(src, tmp_path / "bad", fmt="hf")
    assert whole == [] and not (tmp_path / "bad").exists()
