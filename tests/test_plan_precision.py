"""Mixed-precision checkpoints (issue 15, item 4): ``quantization.overrides`` and
``keep_16bit`` over any tensor, priced tensor by tensor, rank by rank.

The reference is always a real mixed checkpoint: written by transformers' ``save_pretrained``,
then some matrices quantized (real values) and stored under the names, dtypes and shapes of
the published format (FBGEMM ``fbgemm_fp8`` as Meta's Llama-3.1-405B-Instruct-FP8 stores it:
``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` F32 ``[out, 1]``; AutoGPTQ v1 as
tests/_quant.py writes it). ``plan`` of that checkpoint counts its stored bytes through the
layout engine; ``plan`` of the bf16 model plus overrides must give the same bytes on every rank
of every mesh, and a single rank's bytes equal the safetensors file's tensor bytes.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardctl
from tests import _quant
from tests._models import make_checkpoint

MESHES = ({"tp": 1}, {"tp": 2}, {"pp": 2}, {"pp": 2, "tp": 2})
LAYERS = 4
# Meta's recipe at toy scale: every attention and the first and last layers' MLPs in bf16,
# the other MLPs fp8 per row (Llama-3.1-405B-Instruct-FP8 config.json modules_to_not_convert).
KEPT = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkvo"]
KEPT += [f"model.layers.{i}.mlp.{p}_proj" for i in (0, LAYERS - 1) for p in ("gate", "up", "down")]
KEPT += ["lm_head"]
FBGEMM_OVERRIDES = """
  overrides:
    - {match: "*.self_attn.*", method: none}
    - {match: "model.layers.0.mlp.*", method: none}
    - {match: "model.layers.3.mlp.*", method: none}
"""


def _fp8_rows(w: Any) -> tuple[Any, Any]:
    """FBGEMM fp8 per row: e4m3 values and an F32 scale per output row ``[out, 1]``."""
    import torch

    scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale.to(torch.float32).contiguous()


def _rewrite(src: Path, dst: Path, convert: Any, quant_config: dict[str, Any] | None) -> Path:
    """``src`` (save_pretrained) with each tensor replaced by ``convert(name, tensor)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    out: dict[str, Any] = {}
    for name, t in load_file(src / "model.safetensors").items():
        out.update(convert(name, t))
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _stored_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file, from its header (independent of shardctl)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        "llama-quant", tmp_path_factory.mktemp("bf16") / "ckpt", num_hidden_layers=LAYERS
    )


@pytest.fixture(scope="module")
def fbgemm(bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    def convert(name: str, t: Any) -> dict[str, Any]:
        base = name.removesuffix(".weight")
        if _quant.quantizable(name, t) and base not in KEPT:
            q, scale = _fp8_rows(t)
            return {name: q, f"{base}.weight_scale": scale}
        return {name: t}

    qc = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": KEPT,
    }
    return _rewrite(bf16, tmp_path_factory.mktemp("fbgemm") / "ckpt", convert, qc)


def _manifest(tmp_path: Path, model: str, quant: str = "", name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(
        f"model: {model}\nmesh: {{tp: 1}}\nhardware: {{gpu: h100-sxm, nodes: 1}}\n"
        "workload: {mode: weights-only}\n" + quant
    )
    return path


def _weights(path: Path, mesh: dict[str, int]) -> dict[tuple[int, ...], int]:
    plan = shardctl.plan(path, mesh=mesh)
    return {tuple(r.coord.values()): r.memory["weights"] for r in plan.ranks}


def test_fbgemm_recipe_overrides_equal_the_stored_checkpoint(
    fbgemm: Path, bf16: Path, tmp_path: Path
) -> None:
    stored = _manifest(tmp_path, f"{{checkpoint: {fbgemm}}}", name="stored.yaml")
    config_only = _manifest(tmp_path, f"{{config: {fbgemm / 'config.json'}}}", name="cfg.yaml")
    ours = _manifest(
        tmp_path,
        f"{{checkpoint: {bf16}}}",
        "quantization:\n  method: fp8\n  fp8_scaling: channel" + FBGEMM_OVERRIDES,
    )
    all_fp8 = _manifest(
        tmp_path, f"{{checkpoint: {bf16}}}", "quantization: {method: fp8, fp8_scaling: channel}\n",
        name="all.yaml",
    )  # fmt: skip
    for mesh in MESHES:
        want = _weights(stored, mesh)
        assert _weights(ours, mesh) == want, mesh
        # the fbgemm config alone (no tensors on disk) expands to the same stored tensors
        assert _weights(config_only, mesh) == want, mesh
        # and the overrides matter: all-fp8 is smaller on every rank
        assert all(a < want[c] for c, a in _weights(all_fp8, mesh).items()), mesh
    (single,) = _weights(ours, {"tp": 1}).values()
    assert single == _stored_bytes(fbgemm / "model.safetensors")
    inspected = shardctl.inspect(fbgemm)
    assert inspected.model.weight_bytes == single
    assert inspected.dtypes.keys() == {"F8_E4M3", "BF16", "F32"}


@pytest.fixture(scope="module")
def gptq_mixed(bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPTQ int4 g128 everywhere but layer 0 (kept bf16: modules_to_not_convert)."""
    import torch

    def convert(name: str, t: Any) -> dict[str, Any]:
        if not _quant.quantizable(name, t) or name.startswith("model.layers.0."):
            return {name: t}
        base = name.removesuffix(".weight")
        q, zero, scale = _quant._int4_groups(t, 128)
        return {
            f"{base}.qweight": _quant.pack_rows(q.T.contiguous()),
            f"{base}.qzeros": _quant.pack_cols(zero - 1),
            f"{base}.scales": scale.to(torch.float16).contiguous(),
            f"{base}.g_idx": torch.arange(t.shape[1], dtype=torch.int32) // 128,
        }

    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": False,
        "modules_to_not_convert": ["model.layers.0"],
    }
    return _rewrite(bf16, tmp_path_factory.mktemp("gptq") / "ckpt", convert, qc)


def test_gptq_with_a_bf16_layer_equals_the_stored_checkpoint(
    gptq_mixed: Path, bf16: Path, tmp_path: Path
) -> None:
    stored = _manifest(tmp_path, f"{{checkpoint: {gptq_mixed}}}", name="stored.yaml")
    ours = _manifest(
        tmp_path,
        f"{{checkpoint: {bf16}}}",
        "quantization:\n  method: gptq\n  overrides:\n"
        '    - {match: "model.layers.0.*", method: none}\n',
    )
    for mesh in MESHES:
        assert _weights(ours, mesh) == _weights(stored, mesh), mesh


@pytest.fixture(scope="module")
def patchwork(bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four formats in one file: o_proj fp8 per tensor, MLPs fp8 per row, lm_head F32, the
    rest bf16 (no quantization_config: the stored names say which tensor is what)."""
    import torch

    def convert(name: str, t: Any) -> dict[str, Any]:
        base = name.removesuffix(".weight")
        if name.endswith("o_proj.weight"):
            scale = (t.float().abs().amax() / 448.0).clamp(min=1e-12)
            q = (t.float() / scale).to(torch.float8_e4m3fn)
            return {name: q, f"{base}.weight_scale": scale.reshape(()).to(torch.float32)}
        if ".mlp." in name and name.endswith(".weight"):
            q, s = _fp8_rows(t)
            return {name: q, f"{base}.weight_scale": s}
        if name == "lm_head.weight":
            return {name: t.float()}
        return {name: t}

    return _rewrite(bf16, tmp_path_factory.mktemp("patch") / "ckpt", convert, None)


def test_dtype_and_method_overrides_over_a_bf16_base(
    patchwork: Path, bf16: Path, tmp_path: Path
) -> None:
    stored = _manifest(tmp_path, f"{{checkpoint: {patchwork}}}", name="stored.yaml")
    ours = _manifest(
        tmp_path,
        f"{{checkpoint: {bf16}}}",
        """quantization:
  method: none
  overrides:
    - {match: "*.o_proj.*", method: fp8}
    - {match: "*.mlp.*", method: fp8, fp8_scaling: channel}
    - {match: "lm_head.*", dtype: float32}
""",
    )
    for mesh in MESHES:
        assert _weights(ours, mesh) == _weights(stored, mesh), mesh
    (single,) = _weights(ours, {"tp": 1}).values()
    assert single == _stored_bytes(patchwork / "model.safetensors")
    assert shardctl.inspect(patchwork).model.weight_bytes == single


def test_keep_16bit_prices_decoder_matrices(bf16: Path, tmp_path: Path) -> None:
    """A keep_16bit glob over attention keeps exactly those tensors' bf16 bytes."""
    plain = _manifest(tmp_path, f"{{checkpoint: {bf16}}}", "quantization: {method: fp8}\n")
    keep = _manifest(
        tmp_path,
        f"{{checkpoint: {bf16}}}",
        'quantization: {method: fp8, keep_16bit: ["*embed_tokens.*", "lm_head.*", "*norm*", '
        '"*.self_attn.*"]}\n',
        name="keep.yaml",
    )
    via_override = _manifest(
        tmp_path,
        f"{{checkpoint: {bf16}}}",
        'quantization:\n  method: fp8\n  overrides: [{match: "*.self_attn.*", dtype: bf16}]\n',
        name="ovr.yaml",
    )
    from shardctl.model.inventory import from_checkpoint

    attn = [t for t in from_checkpoint(bf16).tensors if ".self_attn." in t.fqn]
    n = sum(t.numel for t in attn)
    (p,) = _weights(plain, {"tp": 1}).values()
    (k,) = _weights(keep, {"tp": 1}).values()
    (o,) = _weights(via_override, {"tp": 1}).values()
    # fp8 per tensor: n + 4 bytes per matrix; bf16: 2n
    assert k - p == 2 * n - (n + 4 * len(attn))
    assert o == k


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("quant", "where", "needle"),
    [
        (
            '  method: fp8\n  overrides: [{match: "*.no_such.*", method: none}]\n',
            "quantization.overrides[0].match",
            "matches no tensor",
        ),
        (
            '  method: fp8\n  overrides:\n    - {match: "*.mlp.*", method: none}\n'
            '    - {match: "*.mlp.down_proj.*", dtype: bf16}\n',
            "quantization.overrides[1].match",
            "never applies",
        ),
        (
            '  method: none\n  overrides: [{match: "*norm*", method: fp8}]\n',
            "quantization.overrides[0].method",
            "matches only norms",
        ),
        (
            '  method: fp8\n  overrides: [{match: "*.mlp.*", method: fp8, dtype: bf16}]\n',
            "quantization.overrides[0]",
            "exactly one of 'method' or 'dtype'",
        ),
        (
            '  method: fp8\n  overrides: [{match: "*.mlp.*", dtype: fp8}]\n',
            "quantization.overrides[0].dtype",
            "dense dtype",
        ),
        (
            '  method: awq\n  keep_16bit: ["*embed_tokens.*", "*.no_such_module.*"]\n',
            "quantization.keep_16bit",
            "matches no tensor",
        ),
    ],
)
def test_bad_overrides_exit_3(
    bf16: Path, tmp_path: Path, quant: str, where: str, needle: str
) -> None:
    path = _manifest(tmp_path, f"{{checkpoint: {bf16}}}", "quantization:\n" + quant)
    proc = _cli("plan", str(path))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert needle in proc.stderr and where in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
