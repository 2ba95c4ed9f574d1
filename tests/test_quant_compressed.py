"""compressed-tensors checkpoints written by the ``compressed-tensors`` library itself (the
format llm-compressor and NVIDIA Model Optimizer exports use): NVFP4 (``weight_packed`` U8, FP8
``weight_scale`` per 16, ``weight_global_scale``), int4 pack-quantized (``weight_packed`` I32,
``weight_scale`` per group, ``weight_shape``, ``weight_zero_point`` when asymmetric), FP8
float-quantized (dynamic and static) and INT8 int-quantized / naive-quantized (RedHatAI's W8A8
and W8A16 releases; per channel, per group, with zero points and static input scales).

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
    "fp8-static": "FP8",  # per-tensor weight scale, static input_scale
    "fp8-block": "FP8_BLOCK",  # a scale per 128 x 128 block (RedHatAI's FP8-block releases)
    "w8a8": "W8A8",  # RedHatAI's INT8 W8A8 releases: per-channel I8, dynamic per-token acts
    "w8a16": "W8A16",  # I8 per group of 128
    "w8a8-naive": "W8A8",
    "int8-asym-static": "",  # custom: I8 per group of 64 with zero points, static acts
}
FORMATS = {
    "nvfp4": "nvfp4-pack-quantized",
    "w4a16": "pack-quantized",
    "w4a16-asym": "pack-quantized",
    "fp8-dynamic": "float-quantized",
    "fp8-static": "float-quantized",
    "fp8-block": "float-quantized",
    "w8a8": "int-quantized",
    "w8a16": "int-quantized",
    "w8a8-naive": "naive-quantized",
    "int8-asym-static": "int-quantized",
}
# the stored payload: one value per element (F8 / I8 ``weight``), or packed ``weight_packed``
UNPACKED = {
    "fp8-dynamic",
    "fp8-static",
    "fp8-block",
    "w8a8",
    "w8a16",
    "w8a8-naive",
    "int8-asym-static",
}


def _scheme(preset: str) -> object:
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    if PRESETS[preset]:
        return preset_name_to_scheme(PRESETS[preset], ["Linear"])
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=8, type="int", strategy="group", group_size=64, symmetric=False
        ),
        input_activations=QuantizationArgs(
            num_bits=8, type="int", strategy="tensor", symmetric=False, dynamic=False
        ),
    )


def write_compressed(preset: str, out: Path) -> Path:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama-quant"), dtype=torch.bfloat16)
    scheme = _scheme(preset)
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
            elif args.strategy == "tensor":
                x = w.reshape(1, 1, -1)
            elif args.strategy == "block":
                bo, bi = args.block_structure
                o, i = w.shape[0] // bo, w.shape[1] // bi
                x = w.reshape(o, bo, i, bi).permute(0, 2, 1, 3).reshape(o, i, bo * bi)
            else:  # per channel
                x = w.view(w.shape[0], 1, -1)
            s, z = calculate_qparams(x.amin(-1), x.amax(-1), args, global_scale=gs)
            mod.weight_scale.data.copy_(
                s.reshape(mod.weight_scale.shape).to(mod.weight_scale.dtype)
            )
            zp = mod.weight_zero_point
            zp.data.copy_(z.reshape(zp.shape).to(zp.dtype))
            if hasattr(mod, "input_scale"):  # static activations: any calibrated value
                mod.input_scale.data.fill_(0.0173)
                if hasattr(mod, "input_zero_point"):
                    mod.input_zero_point.data.fill_(-3)
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
        if k.endswith(".weight") and t[k].dtype in (torch.float8_e4m3fn, torch.int8):
            base = k.removesuffix(".weight")  # float- / int- / naive-quantized
            zp = t.get(f"{base}.weight_zero_point")
            out[k] = dequantize(
                t[k].float(), t[f"{base}.weight_scale"].float(), zp, args, dtype=torch.float32
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
    payload = "weight" if preset in UNPACKED else "weight_packed"
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
    up = f"model.layers.0.mlp.up_proj.{payload}"
    assert shapes[up] == (full[up][0] // 2, full[up][1])  # colwise: out-features halved
    base = "model.layers.0.mlp.down_proj"
    scale = f"{base}.weight_scale"
    if full[scale][-1] == 1:  # per tensor [1] or per output channel [out, 1]: whole
        assert shapes[scale] == full[scale]
    else:  # per group of in-features: half the groups
        assert shapes[scale] == (full[scale][0], full[scale][1] // 2)
    if preset in UNPACKED:  # an I8 zero point per scale, split as the scale
        assert shapes.get(f"{base}.weight_zero_point") == (
            shapes[scale] if f"{base}.weight_zero_point" in full else None
        )
    for name in ("input_scale", "input_zero_point"):  # static activations: whole
        assert shapes.get(f"{base}.{name}") == full.get(f"{base}.{name}")
    assert rank  # the rank file holds data
    if preset in ("w4a16-asym", "w8a8", "int8-asym-static"):  # forward level, zero points too
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
