"""config.json with ``quantization_config`` → the stored tensors a quantized checkpoint holds.

``plan`` on a manifest or config without a checkpoint needs the real bytes too: each weight the
family marks quantizable (``Family.quantizable``, fqn globs; minus ``modules_to_not_convert`` /
``ignore``) becomes the members its scheme stores, with the shapes and dtypes of
:mod:`shardctl.quant.groups` (so the layout places them exactly as a checkpoint's)::

    down_proj.weight [4096, 11008] BF16, gptq int4 g128 ->
        qweight I32 [1376, 4096], qzeros I32 [86, 512], scales F16 [86, 4096], g_idx I32 [11008]
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from shardctl.globs import first_match
from shardctl.model.types import TensorInfo
from shardctl.quant.config import CT_UNPACKED, QuantConfig, read_quant


def expand(
    tensors: Iterable[TensorInfo],
    config: Mapping[str, Any],
    quantizable: tuple[str, ...],
    *,
    where: str = "config",
) -> tuple[TensorInfo, ...]:
    """``tensors`` (the unquantized inventory) as the quantized checkpoint stores them."""
    qc = read_quant(config, where=where)
    tensors = tuple(tensors)
    if qc is None or not quantizable:
        return tensors
    quantized = first_match(quantizable)
    # MXFP4 quantizes packed experts [E, in, out]; the other schemes 2-D [out, in] weights
    ndim = 3 if qc.method == "mxfp4" else 2
    ignored = _ignorer(qc)
    out: list[TensorInfo] = []
    for t in tensors:
        if len(t.shape) == ndim and quantized(t.fqn) is not None and not ignored(t.fqn):
            out += members(t, qc)
        else:
            out.append(t)
    return tuple(sorted(out, key=lambda t: t.fqn))


def _ignorer(qc: QuantConfig) -> Callable[[str], bool]:
    """Whether a tensor is left unquantized: ``modules_to_not_convert`` names modules
    (``lm_head``, ``gate``) or globs of them (gpt-oss: ``model.layers.*.self_attn``);
    compressed-tensors ``ignore`` also takes ``re:`` patterns. A name covers the module and
    everything inside it. Names and globs are one compiled regex over the module (one call per
    tensor, not one per entry); each ``re:`` pattern is matched as given."""
    regexes = [re.compile(n[3:]).match for n in qc.ignore if n.startswith("re:")]
    parts: list[str] = []
    for name in qc.ignore:
        if name.startswith("re:"):
            continue
        # the name as whole dotted parts of the module: ".name." within ".module."
        parts.append(rf"(?:.*\.)?{re.escape(name)}(?:\..*)?\Z")
        if any(ch in name for ch in "*?["):
            parts += [fnmatch.translate(name), fnmatch.translate(f"{name}.*")]
    named = re.compile("|".join(f"(?:{p})" for p in parts), re.DOTALL).match if parts else None

    def ignored(fqn: str) -> bool:
        module = fqn.rsplit(".", 1)[0]
        return bool(named and named(module)) or any(r(module) for r in regexes)

    return ignored


def members(t: TensorInfo, qc: QuantConfig) -> list[TensorInfo]:
    """The stored tensors of one quantized weight ``t`` (``[out, in]``, or ``[E, in, out]`` for
    MXFP4's packed experts)."""
    if qc.method == "mxfp4":
        *lead, in_f, out_f = t.shape
        base = t.fqn
        return [
            TensorInfo(f"{base}_blocks", (*lead, out_f, -(-in_f // 32), 16), "U8"),
            TensorInfo(f"{base}_scales", (*lead, out_f, -(-in_f // 32)), "U8"),
        ]
    out_f, in_f = t.shape[-2:]
    base = t.fqn.removesuffix(".weight")
    pack = 32 // qc.bits
    groups = 1 if qc.group_size == -1 else -(-in_f // qc.group_size)
    if qc.method == "fp8":
        if qc.block:
            bo, bi = qc.block
            scale = TensorInfo(f"{base}.weight_scale_inv", (-(-out_f // bo), -(-in_f // bi)), "F32")
        elif qc.channel:  # FBGEMM: an F32 scale per output row
            scale = TensorInfo(f"{base}.weight_scale", (out_f, 1), "F32")
        else:
            scale = TensorInfo(f"{base}.weight_scale", (), "F32")
        return [TensorInfo(t.fqn, t.shape, "F8_E4M3"), scale]
    if qc.method == "gptq":
        return [
            TensorInfo(f"{base}.qweight", (in_f // pack, out_f), "I32"),
            TensorInfo(f"{base}.qzeros", (groups, out_f // pack), "I32"),
            TensorInfo(f"{base}.scales", (groups, out_f), "F16"),
            TensorInfo(f"{base}.g_idx", (in_f,), "I32"),
        ]
    if qc.method == "awq":
        return [
            TensorInfo(f"{base}.qweight", (in_f, out_f // pack), "I32"),
            TensorInfo(f"{base}.qzeros", (groups, out_f // pack), "I32"),
            TensorInfo(f"{base}.scales", (groups, out_f), "F16"),
        ]
    # compressed-tensors
    if qc.fmt == "nvfp4-pack-quantized":
        out = [
            TensorInfo(f"{base}.weight_packed", (out_f, in_f // 2), "U8"),
            TensorInfo(f"{base}.weight_scale", (out_f, -(-in_f // 16)), "F8_E4M3"),
            TensorInfo(f"{base}.weight_global_scale", (1,), "F32"),
        ]
        if qc.input_scales:  # NVFP4 (W4A4); NVFP4A16 stores none
            out.append(TensorInfo(f"{base}.input_global_scale", (1,), "F32"))
        return out
    if qc.fmt in CT_UNPACKED:
        return _unpacked(t, qc, base)
    out = [
        TensorInfo(f"{base}.weight_packed", (out_f, in_f // pack), "I32"),
        TensorInfo(f"{base}.weight_scale", (out_f, groups), t.dtype),
        TensorInfo(f"{base}.weight_shape", (2,), "I64"),
    ]
    if not qc.symmetric:
        out.append(TensorInfo(f"{base}.weight_zero_point", (-(-out_f // pack), groups), "I32"))
    return out


def _unpacked(t: TensorInfo, qc: QuantConfig, base: str) -> list[TensorInfo]:
    """compressed-tensors ``float-quantized`` / ``int-quantized`` / ``naive-quantized``: the
    weight one value per element (F8_E4M3 or I8), ``weight_scale`` in the model's dtype shaped
    by the strategy (``[1]`` per tensor, ``[out, 1]`` per channel, ``[out, in/g]`` per group,
    ``[out/bo, in/bi]`` per block), an I8 ``weight_zero_point`` alike when asymmetric, and
    static activations' ``input_scale`` (+ ``input_zero_point``) ``[1]``: the tensors
    ``ModelCompressor.compress_model`` + ``save_pretrained`` write."""
    out_f, in_f = t.shape[-2:]
    if qc.strategy == "tensor":
        scale: tuple[int, ...] = (1,)
    elif qc.strategy == "group":
        scale = (out_f, -(-in_f // qc.group_size))
    elif qc.strategy == "block" and qc.block:
        scale = (-(-out_f // qc.block[0]), -(-in_f // qc.block[1]))
    else:  # channel, the default
        scale = (out_f, 1)
    out = [
        TensorInfo(t.fqn, t.shape, "F8_E4M3" if qc.wtype == "float" else "I8"),
        TensorInfo(f"{base}.weight_scale", scale, t.dtype),
    ]
    if not qc.symmetric:
        out.append(TensorInfo(f"{base}.weight_zero_point", scale, "I8"))
    if qc.static_inputs:
        out.append(TensorInfo(f"{base}.input_scale", (1,), t.dtype))
        if not qc.inputs_symmetric:
            out.append(TensorInfo(f"{base}.input_zero_point", (1,), "I8"))
    return out
