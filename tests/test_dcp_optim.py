"""DCP / FSDP2 training checkpoints with optimizer state (issue 16 item 3).

Checkpoints are written by real ``torch.distributed.checkpoint.save`` from an FSDP2
(``fully_shard``) Llama with AdamW after two steps, on gloo groups of 2 and 4 processes
(``tests/_dcp_fsdp.py``); shardctl converts them; DCP's own ``dcp.load`` + ``set_state_dict``
loads the result into FSDP2 on a different world size; everything is compared bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardctl import inspect, reshard
from shardctl.errors import InvalidInputError
from tests._cli import run_cli as _cli
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
NAME = "llama"  # 4 layers, k/v rows 16, vocab 256: uneven dim-0 chunks on 3 ranks
TIED = "llama-tied-mha"  # tie_word_embeddings: no lm_head.weight on disk, one in FSDP2's DCP


def _fsdp(*jobs: str) -> None:
    """Run FSDP2 jobs (``mode,hf,ckpt,world,dump``) in one child: imports paid once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._dcp_fsdp", *jobs],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF source (fp32) and the DCP checkpoints FSDP2 saved on 2 and 4 ranks, with dumps."""
    root = tmp_path_factory.mktemp("dcp")
    hf = make_checkpoint(NAME, root / "hf", dtype="float32")
    tied = make_checkpoint(TIED, root / "tied-hf", dtype="float32")
    p = {"root": root, "hf": hf, "tied-hf": tied}
    for w in (2, 4):
        p[f"ck{w}"], p[f"dump{w}"] = root / f"ck{w}", root / f"dump{w}.pt"
    p["tied-ck"], p["tied-dump"] = root / "tied-ck", root / "tied-dump.pt"
    _fsdp(
        *(f"save,{hf},{p[f'ck{w}']},{w},{p[f'dump{w}']}" for w in (2, 4)),
        f"save,{tied},{p['tied-ck']},2,{p['tied-dump']}",
    )
    for ck, src in ((p["ck2"], hf), (p["ck4"], hf), (p["tied-ck"], tied)):
        # HF export needs the model's config next to the DCP files
        (ck / "config.json").write_bytes((src / "config.json").read_bytes())
    return p


def flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit: every parameter, exp_avg, exp_avg_sq, step and param_groups entry."""
    import torch

    fa, fb = flat(a), flat(b)
    assert set(fa) == set(fb)
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            assert torch.equal(va.view(-1).view(torch.uint8), vb.view(-1).view(torch.uint8)), k
        else:
            assert va == vb, k


def load(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, weights_only=True)


def tree_digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def test_reshard_to_other_world_sizes_loads_bit_exact(trained: dict[str, Path]) -> None:
    from shardctl.formats.dcp.metadata import read_metadata
    from shardctl.formats.dcp.write_dcp import dim0_chunks

    root = trained["root"]
    before = tree_digest(trained["ck2"])
    # 2 ranks -> DCP for 3 ranks directly
    reshard(trained["ck2"], root / "d3", format="dcp", mesh={"dp": 3})
    assert tree_digest(trained["ck2"]) == before  # input untouched
    # 4 ranks -> HF + optimizer sidecar -> DCP for 2 ranks
    reshard(trained["ck4"], root / "h4", format="hf")
    assert (root / "h4" / "optimizer.safetensors").is_file()
    out = reshard(root / "h4", root / "d2", format="dcp", mesh={"dp": 2})
    assert out.format == "dcp" and out.mesh is not None and out.mesh.dp == 2

    # storage is chunked as FSDP2 shards the new mesh: dim 0, torch.chunk sizes, one file/rank
    md = read_metadata(root / "d3")
    assert md.files == ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp")
    for key in ("model.model.layers.0.self_attn.k_proj.weight", "model.lm_head.weight"):
        for k in (key, key.replace("model.", "optimizer.state.", 1) + ".exp_avg"):
            t = md.tensors[k]
            want = [(s, n) for s, n in dim0_chunks(t.shape[0], 3) if n]
            assert [(c.offsets[0], c.sizes[0]) for c in t.chunks] == want, k
            assert [c.file for c in t.chunks] == [f"__{r}_0.distcp" for r in range(len(want))]
    assert md.tensors["optimizer.state.lm_head.weight.step"].shape == ()

    # tied: DCP (lm_head.weight present) -> HF (left out, as save_pretrained does) -> DCP
    # (put back: dcp.load wants every key of the tied model's state dict)
    reshard(trained["tied-ck"], root / "tied-h", format="hf")
    reshard(root / "tied-h", root / "tied-d3", format="dcp", mesh={"dp": 3})
    assert "model.lm_head.weight" in read_metadata(root / "tied-d3").tensors

    _fsdp(
        f"load,{trained['hf']},{root / 'd3'},3,{root / 'l3.pt'}",
        f"load,{trained['hf']},{root / 'd2'},2,{root / 'l2.pt'}",
        f"load,{trained['tied-hf']},{root / 'tied-d3'},3,{root / 'tied-l3.pt'}",
    )
    dump2, dump4 = load(trained["dump2"]), load(trained["dump4"])
    assert_same_state(load(root / "l3.pt"), dump2)
    assert_same_state(load(root / "l2.pt"), dump4)
    assert_same_state(load(root / "tied-l3.pt"), load(trained["tied-dump"]))
    # the checkpoints hold trained state, not the initial weights, and step 2
    step = dump2["optimizer"]["state"]["lm_head.weight"]["step"]
    assert float(step) == 2.0
    assert dump2["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_hf_export_equals_full_state_dict(trained: dict[str, Path]) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root = trained["root"]
    reshard(trained["ck2"], root / "h2", format="hf")
    dump = load(trained["dump2"])
    with safe_open(root / "h2" / "model.safetensors", framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert_same_state(got, dump["model"])
    with safe_open(root / "h2" / "optimizer.safetensors", framework="pt") as f:
        meta = f.metadata()
        side = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "shardctl.dcp-sidecar/1"
    for fqn, states in dump["optimizer"]["state"].items():
        for name, value in states.items():
            assert torch.equal(side[f"optimizer.state.{fqn}.{name}"], value)
    objects = json.loads(meta["shardctl.dcp.objects"])
    assert objects["optimizer.param_groups.0.lr"] == 0.01
    assert objects["optimizer.param_groups.0.betas"] == {"__tuple__": [0.9, 0.95]}

    model = AutoModelForCausalLM.from_pretrained(root / "h2", dtype=torch.float32)
    assert_same_state(dict(model.state_dict()), dump["model"])

    # weights only, to DCP: model keys only, one rank file
    from shardctl.formats.dcp.metadata import read_metadata

    reshard(trained["ck2"], root / "d1w", format="dcp", mesh={"dp": 1}, optimizer=False)
    md = read_metadata(root / "d1w")
    assert md.files == ("__0_0.distcp",) and not md.objects
    assert {k for k in md.tensors} == {f"model.{k}" for k in dump["model"]}

    # weights only: no sidecar, the same model.safetensors bytes
    reshard(trained["ck2"], root / "h2w", format="hf", optimizer=False)
    assert not (root / "h2w" / "optimizer.safetensors").exists()
    assert (root / "h2w" / "model.safetensors").read_bytes() == (
        root / "h2" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("name", ["llama-tied-mha", "qwen2"])
def test_hf_dcp_hf_is_byte_identical(name: str, tmp_path: Path) -> None:
    """bf16 weights, tied embeddings (no lm_head on disk), biases: same bytes back."""
    src = make_checkpoint(name, tmp_path / "hf")
    reshard(src, tmp_path / "dcp", format="dcp", mesh={"dp": 3})
    reshard(tmp_path / "dcp", tmp_path / "back", format="hf")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert not (tmp_path / "back" / "optimizer.safetensors").exists()  # HF had no optimizer


def test_inspect_shows_optimizer_state_and_step(trained: dict[str, Path]) -> None:
    doc = inspect(trained["ck4"]).to_json()
    assert doc["kind"] == "dcp" and doc["layout"]["mesh"]["dp"] == 4
    n = doc["model"]["tensors"]
    assert n == len(load(trained["dump4"])["model"])
    assert doc["dcp"]["optimizer_state"] == {"exp_avg": n, "exp_avg_sq": n, "step": n}
    assert doc["dcp"]["step"] == {"min": 2.0, "max": 2.0}
    assert doc["dcp"]["param_groups"][0]["betas"] == [0.9, 0.95]


def test_cli_reshard_and_inspect(trained: dict[str, Path]) -> None:
    root = trained["root"]
    r = _cli("reshard", str(trained["ck4"]), str(root / "c2"), "--format", "dcp", "--dp", "2")
    assert r.returncode == 0, r.stderr
    assert "dcp" in r.stdout and "config.json" in r.stdout
    assert len(list((root / "c2").glob("*.distcp"))) == 2
    r = _cli("inspect", str(root / "c2"))
    assert r.returncode == 0, r.stderr
    assert "exp_avg 21" in r.stdout.replace("\n", " ") or "exp_avg" in r.stdout
    assert "step 2" in r.stdout


def _one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_cli_refusals(trained: dict[str, Path], tmp_path: Path) -> None:
    ck = trained["ck2"]
    line = _one_line(_cli("reshard", str(ck), str(tmp_path / "o"), "--tp", "2"), 2)
    assert "--tp 2" in line and "dp" in line
    line = _one_line(
        _cli("reshard", str(trained["hf"]), str(tmp_path / "o"), "--format", "hf", "--dp", "2"),
        2,
    )
    assert "--dp" in line
    # no config.json next to the DCP files: HF output refused, nothing written
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in ck.iterdir():
        if p.name != "config.json":
            (bare / p.name).write_bytes(p.read_bytes())
    line = _one_line(_cli("reshard", str(bare), str(tmp_path / "o")), 3)
    assert "config.json" in line
    assert not (tmp_path / "o").exists()
    line = _one_line(_cli("reshard", str(ck), str(tmp_path / "o"), "--format", "ranks"), 2)
    assert "dcp or hf" in line
    # a shardctl per-rank layout is merged first (one line says how)
    reshard(trained["hf"], tmp_path / "tp2", mesh={"tp": 2})
    with pytest.raises(InvalidInputError, match="merge it first"):
        reshard(tmp_path / "tp2", tmp_path / "o", format="dcp")
    assert not (tmp_path / "o").exists()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def test_hostile_metadata_is_refused_without_running_it(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    bad = _copy(trained["ck2"], tmp_path / "evil")
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil()))
    r = _cli("reshard", str(bad), str(tmp_path / "o"))
    line = _one_line(r, 3)
    assert "os" in line and "system" in line
    assert not (ROOT / "PWNED").exists() and not (tmp_path / "PWNED").exists()


def test_truncated_or_inconsistent_metadata_is_refused(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from shardctl.formats.dcp.metadata import read_metadata

    cut = _copy(trained["ck2"], tmp_path / "cut")
    data = (cut / "__1_0.distcp").read_bytes()
    (cut / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidInputError, match="past the end"):
        read_metadata(cut)

    # a chunk moved onto its neighbour: overlap and a hole
    moved = _copy(trained["ck2"], tmp_path / "moved")
    md = FileSystemReader(str(moved)).read_metadata()
    key = "model.lm_head.weight"
    chunks = md.state_dict_metadata[key].chunks  # type: ignore[union-attr]
    old = chunks[1].offsets
    chunks[1].offsets = torch.Size([0, 0])
    md.storage_data = {
        (type(i)(i.fqn, torch.Size([0, 0]), i.index) if i.fqn == key and i.offset == old else i): v
        for i, v in md.storage_data.items()
    }
    (moved / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(InvalidInputError, match="overlap"):
        read_metadata(moved)


def _flip(path: Path, name: str) -> None:
    """Flip one bit in the first byte of tensor ``name`` of a safetensors file."""
    from shardctl.io.safetensors_header import read_header

    header = read_header(path)
    entry = next(e for e in header.tensors if e.name == name)
    data = bytearray(path.read_bytes())
    data[header.data_offset + entry.begin] ^= 1
    path.write_bytes(bytes(data))


def test_verify_accepts_dcp_on_either_side(trained: dict[str, Path], tmp_path: Path) -> None:
    from shardctl import verify

    hf = tmp_path / "h"
    reshard(trained["ck2"], hf, format="hf")
    ok = verify(trained["ck2"], hf, level="bitwise")
    assert ok.ok and ok.src == str(trained["ck2"])
    dump = load(trained["dump2"])
    entries = 3 * len(dump["model"]) + len(dump["optimizer"]["param_groups"][0])
    assert ok.level_result("bitwise").figures["optimizer_state"] == f"{entries} entries compared"
    # DCP as DST, up to the forward level (the weights run as a model)
    reshard(hf, tmp_path / "d3", format="dcp", mesh={"dp": 3})
    fwd = verify(hf, tmp_path / "d3", level="forward")
    assert fwd.ok and fwd.level_result("forward").status == "pass"

    # one bit of one moment, or of one weight, is a bitwise failure naming it
    bad = _copy(hf, tmp_path / "bad-moment")
    _flip(bad / "optimizer.safetensors", "optimizer.state.lm_head.weight.exp_avg_sq")
    r = verify(trained["ck2"], bad, level="forward")
    assert not r.ok and r.failed_level is not None and r.failed_level.name == "bitwise"
    assert r.failed_level.findings[0].fqn == "optimizer.state.lm_head.weight.exp_avg_sq"
    assert r.level_result("forward").status == "not-run"
    bad = _copy(hf, tmp_path / "bad-weight")
    _flip(bad / "model.safetensors", "model.norm.weight")
    r = verify(bad, trained["ck2"], level="bitwise")
    assert not r.ok and r.failed_level is not None and r.failed_level.name == "bitwise"


@pytest.fixture
def deepspeed() -> None:
    """Skip before the expensive fixtures are built when deepspeed is not installed."""
    pytest.importorskip("deepspeed")


def test_deepspeed_zero2_input(deepspeed: None, tmp_path: Path) -> None:
    """A real ZeRO-2 checkpoint (2 ranks) -> DCP for 3 ranks, loaded by FSDP2; -> HF.

    Needs deepspeed (docs/dcp-training-checkpoints.md); shardctl itself never imports it.
    """
    import torch

    hf = make_checkpoint(NAME, tmp_path / "hf", dtype="float32")
    zero, oracle = tmp_path / "zero", tmp_path / "oracle.pt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests._deepspeed_zero", str(hf), str(zero), "2", str(oracle)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (zero / "config.json").write_bytes((hf / "config.json").read_bytes())
    expected = load(oracle)

    reshard(zero, tmp_path / "h")  # default for a ZeRO input: HF + optimizer sidecar
    reshard(zero, tmp_path / "d3", format="dcp", mesh={"dp": 3})
    _fsdp(f"load,{hf},{tmp_path / 'd3'},3,{tmp_path / 'l3.pt'}")
    got = flat(load(tmp_path / "l3.pt"))
    for key, want in expected.items():
        have = got[key]
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    steps = [v for k, v in got.items() if k.endswith(".step")]
    assert steps and all(float(s) == 2.0 for s in steps)

    from safetensors.torch import load_file

    weights = load_file(tmp_path / "h" / "model.safetensors")
    assert {f"model.{k}" for k in weights} == {k for k in expected if k.startswith("model.")}
    for k, v in weights.items():
        assert torch.equal(v, expected[f"model.{k}"]), k

    from shardctl import verify

    r = verify(zero, tmp_path / "d3", level="bitwise")  # ZeRO vs DCP, optimizer state too
    assert r.ok and "entries compared" in r.level_result("bitwise").figures["optimizer_state"]
