"""verify's structure and bitwise levels; reliability group G; the negative tests and their level.

Each negative case asserts *which* level catches it (and that the earlier levels pass where the
layout is self-consistent): a layout that splits and merges consistently but computes wrongly
must pass bitwise and fail forward.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardctl.errors import EnvironmentFailure, InvalidInputError, UsageError
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from shardctl.verify.result import SCHEMA
from tests._verify_fixtures import Checkpoints


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-levels"))


def _statuses(result) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {lv.name: lv.status for lv in result.levels}


def _flip_bit(path: Path, fqn: str, *, seed: int = 0, byte: int | None = None) -> None:
    header = read_header(path)
    entry = next(e for e in header.tensors if e.name == fqn)
    rng = random.Random(seed)
    k = byte if byte is not None else rng.randrange(entry.nbytes)
    at = header.data_offset + entry.begin + k
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << rng.randrange(8))]))


def _rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)


def test_resharded_llama_passes_structure_and_bitwise(cks: Checkpoints) -> None:
    dst = cks.resharded("llama", Mesh(pp=2, tp=2))
    result = verify(cks.ckpt("llama"), dst, level="bitwise")
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    assert _statuses(result) == {"structure": "pass", "bitwise": "pass", "forward": "not-run"}
    bw = result.level_result("bitwise").figures
    # each byte read once: SRC's tensors once (norms are replicated in DST, read once in SRC),
    # every DST shard once
    src_tensors = sum(
        e.nbytes for p in cks.ckpt("llama").glob("*.safetensors") for e in read_header(p).tensors
    )
    dst_shards = sum(r["bytes"] for r in result.level_result("bitwise").rows)
    assert bw["src_bytes"] == src_tensors and bw["dst_bytes"] == dst_shards > src_tensors
    assert bw["hash"] == "xxh3-128"
    data = result.to_json()
    assert data["schema"] == SCHEMA and data["ok"] is True
    json.dumps(data)  # serializable


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("gpt2", Mesh(tp=4)),
        ("mixtral", Mesh(ep=2, tp=2)),
        ("phi3", Mesh(tp=4)),
        ("qwen2-tied", Mesh(pp=2, tp=2)),
    ],
)
def test_bitwise_passes_across_architectures(cks: Checkpoints, name: str, mesh: Mesh) -> None:
    result = verify(cks.ckpt(name), cks.resharded(name, mesh), level="bitwise")
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]


def test_g1_one_flipped_bit_fails_bitwise_naming_file_and_tensor(cks: Checkpoints) -> None:
    dst = cks.resharded("llama", Mesh(tp=2))
    fqn = "model.layers.1.mlp.down_proj.weight"
    _flip_bit(dst / "rank-00001-of-00002.safetensors", fqn, seed=7)
    result = verify(cks.ckpt("llama"), dst, level="bitwise")
    assert not result.ok
    assert _statuses(result)["structure"] == "pass"
    bw = result.level_result("bitwise")
    assert bw.status == "fail"
    hit = [f for f in bw.findings if f.fqn == fqn]
    assert hit and hit[0].file == "rank-00001-of-00002.safetensors" and hit[0].rank == 1
    assert "1 of" in hit[0].message
    assert any("differs from the record" in f.message for f in bw.findings)


def _nan_and_zeros(tensors: dict[str, torch.Tensor]) -> None:
    w = tensors["model.layers.0.self_attn.q_proj.weight"]
    raw = w.view(torch.int16)
    raw[0, 0] = 0x7FC1  # a quiet NaN with a payload
    raw[0, 1] = 0x7F81  # a signalling-pattern NaN
    raw[0, 2] = -0x8000  # -0.0 (sign bit only)
    raw[0, 3] = 0  # +0.0


def test_g2_nan_payloads_pass_and_a_sign_bit_flip_fails(cks: Checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(cks.ckpt("llama"), src)
    _rewrite(src / "model.safetensors", _nan_and_zeros)
    from shardctl.reshard.api import reshard

    dst = tmp_path / "dst"
    reshard(src, dst, mesh=Mesh(tp=2))
    assert verify(src, dst, level="bitwise").ok  # NaN == NaN bit for bit
    # -0.0 -> +0.0 on rank 0 (q_proj is S(0): row 0 lives there): equal as floats, not as bits.
    path = dst / "rank-00000-of-00002.safetensors"
    header = read_header(path)
    e = next(e for e in header.tensors if e.name == "model.layers.0.self_attn.q_proj.weight")
    with open(path, "r+b") as f:
        f.seek(header.data_offset + e.begin + 2 * 2 + 1)  # element [0, 2], high byte
        f.write(b"\x00")
    result = verify(src, dst, level="bitwise")
    assert not result.ok
    (finding,) = [f for f in result.level_result("bitwise").findings if f.fqn]
    assert "0x0000, source 0x8000" in finding.message and "[0, 2]" in finding.message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_g3_bf16_fp8_compared_as_integers(tmp_path: Path, dtype: torch.dtype) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(32, 16, generator=g).to(dtype)
    save_file({"w": t, "b": torch.randn(16, generator=g).to(dtype)}, str(src / "model.safetensors"))
    shutil.copytree(src, dst)
    assert verify(src, dst, level="bitwise").ok
    _flip_bit(dst / "model.safetensors", "w", seed=3)
    result = verify(src, dst, level="bitwise")
    assert not result.ok
    assert result.level_result("bitwise").findings[0].fqn == "w"


def test_g4_missing_extra_renamed_dtype_and_reshape_fail_structure(cks: Checkpoints) -> None:
    dst = cks.resharded("llama", Mesh(tp=2))
    path = dst / "rank-00000-of-00002.safetensors"

    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.0.input_layernorm.weight"]  # missing
        t["model.layers.0.extra.weight"] = torch.zeros(4)  # extra
        t["model.layers.1.mlp.UP.weight"] = t.pop("model.layers.1.mlp.up_proj.weight")  # renamed
        q = "model.layers.2.self_attn.q_proj.weight"
        t[q] = t[q].view(torch.float16)  # dtype changed, same shape and bytes
        k = "model.layers.3.self_attn.k_proj.weight"
        t[k] = t[k].reshape(-1)  # same bytes, another shape

    _rewrite(path, edit)
    result = verify(cks.ckpt("llama"), dst, level="bitwise")
    st = result.level_result("structure")
    assert st.status == "fail" and _statuses(result)["bitwise"] == "not-run"
    text = "\n".join(str(f) for f in st.findings)
    assert "model.layers.0.input_layernorm.weight, rank 0" in text and "missing" in text
    assert "model.layers.0.extra.weight" in text and "not in the record" in text
    assert "model.layers.1.mlp.UP.weight" in text
    assert "F16, the record says [32, 64] BF16" in text
    assert "model.layers.3.self_attn.k_proj.weight" in text


def test_g5_swapped_rank_files_fail_structure_and_bitwise(cks: Checkpoints) -> None:
    dst = cks.resharded("llama", Mesh(tp=2))
    a, b = dst / "rank-00000-of-00002.safetensors", dst / "rank-00001-of-00002.safetensors"
    tmp = dst / "swap.tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    result = verify(cks.ckpt("llama"), dst, level="bitwise")
    assert not result.ok
    st = result.level_result("structure")
    assert st.status == "fail"
    assert any("swapped" in f.message and f.file == a.name for f in st.findings)


def test_g5_swapped_rank_files_without_metadata_fail_bitwise(cks: Checkpoints) -> None:
    # Hand-split files carry no per-file metadata: only data and the record's hashes tell.
    dst = cks.hand_split("llama", Mesh(tp=2))
    work = dst.parent / "swap-nometa"
    shutil.copytree(dst, work)
    a, b = work / "rank00000.safetensors", work / "rank00001.safetensors"
    tmp = work / "swap.tmp"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    result = verify(cks.ckpt("llama"), work, level="bitwise")
    assert _statuses(result)["structure"] == "pass"
    bw = result.level_result("bitwise")
    assert bw.status == "fail"
    assert any(f.rank == 0 and f.fqn for f in bw.findings)
    assert any("differs from the record" in f.message for f in bw.findings)


def test_g6_original_changed_after_reshard_is_reported_distinctly(
    cks: Checkpoints, tmp_path: Path
) -> None:
    from shardctl.reshard.api import reshard

    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(cks.ckpt("llama"), src)
    reshard(src, dst, mesh=Mesh(tp=2))
    _flip_bit(src / "model.safetensors", "model.norm.weight", seed=1)
    result = verify(src, dst, level="bitwise")
    assert not result.ok
    st = result.level_result("structure")
    assert st.figures["source_identity"].startswith("original changed since reshard")
    bw = result.level_result("bitwise")
    assert any("original changed since reshard" in f.message for f in bw.findings)
    assert any(f.fqn == "model.norm.weight" for f in bw.findings)


def test_missing_expert_fails_structure(cks: Checkpoints) -> None:
    result = verify(cks.ckpt("mixtral"), cks.hand_split("mixtral", Mesh(ep=2), "drop-expert"))
    assert _statuses(result) == {"structure": "fail", "bitwise": "not-run", "forward": "not-run"}
    text = [str(f) for f in result.level_result("structure").findings]
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight: no rank holds it" in text


def test_padding_must_be_zero(cks: Checkpoints) -> None:
    dst = cks.resharded("gpt2", Mesh(tp=4))  # vocab 250 -> padded to 252
    last = dst / "rank-00003-of-00004.safetensors"
    _rewrite(last, lambda t: t["transformer.wte.weight"][-1].fill_(1.0))
    result = verify(cks.ckpt("gpt2"), dst, level="bitwise")
    assert any("padding not zero" in f.message for f in result.level_result("bitwise").findings)


def test_hf_output_of_a_merge_verifies(cks: Checkpoints) -> None:
    from shardctl.reshard.api import reshard

    merged = cks.root / "merged-llama"
    if not merged.exists():
        reshard(cks.resharded("llama", Mesh(tp=2)), merged, fmt="hf")
    assert verify(cks.ckpt("llama"), merged, level="bitwise").ok
    # and the other way round: SRC a shardctl layout, DST a plain HF checkpoint
    assert verify(cks.resharded("llama", Mesh(tp=2)), cks.ckpt("llama"), level="bitwise").ok


def test_exit_code_semantics(cks: Checkpoints, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(cks.resharded("llama", Mesh(tp=2)), bad)
    (bad / "shardctl.layout.json").write_text("{not json")
    with pytest.raises(InvalidInputError):  # exit 3
        verify(cks.ckpt("llama"), bad)
    with pytest.raises(UsageError):
        verify(cks.ckpt("llama"), bad, level="everything")
    if not torch.cuda.is_available():
        with pytest.raises(EnvironmentFailure):  # exit 5: could not verify
            verify(cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=2)), device="cuda")


def test_render_tables_for_pass_and_fail(cks: Checkpoints) -> None:
    from rich.console import Console

    from shardctl.cli.verify import render

    good = verify(cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=2)), level="bitwise")
    bad = verify(cks.ckpt("mixtral"), cks.hand_split("mixtral", Mesh(ep=2), "drop-expert"))
    for result, word in ((good, "EQUIVALENT"), (bad, "NOT EQUIVALENT")):
        console = Console(width=140, record=True)
        console.print(render(result))
        text = console.export_text()
        assert word in text and "structure" in text
    assert "experts.3.w1.weight" in text


# -- the block engine: every path, with blocks small enough to cut every row ----------------


@pytest.fixture
def tiny_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 48 bytes: one row of the tiny models no longer fits, so blocks run along the
    last dim (a leading index fixed), tensors span hundreds of blocks, DST rows are capped."""
    from shardctl.verify.bitwise import columnar, plan

    monkeypatch.setattr(plan, "BLOCK_BYTES", 48)
    monkeypatch.setattr(plan, "DST_CAP_BYTES", 80)
    monkeypatch.setattr(columnar, "ENABLED", False)  # the block engine itself, not the columns


TINY = [
    ("llama", Mesh(pp=2, tp=4)),
    ("mixtral", Mesh(ep=2, tp=2)),
    ("gpt2", Mesh(tp=4)),
    ("phi3", Mesh(tp=2)),
]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name,mesh", TINY, ids=[f"{n}-{m}" for n, m in TINY])
def test_tiny_blocks_and_threads_read_each_byte_once(
    cks: Checkpoints,
    tiny_blocks: None,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    mesh: Mesh,
    threads: int,
) -> None:
    from shardctl.verify.bitwise.pipeline import THREADS_ENV

    monkeypatch.setenv(THREADS_ENV, str(threads))
    src, dst = cks.ckpt(name), cks.resharded(name, mesh)
    result = verify(src, dst, level="bitwise")
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    bw = result.level_result("bitwise")
    assert bw.figures["threads"] == threads
    assert bw.figures["rehashed_files"] == 0  # reshard's files come in order: one read each
    tensor_bytes = sum(e.nbytes for p in src.glob("*.safetensors") for e in read_header(p).tensors)
    assert bw.figures["src_bytes"] == tensor_bytes
    assert bw.figures["dst_bytes"] == sum(r["bytes"] for r in bw.rows)


def test_tiny_blocks_count_every_difference_of_a_shard(cks: Checkpoints, tiny_blocks: None) -> None:
    # Three bit flips in one shard, far apart (different blocks): one finding, all three
    # counted, the first located; the same message as with the default 1 MiB blocks.
    dst = cks.resharded("llama", Mesh(tp=2))
    path = dst / "rank-00001-of-00002.safetensors"
    fqn = "model.layers.1.mlp.down_proj.weight"  # [64, 160] -> [64, 80] per rank, S(1)
    for byte in (2 * 81, 2 * 1000 + 1, 2 * 5000):  # elements [1, 1], [12, 40], [62, 40]
        _flip_bit(path, fqn, seed=byte, byte=byte)
    result = verify(cks.ckpt("llama"), dst, level="bitwise")
    hits = [f for f in result.level_result("bitwise").findings if f.fqn == fqn]
    assert len(hits) == 1 and hits[0].rank == 1
    assert hits[0].message.startswith("3 of 5120 elements differ from the source (first at [1, 81]")


def test_out_of_order_files_are_hashed_again(cks: Checkpoints, tiny_blocks: None) -> None:
    # swap-gate-up: each rank holds [up_r; gate_r], so the blocks (in SRC's order: gate, then
    # up) read each file's rows backwards; the hash restarts from the file's start and passes.
    result = verify(
        cks.ckpt("phi3"), cks.hand_split("phi3", Mesh(tp=2), "swap-gate-up"), level="bitwise"
    )
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    assert result.level_result("bitwise").figures["rehashed_files"] == 2


@pytest.mark.parametrize("blocks", ["default", "tiny"])
def test_three_dim_tensors_and_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: str
) -> None:
    from shardctl.verify.bitwise import plan

    if blocks == "tiny":
        monkeypatch.setattr(plan, "BLOCK_BYTES", 24)  # one [5, 7] slice does not fit
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "experts": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
            "scale": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
        },
        str(src / "model.safetensors"),
    )
    shutil.copytree(src, dst)
    assert verify(src, dst, level="bitwise").ok
    _flip_bit(dst / "model.safetensors", "experts", byte=2 * (2 * 35 + 3 * 7 + 4))  # [2, 3, 4]
    _flip_bit(dst / "model.safetensors", "scale", byte=3)
    result = verify(src, dst, level="bitwise")
    found = {f.fqn: f.message for f in result.level_result("bitwise").findings}
    assert found["experts"].startswith(
        "1 of 105 elements differ from the source (first at [2, 3, 4]"
    )
    assert found["scale"].startswith("1 of 1 elements differ")


def test_a_file_truncated_during_the_run_is_an_io_error(cks: Checkpoints) -> None:
    from shardctl.checkpoint.source import open_source
    from shardctl.verify.bitwise.level import check_bitwise
    from shardctl.verify.dst import open_destination

    dst = cks.resharded("llama", Mesh(tp=2))
    source, dest = open_source(cks.ckpt("llama")), open_destination(dst)
    path = dst / "rank-00001-of-00002.safetensors"
    os.truncate(path, path.stat().st_size // 2)  # after the headers were read
    with pytest.raises(OSError, match="short read") as info:  # exit 5 at the CLI
        check_bitwise(source, dest)
    assert info.value.filename == str(path)


def test_launcher_torchrun_refused_before_any_level(cks: Checkpoints, tmp_path: Path) -> None:
    """``shardctl verify --launcher torchrun`` cannot start the ranks itself: exit 2 at once,
    one line naming the torchrun command — not after minutes of bitwise on a large model."""
    import subprocess
    import sys

    dst = cks.resharded("llama", Mesh(tp=2))
    _flip_bit(dst / "rank-00000-of-00002.safetensors", "model.norm.weight", seed=0)
    cmd = [
        sys.executable,
        "-m",
        "shardctl",
        "verify",
        str(cks.ckpt("llama")),
        str(dst),
        "--launcher",
        "torchrun",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "-m shardctl.verify.worker SRC DST" in line and "--nnodes" in line
    # the structure and bitwise levels alone still run with it (and find the flipped bit)
    result = verify(cks.ckpt("llama"), dst, level="bitwise", launcher="torchrun")
    assert _statuses(result)["bitwise"] == "fail"


@pytest.mark.parametrize("lazy", [False, True], ids=["dicts", "columns"])
def test_render_counts_passes_lists_failures_and_escapes_names(lazy: bool) -> None:
    """Text report: passes counted, failures listed (capped; --verbose lifts the cap), user
    text (tensor names, files, paths) printed literally, never as rich markup. The bitwise
    level's lazy rows (``TensorRows``) count from their columns: the same report."""
    import numpy as np
    from rich.console import Console

    from shardctl.cli.verify import MAX_FINDINGS, render
    from shardctl.verify.bitwise.walk import TensorRows
    from shardctl.verify.result import LevelResult, VerifyResult

    rows: list[dict] | TensorRows
    # the failed tensor has 3 shards, the others 2: its shards must not count as passed
    names = [*(f"w{i}" for i in range(145)), "[red]evil[/red]", *(f"w{i}" for i in range(145, 291))]
    shards = [3 if n.startswith("[") else 2 for n in names]
    if lazy:
        rows = TensorRows.from_columns(names, np.array(shards), np.full(len(names), 8))
        rows.fail("[red]evil[/red]")
        assert rows.tally() == (291, 582, 1)
    else:
        rows = [
            {"fqn": n, "shards": k, "bytes": 8, "status": "fail" if n[0] == "[" else "pass"}
            for n, k in zip(names, shards, strict=True)
        ]
    bitwise = LevelResult("bitwise", rows=rows)
    for i in range(MAX_FINDINGS + 5):
        bitwise.fail("differs at [0, 1]", fqn="[red]evil[/red]", rank=i, file="[b]f.safetensors")
    bitwise.close()
    result = VerifyResult("[i]src", "dst", "bitwise", [LevelResult("structure").close(), bitwise])

    def text(verbose: bool) -> str:
        console = Console(width=200, record=True)
        console.print(render(result, verbose=verbose))
        return console.export_text()

    short, full = text(False), text(True)
    assert "291 tensors bit-identical (582 shards)" in short and "1 differ" in short
    assert "w17" not in short and "w17" in full  # passes counted, listed only with --verbose
    assert "[red]evil[/red]" in short and "[b]f.safetensors" in short and "[i]src" in short
    assert "differs at [0, 1]" in short
    assert "5 more (--verbose or --json)" in short and "more (--verbose" not in full
    assert "NOT EQUIVALENT" in short
