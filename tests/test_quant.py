"""Quantized checkpoints (FP8 block, GPTQ with and without act-order, AWQ): reshard places
scales / zeros / g_idx with their weight's blocks, merges back byte-identical, refuses a split
that cuts a group, plans the real bytes, and verify's forward level fails a moved scale.

Checkpoints: transformers' ``save_pretrained`` then quantized in each scheme's published layout
(tests/_quant.py says which published headers they follow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardctl.checkpoint import record
from shardctl.errors import InvalidInputError, LayoutError
from shardctl.layout.engine import build_layout, rank_weight_bytes
from shardctl.layout.types import Layout, Mesh, RankLayout
from shardctl.model.inventory import from_checkpoint, from_config_file
from shardctl.quant.dequant import dequantize
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests import _quant
from tests._models import make_checkpoint
from tests.test_reshard_roundtrip import same_checkpoint, tensors_of_file

WRITERS = {
    "fp8": _quant.fp8_block,
    "gptq": _quant.gptq,
    "gptq-act": lambda s, d: _quant.gptq(s, d, desc_act=True),
    "awq": _quant.awq,
}


class Ckpts:
    def __init__(self, root: Path) -> None:
        self.root = root

    def bf16(self, model: str) -> Path:
        path = self.root / f"bf16-{model}"
        if not path.exists():
            make_checkpoint(model, path)
        return path

    def quant(self, scheme: str, model: str = "llama-quant") -> Path:
        path = self.root / f"{scheme}-{model}"
        if not path.exists():
            WRITERS[scheme](self.bf16(model), path)
        return path

    def split(self, scheme: str, mesh: Mesh, model: str = "llama-quant") -> Path:
        path = self.root / f"{scheme}-{model}-{mesh.pp}{mesh.ep}{mesh.tp}"
        if not path.exists():
            reshard(self.quant(scheme, model), path, mesh=mesh)
        return path


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    return Ckpts(tmp_path_factory.mktemp("quant"))


def _all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---- reshard: split -> merge is the identity; any-to-any -----------------------------------


@pytest.mark.parametrize(
    "scheme,model,mesh",
    [
        ("fp8", "llama-quant", Mesh(tp=2)),  # kv heads (1) replicated with their scales
        ("gptq", "llama-quant", Mesh(tp=2, pp=2)),
        ("gptq-act", "llama-quant", Mesh(tp=2)),  # act-order: groups replicated, g_idx split
        ("awq", "llama-quant", Mesh(tp=2)),
        ("fp8", "mixtral-quant", Mesh(ep=2, tp=2)),  # experts over ep, scales with them
    ],
)
def test_split_merge_is_byte_identical(
    ck: Ckpts, tmp_path: Path, scheme: str, model: str, mesh: Mesh
) -> None:
    src = ck.quant(scheme, model)
    split = ck.split(scheme, mesh, model)
    reshard(split, tmp_path / "merged")
    same_checkpoint(src, tmp_path / "merged")
    assert (src / "model.safetensors").read_bytes() == (
        tmp_path / "merged" / "model.safetensors"
    ).read_bytes()


def test_convert_between_meshes_equals_direct_split(ck: Ckpts, tmp_path: Path) -> None:
    a = ck.split("gptq", Mesh(tp=2))
    reshard(a, tmp_path / "b", mesh=Mesh(pp=2))
    reshard(ck.quant("gptq"), tmp_path / "direct", mesh=Mesh(pp=2))
    for f in sorted((tmp_path / "direct").glob("*.safetensors")):
        assert tensors_of_file(f) == tensors_of_file(tmp_path / "b" / f.name), f.name
    reshard(tmp_path / "b", tmp_path / "m")
    same_checkpoint(ck.quant("gptq"), tmp_path / "m")


def _rank_files(path: Path) -> list[Path]:
    return sorted(path.glob("rank-*.safetensors"))


@pytest.mark.parametrize("scheme", ["fp8", "gptq", "gptq-act", "awq"])
def test_each_rank_dequantizes_to_its_slice_of_the_weight(ck: Ckpts, scheme: str) -> None:
    """The property that matters to an engine: what a rank holds (payload + its own scales,
    zeros, g_idx) dequantizes to exactly its slice of the dequantized global weight."""
    src = ck.quant(scheme)
    config = json.loads((src / "config.json").read_text())
    full = dequantize(_all(src), config, torch.float32)
    split = ck.split(scheme, Mesh(tp=2))
    rec = record.read(split)
    assert rec.layout is not None
    checked = 0
    for rank, f in enumerate(_rank_files(split)):
        from safetensors.torch import load_file

        local = dequantize(load_file(f), config, torch.float32)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj"):
            fqn = f"model.layers.0.{name}.weight"
            w = full[fqn]
            out_dim = 0 if "o_proj" not in name and "down" not in name else 1
            tp = 2
            if name == "self_attn.k_proj":  # one kv head: replicated on both ranks
                want = w
            else:
                n = w.shape[out_dim] // tp
                want = w.narrow(out_dim, rank * n, n)
            assert torch.equal(local[fqn], want), (scheme, rank, fqn)
            checked += 1
    assert checked == 8


def test_dequantized_weights_are_close_to_the_original(ck: Ckpts) -> None:
    """The writers and the dequantizer agree on each format (int4 / fp8 rounding error only)."""
    orig = _all(ck.bf16("llama-quant"))
    fqn = "model.layers.1.mlp.down_proj.weight"
    w = orig[fqn].float()
    for scheme in WRITERS:
        src = ck.quant(scheme)
        config = json.loads((src / "config.json").read_text())
        deq = dequantize(_all(src), config, torch.float32)[fqn]
        err = (deq - w).abs().max().item() / w.abs().max().item()
        assert err < (0.08 if scheme == "fp8" else 0.1), (scheme, err)


# ---- refusals ---------------------------------------------------------------------------


def test_group_cut_is_refused_naming_the_constraint(ck: Ckpts, tmp_path: Path) -> None:
    """tp=4 on in-features 256 leaves 64 per rank: half a GPTQ group of 128."""
    src = _quant.gptq(ck.bf16("llama-quant4"), tmp_path / "g")
    with pytest.raises(LayoutError) as exc:
        reshard(src, tmp_path / "out", mesh=Mesh(tp=4))
    msg = exc.value.message
    assert msg.startswith(
        "GPTQ group_size 128 on in-features 256 with tp 4: 64 per rank, which is not a multiple "
        "of 128"
    ), msg
    assert exc.value.hint is not None and "experts): {1, 2}" in exc.value.hint
    assert not (tmp_path / "out").exists()
    # the CLI: one line on stderr, exit 3, nothing written
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "reshard", str(src), str(tmp_path / "o2"), "--tp", "4"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 3, proc.stderr
    assert "GPTQ group_size 128 on in-features 256 with tp 4" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o2").exists()


def test_fp8_block_cut_is_refused(ck: Ckpts) -> None:
    """FP8 128x128 blocks over head_dim 64: tp=2 leaves one K/V head (64 rows) per rank."""
    model = from_config_file(_quant_config(ck, "llama-quant4", "fp8"))
    with pytest.raises(LayoutError) as exc:
        build_layout(model, Mesh(tp=2))
    assert exc.value.where == "model.layers.0.self_attn.k_proj.weight"
    assert exc.value.message.startswith(
        "FP8 block 128x128 (rows) on out-features 128 with tp 2: 64 per rank, which is not a "
        "multiple of 128"
    ), exc.value.message
    assert exc.value.hint is not None and exc.value.hint.endswith("experts): {1}")


def _quant_config(ck: Ckpts, model: str, scheme: str) -> Path:
    """A config.json alone (no checkpoint) with the scheme's quantization_config."""
    out = ck.root / f"cfg-{model}-{scheme}"
    if not out.exists():
        out.mkdir()
        cfg = json.loads((ck.bf16(model) / "config.json").read_text())
        cfg["quantization_config"] = json.loads((ck.quant(scheme) / "config.json").read_text())[
            "quantization_config"
        ]
        (out / "config.json").write_text(json.dumps(cfg))
    return out / "config.json"


def test_scales_that_do_not_match_the_config_are_refused(ck: Ckpts, tmp_path: Path) -> None:
    src = ck.quant("gptq")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64  # the tensors hold groups of 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        InvalidInputError, match="GPTQ: 4 groups, but in-features 512 with group_size 64 give 8"
    ):
        reshard(bad, tmp_path / "out", mesh=Mesh(tp=2))


# ---- plan: the real bytes, from the checkpoint and from its config alone ------------------


@pytest.mark.parametrize("scheme", ["fp8", "gptq", "awq"])
def test_plan_bytes_are_the_bytes_reshard_writes(ck: Ckpts, scheme: str) -> None:
    split = ck.split(scheme, Mesh(tp=2))
    written = [sum(len(b) for b in tensors_of_file(f).values()) for f in _rank_files(split)]
    cfg = _quant_config(ck, "llama-quant", scheme)
    for model in (from_checkpoint(ck.quant(scheme)), from_config_file(cfg)):
        per_rank = rank_weight_bytes(model, Mesh(tp=2))
        assert [per_rank[(0, 0, r)] for r in range(2)] == written, (scheme, model.source)
    # the inventory from config alone is the checkpoint's, tensor for tensor
    assert sorted(map(str, from_config_file(cfg).tensors)) == sorted(
        map(str, from_checkpoint(ck.quant(scheme)).tensors)
    )
    # and ``shardctl plan`` prints those bytes, from the checkpoint and from the config
    for source in (ck.quant(scheme), cfg) if scheme == "gptq" else ():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardctl",
                "plan",
                str(source),
                "--tp",
                "2",
                "--gpu",
                "h100-sxm",
                "--json",
            ],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert proc.returncode == 0, proc.stderr
        ranks = json.loads(proc.stdout)["ranks"]
        assert [r["memory"]["weights"] for r in ranks] == written


# ---- verify: bits and behaviour ----------------------------------------------------------


@pytest.mark.parametrize("scheme", ["fp8", "gptq-act"])
def test_verify_forward_passes_on_a_correct_split(ck: Ckpts, scheme: str) -> None:
    result = verify(ck.quant(scheme), ck.split(scheme, Mesh(tp=2)), device="cpu", simulate=True)
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]


def _moved_scale_split(src: Path, out: Path, scale: str) -> Path:
    """A tp=2 split whose record is exact for its files, but whose ``scale`` tensors sit on the
    wrong rank (rank 0 holds rank 1's scales and back): structure and bitwise cannot object."""
    from safetensors.torch import load_file, save_file

    from tests._split import write_record

    model = from_checkpoint(src)
    layout = build_layout(model, Mesh(tp=2))
    ranks = [list(r.shards) for r in layout.ranks]
    moved = 0
    for i, s in enumerate(ranks[0]):
        if s.fqn.endswith(scale) and "self_attn.o_proj" in s.fqn:
            j = next(k for k, t in enumerate(ranks[1]) if t.fqn == s.fqn)
            ranks[0][i], ranks[1][j] = ranks[1][j], s
            moved += 1
    assert moved == 2  # both layers' o_proj
    bad = Layout(
        layout.architecture,
        layout.mesh,
        layout.options,
        layout.stages,
        tuple(
            RankLayout(r.pp, r.ep, r.tp, tuple(s)) for r, s in zip(layout.ranks, ranks, strict=True)
        ),
        layout.padded_shapes,
    )
    full = load_file(src / "model.safetensors")
    out.mkdir()
    for f in ("config.json",):
        (out / f).write_bytes((src / f).read_bytes())
    files = {}
    for r, rl in enumerate(bad.ranks):
        local = {}
        for s in rl.shards:
            t = full[s.fqn]
            (p,) = s.pieces
            for d, (o, n) in enumerate(zip(p.offsets, p.sizes, strict=True)):
                t = t.narrow(d, o, n)
            local[s.fqn] = t.contiguous()
        path = out / f"rank{r:05d}.safetensors"
        save_file(local, str(path))
        files[r] = [path]
    write_record(src, out, bad, files)
    return out


@pytest.mark.parametrize("scheme,scale", [("fp8", "weight_scale_inv"), ("gptq", "scales")])
def test_verify_forward_fails_a_moved_scale(
    ck: Ckpts, tmp_path: Path, scheme: str, scale: str
) -> None:
    src = ck.quant(scheme)
    dst = _moved_scale_split(src, tmp_path / "moved", scale)
    result = verify(src, dst, device="cpu", simulate=True)
    statuses = {lv.name: lv.status for lv in result.levels}
    assert statuses == {"structure": "pass", "bitwise": "pass", "forward": "fail"}, statuses
    assert not result.ok


# ---- inspect ------------------------------------------------------------------------------


def test_inspect_shows_the_quantization_per_tensor_group(ck: Ckpts) -> None:
    root = Path(__file__).resolve().parents[1]
    src = ck.quant("gptq")
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "inspect", str(src), "--json"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    quant = json.loads(proc.stdout)["model"]["quantization"]
    assert quant["method"] == "gptq int4 group_size 128"
    assert quant["quantized_weights"] == 14  # 7 projections x 2 layers; norms, embeddings stay
    down = next(g for g in quant["groups"] if g["pattern"] == "model.layers.*.mlp.down_proj.weight")
    assert down["scheme"] == "gptq" and down["count"] == 2
    assert down["members"] == {
        "qweight": "I32 [64, 256]",
        "scales": "F16 [4, 256]",
        "qzeros": "I32 [4, 32]",
        "g_idx": "I32 [512]",
    }
    total = quant["quantized_bytes"] + quant["unquantized_bytes"]
    assert total == sum(len(b) for b in tensors_of_file(src / "model.safetensors").values())
    text = subprocess.run(
        [sys.executable, "-m", "shardctl", "inspect", str(src)],
        capture_output=True,
        text=True,
        cwd=root,
    ).stdout
    assert "quantization: gptq int4 group_size 128, 14 weights quantized" in text
    assert "model.layers.*.mlp.down_proj.weight ×2: gptq: qweight I32 [64, 256]" in text


def test_a_weight_without_its_scales_is_refused(ck: Ckpts, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = ck.quant("fp8")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    t = load_file(src / "model.safetensors")
    del t["model.layers.1.self_attn.o_proj.weight"]  # its weight_scale_inv stays behind
    save_file(t, str(bad / "model.safetensors"))
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "reshard", str(bad), str(tmp_path / "o"), "--tp", "2"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "FP8 block weight without its 'weight' tensor" in line
    assert "model.layers.1.self_attn.o_proj.weight" in line
    assert not (tmp_path / "o").exists()


def test_plan_refuses_to_quantize_a_quantized_model_again(ck: Ckpts) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(_quant_config(ck, "llama-quant", "awq")),
         "--tp", "2", "--gpu", "h100-sxm", "--quantization", "int4"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "already quantized (awq int4 group_size 128)" in proc.stderr


# ---- real size (config only: no tensor data, no torch) -----------------------------------

LLAMA2_7B_GPTQ = {  # TheBloke/Llama-2-7B-GPTQ config.json (the fields shapes depend on)
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "max_position_embeddings": 4096, "torch_dtype": "float16",
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": False},
}  # fmt: skip


def test_llama2_7b_gptq_real_size_bytes_and_refusal(tmp_path: Path) -> None:
    from shardctl.model.inventory import from_config

    model = from_config(LLAMA2_7B_GPTQ)
    # the published header's shapes (tests/_quant.py cites them)
    shapes = {t.fqn: (t.shape, t.dtype) for t in model.tensors}
    assert shapes["model.layers.0.mlp.down_proj.qweight"] == ((1376, 4096), "I32")
    assert shapes["model.layers.0.mlp.down_proj.qzeros"] == ((86, 512), "I32")
    assert shapes["model.layers.0.mlp.down_proj.scales"] == ((86, 4096), "F16")
    assert shapes["model.layers.0.mlp.down_proj.g_idx"] == ((11008,), "I32")

    # tp=2 by hand: GPTQ bytes of an [out, in] weight split to [o, i] on its rank, g_idx
    # length i_g (whole when the split is on out-features)
    def gptq(o: int, i: int, groups: int, i_g: int) -> int:
        return i // 8 * o * 4 + groups * o // 8 * 4 + groups * o * 2 + i_g * 4

    h, inter = 4096, 11008
    layer = (
        3 * gptq(h // 2, h, 32, h)  # q, k, v colwise
        + gptq(h, h // 2, 16, h // 2)  # o rowwise
        + 2 * gptq(inter // 2, h, 32, h)  # gate, up colwise
        + gptq(h, inter // 2, 43, inter // 2)  # down rowwise: 43 of 86 groups
        + 2 * h * 2  # norms, replicated fp16
    )
    want = 32 * layer + 2 * (32000 // 2) * h * 2 + h * 2  # + embed, lm_head (vocab), norm
    per_rank = rank_weight_bytes(model, Mesh(tp=2))
    assert set(per_rank.values()) == {want}
    with pytest.raises(LayoutError) as exc:
        build_layout(model, Mesh(tp=8))
    assert exc.value.message.startswith(
        "GPTQ group_size 128 on in-features 11008 with tp 8: 1376 per rank, which is not a "
        "multiple of 128"
    )
    assert exc.value.hint is not None and exc.value.hint.endswith("experts): {1, 2}")
