"""Reliability groups A and C at the reshard level: hostile or broken inputs are refused
(exit 3) before anything is written; pickle only with the opt-in, only weights-only."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard

REPO = Path(__file__).resolve().parents[1]


def write_st(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    entries, cursor = [], 0
    for name, (dtype, shape, data) in tensors.items():
        entries.append(HeaderEntry(name, dtype, shape, cursor, cursor + len(data)))
        cursor += len(data)
    path.write_bytes(
        header_bytes(entries, {"format": "pt"}) + b"".join(d for _, _, d in tensors.values())
    )


def nothing_written(tmp_path: Path, dst: Path) -> None:
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.")]


def test_truncated_input_refused_before_writing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_st(src / "model.safetensors", {"a": ("F32", (4,), b"\1" * 16)})
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(InvalidInputError, match=r"truncated|past the end|tile"):
        reshard(src, tmp_path / "out", fmt="hf")
    nothing_written(tmp_path, tmp_path / "out")


def test_special_values_zero_size_and_scalars_pass_bitwise(tmp_path: Path) -> None:
    """A13/A14: NaN payloads, BOOL 0x02/0xFF, FP8 NaN codes, [0, 4] and [] pass unchanged."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "nan": ("F32", (2,), bytes.fromhex("0100c07f0000807f")),
        "bool": ("BOOL", (3,), b"\x00\x02\xff"),
        "fp8": ("F8_E4M3", (2,), b"\x7f\xff"),
        "empty": ("F32", (0, 4), b""),
        "scalar": ("BF16", (), b"\x80\x3f"),
    }
    write_st(src / "model.safetensors", tensors)
    reshard(src, tmp_path / "out", fmt="hf")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()


def test_path_escape_in_index_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_st(src / "model-00001-of-00001.safetensors", {"a": ("F32", (1,), b"\0" * 4)})
    (src / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a": "../../etc/passwd"}}'
    )
    with pytest.raises(InvalidInputError):
        reshard(src, tmp_path / "out", fmt="hf")
    nothing_written(tmp_path, tmp_path / "out")


def test_fifo_input_refused_quickly(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "model.safetensors")
    with pytest.raises(InvalidInputError, match="not a regular file"):
        reshard(src, tmp_path / "out", fmt="hf")


# ---- group C ------------------------------------------------------------------------------


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def torch():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torch")


def test_pickle_refused_without_opt_in(
    tmp_path: Path, torch, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": Evil(marker)}, src / "pytorch_model.bin")
    called = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(1))
    with pytest.raises(InvalidInputError, match="pickle input refused"):
        reshard(src, tmp_path / "out", fmt="hf")
    assert not called and not marker.exists()
    nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("legacy", [False, True])
def test_malicious_pickle_with_opt_in_still_refused(tmp_path: Path, torch, legacy: bool) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "pwned"
    torch.save(
        {"w": torch.ones(2), "x": Evil(marker)},
        src / "pytorch_model.bin",
        _use_new_zipfile_serialization=not legacy,
    )
    with pytest.raises(InvalidInputError, match="weights-only load failed"):
        reshard(src, tmp_path / "out", fmt="hf", allow_pickle=True)
    assert not marker.exists()
    nothing_written(tmp_path, tmp_path / "out")


def test_benign_pickle_with_non_tensor_global_refused(tmp_path: Path, torch) -> None:  # type: ignore[no-untyped-def]
    import argparse

    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1)}, src / "model.pt")
    with pytest.raises(
        InvalidInputError, match=r"weights-only load failed.*Namespace|Unsupported global"
    ):
        reshard(src, tmp_path / "out", fmt="hf", allow_pickle=True)


def test_benign_pickle_converts(tmp_path: Path, torch) -> None:  # type: ignore[no-untyped-def]
    from tests._models import make_checkpoint

    hf = make_checkpoint("llama", tmp_path / "hf")
    from safetensors.torch import load_file

    state = load_file(hf / "model.safetensors")
    src = tmp_path / "src"
    src.mkdir()
    torch.save(state, src / "pytorch_model.bin")
    (src / "config.json").write_bytes((hf / "config.json").read_bytes())
    reshard(src, tmp_path / "split", mesh=Mesh(tp=2), allow_pickle=True)
    reshard(tmp_path / "split", tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(state)
    for k in state:
        assert torch.equal(merged[k].view(torch.uint8), state[k].view(torch.uint8)), k
    assert (tmp_path / "merged" / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    assert not list((tmp_path / "split").glob(".pickle-input"))


def test_old_torch_refused(tmp_path: Path, torch, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "pytorch_model.bin")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(InvalidInputError, match=r"refusing pickle on torch <2\.6"):
        reshard(src, tmp_path / "out", fmt="hf", allow_pickle=True)
    nothing_written(tmp_path, tmp_path / "out")


def test_dcp_and_nemo_refused(tmp_path: Path) -> None:
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04N.")
    (dcp / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(InvalidInputError, match="DCP checkpoint refused"):
        reshard(dcp, tmp_path / "out", fmt="hf", allow_pickle=True)
    nemo = tmp_path / "m.nemo"
    nemo.write_bytes(b"")
    with pytest.raises(InvalidInputError, match=r"\.nemo archive refused"):
        reshard(nemo, tmp_path / "out2", fmt="hf", allow_pickle=True)


def test_no_weights_only_false_anywhere() -> None:
    """C2, statically: no call passes ``weights_only=False`` (or a non-literal) in shardctl."""
    for path in (REPO / "shardctl").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "weights_only":
                        assert isinstance(kw.value, ast.Constant) and kw.value.value is True, (
                            f"{path}:{node.lineno}"
                        )
                if (
                    getattr(node.func, "attr", None) == "load"
                    and getattr(getattr(node.func, "value", None), "id", "") == "torch"
                ):
                    assert any(kw.arg == "weights_only" for kw in node.keywords), (
                        f"{path}:{node.lineno}"
                    )
