"""Quantized test checkpoints in each scheme's published on-disk layout.

Each writer starts from a real checkpoint written by transformers' ``save_pretrained``
(tests/_models.py), quantizes its decoder-layer linear weights by round-to-nearest (real
quantized values, not placeholders) and writes them with ``safetensors.torch.save_file`` under
the names, dtypes and shapes of the published checkpoints, checked against their headers
(read through the search tool):

- FP8 block: deepseek-ai/DeepSeek-V3 ``model.safetensors.index.json`` and Qwen/Qwen3-8B-FP8
  (``model.layers.0.mlp.down_proj.weight`` F8_E4M3 [4096, 12288],
  ``...down_proj.weight_scale_inv`` F32 [32, 96]; config ``quantization_config``
  ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}``).
- GPTQ: TheBloke/Llama-2-7B-GPTQ (``down_proj.qweight`` I32 [1376, 4096], ``qzeros`` I32
  [86, 512], ``scales`` F16 [86, 4096], ``g_idx`` I32 [11008]); AutoGPTQ v1 packing: 8 int4
  per int32 along in-features, low nibble first; zeros stored minus one.
- AWQ: TheBloke/Llama-2-7B-AWQ / hugging-quants Llama-3-8B-AWQ (``qweight`` I32 [in, out/8],
  ``qzeros`` I32 [in/g, out/8], ``scales`` F16 [in/g, out]); AutoAWQ interleaved nibble order
  ``[0, 2, 4, 6, 1, 3, 5, 7]``.
- MXFP4: openai/gpt-oss-20b index (``mlp.experts.gate_up_proj_blocks`` U8 [32, 5760, 90, 16],
  ``..._scales`` U8 [32, 5760, 90]).

compressed-tensors (NVFP4, pack-quantized) checkpoints are written by the ``compressed-tensors``
library itself (tests/test_quant_compressed.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantizable(name: str, t: Any) -> bool:
    """Decoder-layer linear weights; norms and MoE routers stay 16-bit (as GPTQ/AWQ/vLLM do)."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and t.ndim == 2
        and "norm" not in name
        and not name.endswith(".gate.weight")
    )


def _rewrite(
    src: Path,
    dst: Path,
    quant_config: dict[str, Any],
    quantize: Callable[[str, Any], dict[str, Any]],
) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if quantizable(name, t):
            out.update(quantize(name[: -len(".weight")], t))
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# ---- FP8 block (DeepSeek-V3 / Qwen3-FP8) -------------------------------------------------


def fp8_block(src: Path, dst: Path, block: int = 128) -> Path:
    import torch

    def quantize(base: str, w: Any) -> dict[str, Any]:
        out_f, in_f = w.shape
        bo, bi = -(-out_f // block), -(-in_f // block)
        padded = torch.zeros(bo * block, bi * block)
        padded[:out_f, :in_f] = w.float()
        blocks = padded.view(bo, block, bi, block)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / 448.0  # e4m3 max
        q = (blocks / scale[:, None, :, None]).view(bo * block, bi * block)[:out_f, :in_f]
        return {
            f"{base}.weight": q.to(torch.float8_e4m3fn),
            f"{base}.weight_scale_inv": scale.to(torch.float32).contiguous(),
        }

    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    return _rewrite(src, dst, qc, quantize)


# ---- int4 RTN shared by GPTQ and AWQ -----------------------------------------------------


def _int4_groups(w: Any, g: int) -> tuple[Any, Any, Any]:
    """Asymmetric int4 per group of ``g`` in-features: (q [out, in], zeros [G, out], scales)."""
    import torch

    out_f, in_f = w.shape
    x = w.float().view(out_f, in_f // g, g)
    lo, hi = x.amin(-1), x.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(x / scale[..., None]) + zero[..., None], 0, 15)
    return q.view(out_f, in_f).to(torch.int32), zero.T.to(torch.int32), scale.T


def pack_rows(q: Any, order: tuple[int, ...] = tuple(range(8))) -> Any:
    """int4 values [n, m] → int32 [n/8, m]: value ``8k + order[j]`` in nibble ``j``."""
    import torch

    n, m = q.shape
    v = q.view(n // 8, 8, m).to(torch.int64)
    acc = torch.zeros(n // 8, m, dtype=torch.int64)
    for j, src in enumerate(order):
        acc |= (v[:, src, :] & 0xF) << (4 * j)
    return (acc - ((acc >> 31) & 1) * (1 << 32)).to(torch.int32)  # two's complement


def pack_cols(q: Any, order: tuple[int, ...] = tuple(range(8))) -> Any:
    return pack_rows(q.T.contiguous(), order).T.contiguous()


def gptq(src: Path, dst: Path, group: int = 128, *, desc_act: bool = False, seed: int = 0) -> Path:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def quantize(base: str, w: Any) -> dict[str, Any]:
        in_f = w.shape[1]
        q, zero, scale = _int4_groups(w, group)
        g_idx = torch.arange(in_f, dtype=torch.int32) // group
        if desc_act:
            # act-order: in-features visited in a permuted order, groups follow that order
            perm = torch.randperm(in_f, generator=gen)
            g_idx = torch.empty(in_f, dtype=torch.int32)
            g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // group
            q, zero, scale = _regroup(w, g_idx, in_f // group)
        return {
            f"{base}.qweight": pack_rows(q.T.contiguous()),  # [in/8, out]
            f"{base}.qzeros": pack_cols(zero - 1),  # [G, out/8], v1: zeros minus one
            f"{base}.scales": scale.to(torch.float16).contiguous(),
            f"{base}.g_idx": g_idx,
        }

    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": desc_act,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    return _rewrite(src, dst, qc, quantize)


def _regroup(w: Any, g_idx: Any, groups: int) -> tuple[Any, Any, Any]:
    """RTN int4 where in-feature ``i`` belongs to group ``g_idx[i]`` (act-order)."""
    import torch

    out_f = w.shape[0]
    x = w.float()
    scale = torch.empty(groups, out_f)
    zero = torch.empty(groups, out_f)
    for k in range(groups):
        cols = x[:, g_idx == k]
        lo, hi = cols.amin(1), cols.amax(1)
        scale[k] = ((hi - lo) / 15).clamp(min=1e-6)
        zero[k] = torch.round(-lo / scale[k]).clamp(0, 15)
    s, z = scale[g_idx.long()].T, zero[g_idx.long()].T  # [out, in]
    q = torch.clamp(torch.round(x / s) + z, 0, 15).to(torch.int32)
    return q, zero.to(torch.int32), scale


def awq(src: Path, dst: Path, group: int = 128) -> Path:
    import torch

    def quantize(base: str, w: Any) -> dict[str, Any]:
        q, zero, scale = _int4_groups(w, group)
        return {
            f"{base}.qweight": pack_cols(q.T.contiguous(), AWQ_ORDER),  # [in, out/8]
            f"{base}.qzeros": pack_cols(zero, AWQ_ORDER),  # [G, out/8]
            f"{base}.scales": scale.to(torch.float16).contiguous(),
        }

    qc = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    return _rewrite(src, dst, qc, quantize)


# ---- MXFP4 (gpt-oss) ----------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_pack(w: Any) -> tuple[Any, Any]:
    """float ``[*lead, in, out]`` (gpt-oss bf16 layout) → (blocks U8 ``[*lead, out, in/32, 16]``,
    scales U8 e8m0 ``[*lead, out, in/32]``): one power-of-two scale per 32 values (OCP MX v1.0),
    e2m1 codes (sign in bit 3), two per byte, low nibble first."""
    import torch

    x = w.float().transpose(-1, -2)  # [*lead, out, in]
    *lead, out_f, in_f = x.shape
    g = x.reshape(*lead, out_f, in_f // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0**-120)
    exp = torch.floor(torch.log2(amax)) - 2  # e2m1 max 6 = 1.5 · 2^2
    scaled = g / torch.pow(2.0, exp).unsqueeze(-1)
    grid = torch.tensor(E2M1)
    mag = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    code = mag | ((scaled < 0).to(torch.int64) << 3)
    code = code.reshape(*lead, out_f, in_f // 32, 16, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)
