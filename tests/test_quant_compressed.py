"""compressed-tensors checkpoints written by the ``compressed-tensors`` library itself (the
format llm-compressor and NVIDIA Model Optimizer exports use): NVFP4 (``weight_packed`` U8, FP8
``weight_scale`` per 16, ``weight_global_scale``) and int4 pack-quantized (``weight_packed`` I32,
``weight_scale`` per group, ``weight_shape``, ``weight_zero_point`` when asymmetric).

Flow as llm-compressor's: ``apply_quantization_config`` on a transformers model, quantization
parameters from the library's own ``calculate_qparams`` (RTN, no calibration data),
``ModelCompressor.compress_model``, ``save_pretrained``, ``update_config``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardctl.layout.engine import rank_weight_bytes
from shardctl.layout.types import Mesh
from shardctl.model.inventory import from_checkpoint, from_config_file
from shardctl.reshard.api import reshard
from tests._models import make_config
from tests.test_reshard_roundtrip import same_checkpoint, tensors_of_file

pytest.importorskip("compressed_tensors")

PRESETS = {
    "nvfp4": "NVFP4A16",
    "w4a16": "W4A16",
    "w4a16-asym": "W4A16_ASYM",
    "fp8-dynamic": "FP8_DYNAMIC",
}
FORMATS = {
    "nvfp4": "nvfp4-pack-quantized",
    "w4a16": "pack-quantized",
    "w4a16-asym": "pack-quantized",
    "fp8-dynamic": "float-quantized",
}


def write_compressed(preset: str, out: Path) -> Path:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama-quant"), dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(PRESETS[preset], ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for _, mod in model.named_modules():
            if getattr(mod, "quantization_scheme", None) is None:
                continue
            w = mod.weight.data.float()
            args = mod.quantization_scheme.weights
            gs = None
            if hasattr(mod, "weight_global_scale"):
                gs = generate_gparam(w.amin(), w.amax())
                mod.weight_global_scale.data.copy_(gs.reshape(1))
            if args.group_size:
                x = w.view(w.shape[0], -1, args.group_size)
            else:  # per channel
                x = w.view(w.shape[0], 1, -1)
            s, z = calculate_qparams(x.amin(-1), x.amax(-1), args, global_scale=gs)
            mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype))
            mod.weight_zero_point.data.copy_(z.to(mod.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMATS[preset])
    assert compressor is not None
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {p: write_compressed(p, root / p) for p in PRESETS}


def library_dequantized(src: Path) -> dict[str, object]:
    """Every quantized weight as compressed-tensors itself reads its files back: its own
    unpacking (``unpack_fp4_from_uint8`` / ``unpack_from_int32``) and ``dequantize``."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    args = QuantizationConfig.model_validate(qc).config_groups["group_0"].weights
    t = load_file(src / "model.safetensors")
    out: dict[str, object] = {}
    for k in t:
        if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn:  # float-quantized
            base = k.removesuffix(".weight")
            out[k] = dequantize(
                t[k].float(), t[f"{base}.weight_scale"].float(), None, args, dtype=torch.float32
            )
            continue
        if not k.endswith(".weight_packed"):
            continue
        base = k.removesuffix(".weight_packed")
        scale = t[f"{base}.weight_scale"]
        gs = t.get(f"{base}.weight_global_scale")
        if gs is not None:  # NVFP4
            rows, cols = t[k].shape[0], t[k].shape[1] * 2
            x = unpack_fp4_from_uint8(t[k], rows, cols, dtype=torch.float32)
            zp = None
        else:
            shape = torch.Size(t[f"{base}.weight_shape"].tolist())
            x = unpack_from_int32(t[k], args.num_bits, shape)
            zp = t.get(f"{base}.weight_zero_point")
            if zp is not None:
                zp = unpack_from_int32(zp, args.num_bits, scale.shape, packed_dim=0)
        out[f"{base}.weight"] = dequantize(
            x.float(), scale.float(), zp, args, dtype=torch.float32, global_scale=gs
        )
    return out


@pytest.mark.parametrize("preset", list(PRESETS))
def test_dequantize_matches_the_library(ckpts: dict[str, Path], preset: str) -> None:
    """shardctl's reading of the packed files equals compressed-tensors' own reading of them
    (so a wrong nibble order, offset, zero point or scale layout cannot pass)."""
    import torch
    from safetensors.torch import load_file

    from shardctl.quant.dequant import dequantize

    src = ckpts[preset]
    config = json.loads((src / "config.json").read_text())
    got = dequantize(load_file(src / "model.safetensors"), config, torch.float32)
    expected = library_dequantized(src)
    assert len(expected) == 14
    for fqn, want in expected.items():
        assert torch.allclose(got[fqn], want, rtol=1e-6, atol=1e-7), fqn  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_compressed_tensors_round_trip_and_plan(
    ckpts: dict[str, Path], tmp_path: Path, preset: str
) -> None:
    src = ckpts[preset]
    payload = "weight" if preset == "fp8-dynamic" else "weight_packed"
    down = f"model.layers.0.mlp.down_proj.{payload}"
    assert down in set(tensors_of_file(src / "model.safetensors"))  # the library's layout
    reshard(src, tmp_path / "tp2", mesh=Mesh(tp=2))
    rank = {
        k: v
        for f in sorted((tmp_path / "tp2").glob("rank-*.safetensors"))[:1]
        for k, v in tensors_of_file(f).items()
    }
    from shardctl.io.safetensors_header import read_header

    shapes = {
        e.name: e.shape for e in read_header(sorted((tmp_path / "tp2").glob("rank-*"))[0]).tensors
    }
    full = {e.name: e.shape for e in read_header(src / "model.safetensors").tensors}
    assert shapes[down] == (full[down][0], full[down][1] // 2)  # rowwise: in-features halved
    scale = "model.layers.0.mlp.down_proj.weight_scale"
    if preset == "fp8-dynamic":  # per output channel [out, 1]: whole on every rank
        assert shapes[scale] == full[scale]
    else:  # per group of in-features: half the groups
        assert shapes[scale] == (full[scale][0], full[scale][1] // 2)
    assert rank  # the rank file holds data
    if preset == "w4a16-asym":  # the forward level on the dequantized shards (zero points too)
        from shardctl.verify.api import verify

        result = verify(src, tmp_path / "tp2", device="cpu", simulate=True)
        assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    reshard(tmp_path / "tp2", tmp_path / "merged")
    same_checkpoint(src, tmp_path / "merged")
    # plan: the checkpoint's bytes per rank, and the same from its config.json alone
    written = [
        sum(len(b) for b in tensors_of_file(f).values())
        for f in sorted((tmp_path / "tp2").glob("rank-*.safetensors"))
    ]
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_bytes((src / "config.json").read_bytes())
    for model in (from_checkpoint(src), from_config_file(cfg_dir / "config.json")):
        per = rank_weight_bytes(model, Mesh(tp=2))
        assert [per[(0, 0, r)] for r in range(2)] == written, model.source
    quant = json.loads((src / "config.json").read_text())["quantization_config"]
    assert quant["format"] == FORMATS[preset]
