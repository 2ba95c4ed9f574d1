"""The checkpoint directory reader: index validation, path safety, discrepancies, carried files.

Reliability cases B1–B6 and A19, on real checkpoints written by ``save_pretrained`` and then
edited. Each refusal is an :class:`InvalidInputError` (exit 3) with one line naming the place.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardctl.checkpoint.hf import (
    IndexMismatch,
    PickleInputRefused,
    open_checkpoint,
)
from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from tests._models import make_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("src") / "m", max_shard_size="20KB")


@pytest.fixture(scope="module")
def single_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2-tied", tmp_path_factory.mktemp("src1") / "m")


@pytest.fixture
def sharded(sharded_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sharded_src, tmp_path / "ck"))


@pytest.fixture
def single(single_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(single_src, tmp_path / "ck"))


def _edit_index(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads((root / INDEX).read_text())
    edit(data)
    (root / INDEX).write_text(json.dumps(data))


def _refused(root: Path, *fragments: str, **kwargs: Any) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        open_checkpoint(root, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    assert info.value.exit_code == 3
    for f in fragments:
        assert f in msg, msg
    return info.value


@pytest.fixture
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path passed to os.open / open while the test runs."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def spy_os_open(path: Any, *a: Any, **k: Any) -> int:
        seen.append(os.fspath(path))
        return real_os_open(path, *a, **k)

    def spy_open(path: Any, *a: Any, **k: Any) -> Any:
        if isinstance(path, (str, os.PathLike)):
            seen.append(os.fspath(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    yield seen


# ---- good inputs ------------------------------------------------------------------------


def test_sharded_checkpoint(sharded: Path) -> None:
    ck = open_checkpoint(sharded)
    index = json.loads((sharded / INDEX).read_text())
    assert ck.kind == "hf"
    assert [h.path.name for h in ck.files] == sorted(set(index["weight_map"].values()))
    assert set(ck.locations) == set(index["weight_map"])
    for fqn, loc in ck.locations.items():
        assert loc.path.name == index["weight_map"][fqn]
        assert loc.file_offset == loc.file.data_offset + loc.entry.begin
    assert ck.index_metadata == index["metadata"]
    assert ck.total_bytes == index["metadata"]["total_size"]  # transformers 5.23: exact bytes
    assert ck.warnings == ()
    assert ck.extra_files == (Path("config.json"), Path("generation_config.json"))


def test_locations_read_the_right_bytes(single: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    ck = open_checkpoint(single)
    with (
        safe_open(single / "model.safetensors", framework="pt") as f,
        open(single / "model.safetensors", "rb") as raw,
    ):
        for fqn, loc in ck.locations.items():
            raw.seek(loc.file_offset)
            expected = f.get_tensor(fqn).contiguous().view(torch.uint8).numpy().tobytes()
            assert raw.read(loc.entry.nbytes) == expected, fqn


def test_hf_shards_read_the_right_bytes_in_every_file(sharded: Path) -> None:
    """The source's shard map of a many-file checkpoint (``HfShards``, kept as the headers'
    columns): every tensor's file, first byte, dtype and shape are where safetensors reads
    that tensor, one by one (``whole``, the built shard) and many at once (``wholes``)."""
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    from shardctl.checkpoint.source import HfShards, open_source
    from shardctl.dtypes import DTYPE_BITS

    source = open_source(sharded)
    shards = source.shards
    assert isinstance(shards, HfShards)
    ck = open_checkpoint(sharded)
    assert len(ck.files) > 3
    assert list(shards) == list(ck.locations)  # file, then offset order
    assert len(shards) == len(ck.locations) and "no.such.tensor" not in shards
    names = list(shards)
    many = shards.wholes(names)
    assert many is not None
    assert list(zip(*many, strict=True)) == [shards.whole(n) for n in names]
    assert shards.wholes([names[0], "no.such.tensor"]) is None
    assert shards.whole("no.such.tensor") is None
    for fqn in names:
        file, begin, dtype, shape = shards.whole(fqn)  # type: ignore[misc]
        (built,) = shards[fqn]
        assert (built.file, built.begin, built.dtype, built.local_shape) == (
            file,
            begin,
            dtype,
            shape,
        )
        path = source.files[file].path
        with safe_open(path, framework="pt") as f, open(path, "rb") as raw:
            tensor = f.get_tensor(fqn)
            raw.seek(begin)
            got = raw.read(math.prod(shape) * DTYPE_BITS[dtype] // 8)
        assert tuple(tensor.shape) == shape, fqn
        assert got == tensor.contiguous().view(torch.uint8).numpy().tobytes(), fqn


def test_carried_and_ignored_files(single: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md"):
        (single / name).write_text("{}")
    (single / "original").mkdir()
    (single / "original" / "consolidated.00.pth").write_bytes(b"x")
    (single / ".gitattributes").write_text("*")
    (single / "pytorch_model.bin").write_bytes(b"pickle")
    (single / "consolidated.safetensors").write_bytes(b"not even read")
    os.mkfifo(single / "weird.txt")
    ck = open_checkpoint(single)
    assert [h.path.name for h in ck.files] == ["model.safetensors"]
    assert ck.extra_files == tuple(
        Path(n)
        for n in (
            "README.md",
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        )
    )
    ignored = dict(ck.ignored)
    assert set(ignored) == {
        Path(n)
        for n in (
            ".gitattributes",
            "consolidated.safetensors",
            "original",
            "pytorch_model.bin",
            "weird.txt",
        )
    }
    assert ignored[Path("original")] == "subdirectory"
    assert ck.pickle_files == (Path("pytorch_model.bin"),)


def test_single_file_path(single: Path) -> None:
    ck = open_checkpoint(single / "model.safetensors")
    assert len(ck.files) == 1 and ck.locations


def test_shardctl_layout_is_reported(tmp_path: Path) -> None:
    (tmp_path / "shardctl.layout.json").write_text("{}")
    ck = open_checkpoint(tmp_path)
    assert ck.kind == "shardctl"
    assert ck.layout_record == tmp_path / "shardctl.layout.json"


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    _refused(tmp_path, "no safetensors weights found")
    _refused(tmp_path / "missing", "checkpoint not found")


def test_pickle_only_is_refused_with_a_hook(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02 evil")
    (tmp_path / "config.json").write_text("{}")
    err = _refused(tmp_path, "pickle input refused", "--allow-pickle")
    assert isinstance(err, PickleInputRefused)
    assert err.files == (Path("pytorch_model.bin"),)


def test_several_safetensors_without_index(single: Path) -> None:
    os.rename(single / "model.safetensors", single / "a.safetensors")
    shutil.copy(single / "a.safetensors", single / "b.safetensors")
    _refused(single, "2 safetensors files and no model.safetensors.index.json")
    os.remove(single / "b.safetensors")
    assert open_checkpoint(single).files[0].path.name == "a.safetensors"


# ---- B1–B4: weight_map paths ------------------------------------------------------------

UNSAFE = [
    ("../../etc/passwd", "unsafe path"),
    ("../outside.safetensors", "unsafe path"),
    ("/etc/passwd", "unsafe path"),
    ("/tmp/x.safetensors", "unsafe path"),
    ("sub/../../x.safetensors", "unsafe path"),
    ("..\\..\\x.safetensors", "backslash"),
    ("C:x.safetensors", "drive"),
    ("C:/x.safetensors", "drive"),
    ("", "empty path"),
    (".", "unsafe path"),
    ("./model.safetensors", "unsafe path"),
    ("a//b.safetensors", "unsafe path"),
    ("a\x00.safetensors", "NUL"),
    ("evil.bin", "index references non-safetensors file 'evil.bin'"),
    ("model.safetensors.bak", "non-safetensors"),
]


@pytest.mark.parametrize(("value", "fragment"), UNSAFE, ids=[repr(v) for v, _ in UNSAFE])
def test_b1_b4_unsafe_weight_map_paths(
    sharded: Path, value: str, fragment: str, opened_paths: list[str]
) -> None:
    (sharded.parent / "outside.safetensors").write_bytes(b"x" * 16)
    (sharded / "evil.bin").write_bytes(b"\x80\x02 evil pickle")

    def edit(d: dict[str, Any]) -> None:
        d["weight_map"]["model.norm.weight"] = value

    _edit_index(sharded, edit)
    opened_paths.clear()
    _refused(sharded, fragment, "model.norm.weight")
    root = os.path.realpath(sharded)
    assert all(os.path.realpath(p).startswith(root + os.sep) for p in opened_paths), opened_paths
    assert not any(p.endswith((".bin", "outside.safetensors")) for p in opened_paths)


def test_b1_weight_map_escaping_through_a_symlinked_dir(sharded: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(sharded / "model-00001-of-00020.safetensors", outside / "x.safetensors")
    (sharded / "sub").symlink_to(outside)

    def edit(d: dict[str, Any]) -> None:
        d["weight_map"]["model.embed_tokens.weight"] = "sub/x.safetensors"

    _edit_index(sharded, edit)
    _refused(sharded, "outside the checkpoint directory", "--follow-external-symlinks")


# ---- B5: strict index JSON --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"metadata": {"total_size": NaN}, "weight_map": {}}', "non-finite"),
        ('{"metadata": {"total_size": 1e400}, "weight_map": {}}', "infinity"),
        ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "duplicate key 'a'"),
        ('{"weight_map": {"a": 1}}', "expected a file name, got int"),
        ('{"weight_map": {"a": null}}', "expected a file name"),
        ('{"weight_map": {"a": ["x.safetensors"]}}', "expected a file name"),
        ('{"weight_map": []}', "no 'weight_map' object"),
        ("[]", "not a JSON object"),
        ('{"weight_map": {', "not strict JSON"),
        ("[" * 100_000, ""),
    ],
)
def test_b5_strict_index(sharded: Path, text: str, fragment: str) -> None:
    (sharded / INDEX).write_text(text)
    _refused(sharded, fragment)


def test_b5_index_size_cap(sharded: Path) -> None:
    with open(sharded / INDEX, "ab") as f:
        f.truncate(10 * 2**20 + 1)
    _refused(sharded, "above the 10 MiB limit")


# ---- B6: symlinks -----------------------------------------------------------------------


def test_b6_symlink_outside_root(sharded: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shard = "model-00003-of-00020.safetensors"
    os.rename(sharded / shard, other / shard)
    (sharded / shard).symlink_to(other / shard)
    _refused(sharded, "outside the checkpoint directory", shard)
    ck = open_checkpoint(sharded, follow_external_symlinks=True)
    assert shard in {h.path.name for h in ck.files}


def test_b6_symlink_to_dev_zero(sharded: Path) -> None:
    shard = "model-00003-of-00020.safetensors"
    os.remove(sharded / shard)
    (sharded / shard).symlink_to("/dev/zero")
    _refused(sharded, "outside the checkpoint directory")
    _refused(sharded, "not a regular file", follow_external_symlinks=True)


def test_b6_carried_file_symlink_outside_root(single: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    (single / "tokenizer.json").symlink_to(secret)
    _refused(single, "'tokenizer.json' resolves to", "outside")


def test_b6_symlink_inside_root_is_fine(single: Path) -> None:
    (single / "store").mkdir()
    os.rename(single / "model.safetensors", single / "store" / "w.safetensors")
    (single / "model.safetensors").symlink_to("store/w.safetensors")
    assert open_checkpoint(single).files[0].path == single / "model.safetensors"


def _hf_cache(src: Path, repo: Path) -> Path:
    """The HF hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i:04d}")
        (snap / f.name).symlink_to(f"../../blobs/blob{i:04d}")
    return snap


def test_b6_hf_cache_layout_is_allowed(sharded_src: Path, tmp_path: Path) -> None:
    snap = _hf_cache(sharded_src, tmp_path / "models--x--y")
    ck = open_checkpoint(snap)
    assert len(ck.files) == 20 and ck.extra_files == (
        Path("config.json"),
        Path("generation_config.json"),
    )


def test_b6_blobs_of_another_layout_are_not(sharded_src: Path, tmp_path: Path) -> None:
    # Same shape, but the directory is not named "snapshots": no cache exemption.
    snap = _hf_cache(sharded_src, tmp_path / "models--x--y")
    fake = tmp_path / "models--x--y" / "nots" / "abc"
    fake.parent.mkdir()
    os.rename(snap, fake)
    _refused(fake, "outside the checkpoint directory")


# ---- A19: index and shards disagree ------------------------------------------------------


def test_a19_every_discrepancy_listed(sharded: Path) -> None:
    # 1. the index names a tensor no shard has
    # 2. a shard holds a tensor the index does not name (orphan)
    # 3. a tensor in two shards
    # 4. an unreferenced shard of the series
    # 5. the index points a tensor at the wrong shard
    extra = header_bytes([HeaderEntry("model.norm.weight", "BF16", (64,), 0, 128)]) + bytes(128)
    (sharded / "model-00021-of-00021.safetensors").write_bytes(extra)
    shutil.copy(
        sharded / "model-00001-of-00020.safetensors", sharded / "model-00022-of-00020.safetensors"
    )

    def edit(d: dict[str, Any]) -> None:
        wm = d["weight_map"]
        wm["model.ghost.weight"] = "model-00001-of-00020.safetensors"
        del wm["model.layers.0.self_attn.q_proj.weight"]
        wm["model.layers.1.mlp.up_proj.weight"] = "model-00002-of-00020.safetensors"
        wm["lm_head.weight"] = "model-00021-of-00021.safetensors"  # its file holds norm too

    _edit_index(sharded, edit)
    err = _refused(sharded, "index and shards disagree (8)", "'model.ghost.weight'")
    assert isinstance(err, IndexMismatch)
    assert sorted(err.discrepancies) == sorted(
        [
            "'model.layers.0.self_attn.q_proj.weight' is in model-00002-of-00020.safetensors"
            " but not in the index",
            "'model.norm.weight' is in both model-00020-of-00020.safetensors"
            " and model-00021-of-00021.safetensors",
            "'lm_head.weight': the index says model-00021-of-00021.safetensors,"
            " which has no such tensor",
            "'model.layers.1.mlp.up_proj.weight': the index says"
            " model-00002-of-00020.safetensors, which has no such tensor",
            "'model.ghost.weight': the index says model-00001-of-00020.safetensors,"
            " which has no such tensor",
            # up_proj's and lm_head's real shards are now referenced by nobody
            "shard model-00008-of-00020.safetensors is not referenced by the index",
            "shard model-00019-of-00020.safetensors is not referenced by the index",
            "shard model-00022-of-00020.safetensors is not referenced by the index",
        ]
    )


def test_a19_missing_shard_file(sharded: Path) -> None:
    os.remove(sharded / "model-00007-of-00020.safetensors")
    _refused(sharded, "shard model-00007-of-00020.safetensors is listed in the index but missing")


def test_a19_wrong_total_size_is_a_warning(sharded: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["metadata"]["total_size"] += 2

    _edit_index(sharded, edit)
    ck = open_checkpoint(sharded)
    assert len(ck.warnings) == 1
    assert "metadata.total_size" in ck.warnings[0] and "ignored" in ck.warnings[0]


def test_a19_truncated_shard(sharded: Path) -> None:
    shard = sharded / "model-00005-of-00020.safetensors"
    os.truncate(shard, shard.stat().st_size - 4)
    _refused(sharded, str(shard), "truncated or trailing bytes")


def test_shardctl_hf_output_read_as_hf(single: Path) -> None:
    from shardctl.model.inventory import from_checkpoint

    (single / "shardctl.layout.json").write_text("{}")
    assert open_checkpoint(single).kind == "shardctl"
    ck = open_checkpoint(single, ignore_layout_record=True)
    assert ck.kind == "hf" and ck.layout_record == single / "shardctl.layout.json"
    assert Path("shardctl.layout.json") in dict(ck.ignored)
    assert Path("shardctl.layout.json") not in ck.extra_files
    assert from_checkpoint(single).tensors  # plan/inspect on an HF-format output
