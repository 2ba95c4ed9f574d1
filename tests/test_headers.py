"""The hardened safetensors header reader (reliability cases A1–A12, A17) and the header builder.

Every hostile case is a real file in ``tmp_path``, read through :func:`read_header`; each must
raise :class:`InvalidInputError` (exit 3) with a message naming the file.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save, save_file

from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import (
    HeaderEntry,
    SafetensorsHeader,
    header_bytes,
    read_header,
)


def _write(tmp_path: Path, header: str | bytes, data: bytes = b"", *, length: int | None = None,
           name: str = "x.safetensors") -> Path:  # fmt: skip
    raw = header.encode() if isinstance(header, str) else header
    path = tmp_path / name
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
    return path


def _t(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _refused(path: Path, *fragments: str) -> str:
    with pytest.raises(InvalidInputError) as info:
        read_header(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    assert info.value.exit_code == 3
    return msg


# ---- the good path ----------------------------------------------------------------------


def test_reads_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    save_file(
        {"b": np.zeros((2, 3), np.float32), "a": np.ones(5, np.float16), "z": np.zeros((0, 4))},
        path,
        metadata={"format": "pt"},
    )
    h = read_header(path)
    assert isinstance(h, SafetensorsHeader)
    assert h.metadata == {"format": "pt"}
    assert h.data_offset == 8 + h.header_len
    assert h.file_size == path.stat().st_size
    # file order: by offset; safetensors puts higher alignment first, then names.
    assert [(e.name, e.dtype, e.shape, e.nbytes) for e in h.tensors] == [
        ("z", "F64", (0, 4), 0),
        ("b", "F32", (2, 3), 24),
        ("a", "F16", (5,), 10),
    ]
    assert h.entry("a").end == h.file_size - h.data_offset


def test_empty_file_of_tensors(tmp_path: Path) -> None:
    h = read_header(_write(tmp_path, "{}"))
    assert h.tensors == () and h.metadata is None


# ---- A1–A4: sizes -------------------------------------------------------------------------


def test_a1_truncated_and_trailing(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"w": np.arange(16, dtype=np.float32)}, good)
    raw = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:-4])
    _refused(
        bad, "truncated or trailing bytes", f"header expects {len(raw)}", f"has {len(raw) - 4}"
    )
    bad.write_bytes(raw + b"junk")
    _refused(bad, f"header expects {len(raw)}", f"file has {len(raw) + 4}")


@pytest.mark.parametrize("size", [0, 1, 7])
def test_a2_too_small(tmp_path: Path, size: int) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x01" * size)
    _refused(path, "not a safetensors file (too small")


def test_a3_header_length_past_eof(tmp_path: Path) -> None:
    _refused(_write(tmp_path, "{}", length=1000), "runs past the end of the file")


@pytest.mark.parametrize("length", [100_000_000, 2**63, 2**64 - 1])
def test_a4_huge_length_refused_before_reading(
    tmp_path: Path, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused from the 8-byte length alone: no allocation, no read of the header itself
    (speed follows from that; bench/, not tests, measures time)."""
    path = _write(tmp_path, "{}", length=length)
    os.truncate(path, 200_000_000)  # sparse: the length is not also past EOF for 1e8
    requested: list[int] = []
    real_pread = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        requested.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    _refused(path, "header exceeds shardctl limit (16 MiB)", "--max-header-bytes")
    assert sum(requested) <= 8, requested


def test_a5_legal_but_huge_header_refused_fast(tmp_path: Path) -> None:
    """A 72 MB header is refused from its length alone: nothing is read or parsed."""
    path = _write(tmp_path, "{}", length=72_000_000)
    os.truncate(path, 8 + 72_000_000)
    _refused(path, "16 MiB")
    # ... and the limit is adjustable for trusted files:
    entries = [HeaderEntry(f"t{i}", "F32", (0,), 0, 0) for i in range(3)]
    small = tmp_path / "s.safetensors"
    small.write_bytes(header_bytes(entries))
    assert len(read_header(small, max_header_bytes=200).tensors) == 3
    with pytest.raises(InvalidInputError, match="shardctl limit"):
        read_header(small, max_header_bytes=64)


# ---- A6: not UTF-8 / JSON / an object -----------------------------------------------------


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b'{"a\xff": 1}', "not valid UTF-8"),
        (b'{"w": ', "not valid JSON"),
        (b"[1, 2]", "not a JSON object (got array)"),
        (b'"x"', "not a JSON object (got string)"),
        (b"{}\x00\x00\x00\x00\x00\x00", "NUL"),
        (b"\x00" * 8, "NUL"),
        (b"[" * 100_000 + b"]" * 100_000, ""),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, ""),
        (b'{"__metadata__": {"x": NaN}}', "non-finite"),
        (b'{"__metadata__": {"x": Infinity}}', "non-finite"),
        (b"\xef\xbb\xbf{}", "not valid JSON"),
    ],
    ids=["utf8", "json", "list", "string", "nul-pad", "all-nul", "deep-list", "deep-obj",
         "nan", "inf", "bom"],
)  # fmt: skip
def test_a6_bad_header_text(tmp_path: Path, header: bytes, fragment: str) -> None:
    _refused(_write(tmp_path, header), fragment)


# ---- A7, A8: duplicates -------------------------------------------------------------------


@pytest.mark.parametrize("second", [(0, 4), (4, 8)], ids=["same-values", "different-values"])
def test_a7_duplicate_tensor_name(tmp_path: Path, second: tuple[int, int]) -> None:
    t1 = json.dumps(_t("F32", [1], 0, 4))
    t2 = json.dumps(_t("F32", [1], *second))
    _refused(_write(tmp_path, f'{{"a": {t1}, "a": {t2}}}', b"\0" * 8), "duplicate tensor name 'a'")


def test_a8_duplicate_metadata(tmp_path: Path) -> None:
    header = '{"__metadata__": {"a": "1"}, "__metadata__": {"a": "2"}}'
    _refused(_write(tmp_path, header), "duplicate '__metadata__'")


def test_duplicate_fields_inside_entries(tmp_path: Path) -> None:
    header = '{"a": {"dtype": "F32", "dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}'
    _refused(_write(tmp_path, header, b"\0" * 4), "duplicate field 'dtype'")
    _refused(_write(tmp_path, '{"__metadata__": {"k": "1", "k": "2"}}'), "duplicate key 'k'")


@pytest.mark.parametrize("value", ['{"k": 1}', '{"k": null}', '["k"]', '"k"'])
def test_metadata_must_be_string_map(tmp_path: Path, value: str) -> None:
    _refused(_write(tmp_path, f'{{"__metadata__": {value}}}'), "__metadata__")


# ---- A9: offsets --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "data_len", "fragment"),
    [
        ({"a": _t("F32", [2], 0, 8), "b": _t("F32", [2], 4, 12)}, 12, "overlap"),
        ({"a": _t("F32", [2], 0, 8), "b": _t("F32", [2], 0, 8)}, 8, "overlap"),  # aliased
        ({"a": _t("F32", [1], 0, 4), "b": _t("F32", [1], 8, 12)}, 12, "gap"),
        ({"a": _t("F32", [1], 4, 8)}, 8, "gap"),  # data does not start at 0
        ({"a": _t("F32", [2], 0, 8)}, 4, "header expects"),  # past EOF
        ({"a": _t("F32", [1], 0, 4)}, 9, "trailing"),  # trailing garbage
        ({"a": _t("F32", [2], 0, 8), "z": _t("F32", [0], 4, 4)}, 8, "overlap"),  # inside another
    ],
    ids=["overlap", "aliased", "gap", "gap-at-start", "past-eof", "trailing", "zero-size-inside"],
)
def test_a9_offsets(tmp_path: Path, tensors: dict[str, object], data_len: int,
                    fragment: str) -> None:  # fmt: skip
    _refused(_write(tmp_path, json.dumps(tensors), b"\0" * data_len), fragment)


def test_a9_zero_size_tensors_may_share_an_offset(tmp_path: Path) -> None:
    tensors = {"a": _t("F32", [1], 0, 4), "e": _t("F32", [0, 4], 4, 4), "f": _t("BF16", [], 4, 6)}
    h = read_header(_write(tmp_path, json.dumps(tensors), b"\0" * 6))
    assert [e.name for e in h.tensors] == ["a", "e", "f"]
    assert h.entry("f").shape == ()


# ---- A10: entry contents ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("info", "data_len", "fragment"),
    [
        (_t("F32", [3], 0, 8), 8, "needs 12 bytes"),
        (_t("F32", [2**62, 2**62], 0, 8), 8, "needs"),  # shape overflow in 64-bit math
        (_t("F33", [2], 0, 8), 8, "unknown dtype 'F33'"),
        ({"dtype": 5, "shape": [2], "data_offsets": [0, 8]}, 8, "unknown dtype"),
        (_t("F32", [2], -8, 0), 8, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, 8, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [False, True]}, 8, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}, 8, "data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, 8, "end before"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, 8, "shape"),
        ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, 8, "shape"),
        ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, 8, "shape"),
        ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, 8, "shape"),
        ({"dtype": "F32", "data_offsets": [0, 8]}, 8, "missing 'shape'"),
        ({"shape": [2], "data_offsets": [0, 8]}, 8, "missing 'dtype'"),
        ({"dtype": "F32", "shape": [2]}, 8, "missing 'data_offsets'"),
        ([1, 2], 8, "expected an object"),
        (_t("F4", [3], 0, 2), 2, "needs 1.5 bytes"),
    ],
)
def test_a10_entries(tmp_path: Path, info: object, data_len: int, fragment: str) -> None:
    _refused(_write(tmp_path, json.dumps({"w": info}), b"\0" * data_len), fragment)


def test_a10_big_integer_literal(tmp_path: Path) -> None:
    header = '{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}'
    _refused(_write(tmp_path, header, b"\0" * 4), "not valid JSON")


# ---- A11: accepted like the library -----------------------------------------------------


def test_a11_accepted_like_safetensors(tmp_path: Path) -> None:
    # whitespace before '{', an unknown field, and an unaligned header length (len % 8 != 0)
    header = '  \n{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": [1]}}'
    assert len(header) % 8 != 0
    path = _write(tmp_path, header, b"\x00\x00\x80\x3f")
    h = read_header(path)
    assert h.tensors == (HeaderEntry("w", "F32", (1,), 0, 4),)
    with safe_open(path, framework="numpy") as f:  # the library agrees
        assert f.get_tensor("w").tolist() == [1.0]


# ---- A12: names ---------------------------------------------------------------------------


def test_a12_names(tmp_path: Path) -> None:
    _refused(_write(tmp_path, json.dumps({"": _t("F32", [1], 0, 4)}), b"\0" * 4), "empty tensor")
    reserved = json.dumps({"__metadata__": _t("F32", [1], 0, 4)})
    _refused(_write(tmp_path, reserved, b"\0" * 4), "reserves")
    # Path-like names are only names: accepted, never used as paths.
    h = read_header(_write(tmp_path, json.dumps({"../../etc/passwd": _t("U8", [1], 0, 1)}), b"x"))
    assert h.tensors[0].name == "../../etc/passwd"


# ---- A17: not a regular file ------------------------------------------------------------


def test_a17_fifo_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            read_header(fifo)
            result.append(None)
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)  # a hang guard, not a speed limit
    assert not thread.is_alive(), "read_header blocked on a FIFO"
    assert isinstance(result[0], InvalidInputError)
    assert "not a regular file (FIFO)" in str(result[0])


def test_a17_directory_and_device(tmp_path: Path) -> None:
    d = tmp_path / "d.safetensors"
    d.mkdir()
    _refused(d, "not a regular file (directory)")
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")
    _refused(link, "not a regular file (character device)")


def test_missing_file(tmp_path: Path) -> None:
    _refused(tmp_path / "nope.safetensors", "not found")


# ---- header_bytes: golden bytes and round trips -------------------------------------------

# 145 bytes of JSON + 7 spaces = 152 (0x98), a multiple of 8.
GOLDEN = (
    b"\x98\x00\x00\x00\x00\x00\x00\x00"
    b'{"__metadata__":{"format":"pt"},'
    b'"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
    b'"bb":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}'
    b"       "
)


def test_header_bytes_golden() -> None:
    entries = [HeaderEntry("a", "F32", (2, 2), 0, 16), HeaderEntry("bb", "BF16", (3,), 16, 22)]
    out = header_bytes(entries, {"format": "pt"})
    assert out == GOLDEN
    assert len(out) % 8 == 0


def test_header_bytes_equals_safetensors_own() -> None:
    """Byte for byte what safetensors writes (one metadata key: its map order is arbitrary)."""
    tensors = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "v": np.ones(3, dtype=np.float16),
        "é": np.zeros((0,), dtype=np.int64),
        "s": np.array(7, dtype=np.int8),
    }
    blob = save(tensors, metadata={"format": "pt"})
    n = int.from_bytes(blob[:8], "little")
    h = _parse_blob(blob, Path("mem"))
    assert header_bytes(h.tensors, h.metadata) == blob[: 8 + n]


def _parse_blob(blob: bytes, path: Path) -> SafetensorsHeader:
    from shardctl.io.safetensors_header import parse_header

    n = int.from_bytes(blob[:8], "little")
    return parse_header(blob[8 : 8 + n], path=path, file_size=len(blob))


def test_header_bytes_round_trip_through_safe_open(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"x.weight": rng.standard_normal((3, 5)).astype(np.float32),
              "x.bias": rng.standard_normal(5).astype(np.float16),
              "empty": np.zeros((0, 7), np.float32),
              "scalar": np.array(3, np.int64)}  # fmt: skip
    entries, cursor, data = [], 0, b""
    for name, a in arrays.items():
        raw = a.tobytes()
        dtype = {"float32": "F32", "float16": "F16", "int64": "I64"}[a.dtype.name]
        entries.append(HeaderEntry(name, dtype, a.shape, cursor, cursor + len(raw)))
        cursor += len(raw)
        data += raw
    path = tmp_path / "built.safetensors"
    path.write_bytes(header_bytes(entries, {"format": "pt", "shardctl": "1"}) + data)
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "shardctl": "1"}
        for name, a in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(name), a)
    h = read_header(path)
    assert h.tensors == tuple(entries)
    assert h.metadata == {"format": "pt", "shardctl": "1"}
