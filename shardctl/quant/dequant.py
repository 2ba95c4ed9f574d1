"""Dequantize stored quantized tensors into the logical weights, for verify's forward level.

Works on whole checkpoints and on one rank's local tensors alike: a rank's members are the
same scheme at local sizes, so each rank dequantizes what it holds (its scales must be the
ones of its weight's blocks, or its weights come out wrong and the logits fail). The
reference is the unsharded checkpoint dequantized by the same functions.

Formulas (per element, computed in float32, then cast to the model's dtype):

- FP8 block: ``w · scale_inv[i // bo, j // bi]`` (DeepSeek-V3 ``weight_dequant``);
  FP8 per-tensor / per-channel: ``w · weight_scale``;
- compressed-tensors int-quantized / float-quantized: ``(q - weight_zero_point) · weight_scale``
  (no zero point when symmetric), the scale per tensor, channel, group or block;
- GPTQ (AutoGPTQ v1): ``(q[i, o] - (z[g(i), o] + 1)) · s[g(i), o]``, ``g(i) = g_idx[i]`` with
  act-order, else ``i // group_size`` (vLLM ignores g_idx without act-order);
- AWQ: ``(q - z[i // g]) · s[i // g]``, nibbles in AutoAWQ's order ``[0, 2, 4, 6, 1, 3, 5, 7]``;
- MXFP4 (transformers ``convert_moe_packed_tensors``): e2m1 codes, low nibble first, times
  ``2^(scale - 127)`` per 32, then ``[*lead, out, in]`` transposed to the logical
  ``[*lead, in, out]``.

- compressed-tensors NVFP4: e2m1 codes (low nibble first) times ``weight_scale /
  weight_global_scale`` per 16 (compressed-tensors ``dequantize``);
- compressed-tensors pack-quantized: ``(q - zp) · s[i // g]``, q and zp stored with an offset of
  ``2^(bits-1)`` (``pack_to_int32``), 32/bits per int32, low bits first along in-features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.model.types import TensorInfo
from shardctl.quant.groups import SCHEME_NAMES, QuantGroup, group_tensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORWARD_SCHEMES = (
    "fp8-block",
    "fp8",
    "ct-fp8",
    "ct-int",
    "gptq",
    "awq",
    "mxfp4",
    "nvfp4",
    "ct-pack",
)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_CODES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int32": "I32",
    "int64": "I64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
}


def without_quant(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the dequantized model (no ``quantization_config``)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def forward_refusal(config: Mapping[str, Any]) -> str | None:
    """Why the forward level cannot dequantize this model (checked before any rank starts),
    or None."""
    from shardctl.quant.config import read_quant

    qc = read_quant(config)
    if qc is not None and qc.method == "awq" and qc.bits != 4:
        return f"it dequantizes AWQ int4 only (AutoAWQ's nibble order), not int{qc.bits}"
    return None


def model_dtype(config: Mapping[str, Any]) -> Any:
    """The dequantized model's dtype: the config's ``torch_dtype`` / ``dtype``, else bfloat16."""
    import torch

    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value in ("bfloat16", "float16", "float32"):
            return getattr(torch, value)
    return torch.bfloat16


def dequantize(tensors: dict[str, Any], config: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """``tensors`` with every quantized group replaced by its logical weight in ``dtype``;
    unchanged (the same dict) for an unquantized model."""
    if config.get("quantization_config") is None:
        return tensors
    infos = [
        TensorInfo(k, tuple(t.shape), _CODES.get(str(t.dtype).removeprefix("torch."), "U8"))
        for k, t in tensors.items()
    ]
    groups = group_tensors(infos, config, where="forward")
    out = {k: t for k, t in tensors.items() if k not in groups}
    done: set[str] = set()
    for g in groups.values():
        if g.logical.fqn in done:
            continue
        done.add(g.logical.fqn)
        out[g.logical.fqn] = _one(g, tensors, config).to(dtype)
    return out


def _one(g: QuantGroup, t: dict[str, Any], config: Mapping[str, Any]) -> Any:
    m = {x.role: x for x in g.members}
    if g.scheme == "fp8-block":
        w = t[m["weight"].info.fqn].float()
        s = t[m["weight_scale_inv"].info.fqn].float()
        bo, bi = (a.factor for a in m["weight_scale_inv"].axes)
        full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        return w * full[: w.shape[0], : w.shape[1]]
    if g.scheme in ("fp8", "ct-fp8", "ct-int"):
        w = t[m["weight"].info.fqn].float()
        if "weight_zero_point" in m:
            w = w - _per_element(t[m["weight_zero_point"].info.fqn].float(), m["weight_scale"], w)
        return w * _per_element(t[m["weight_scale"].info.fqn].float(), m["weight_scale"], w)
    if g.scheme == "gptq":
        return _gptq(g, m, t, config)
    if g.scheme == "awq":
        if int((config.get("quantization_config") or {}).get("bits", 4)) != 4:
            raise InvalidInputError(
                "verify's forward level reads AWQ int4 only (AutoAWQ's nibble order)",
                hint="use --level bitwise",
            )
        q = _unpack_cols(t[m["qweight"].info.fqn], AWQ_ORDER)  # [in, out]
        s = t[m["scales"].info.fqn].float()  # [G, out]
        z = _unpack_cols(t[m["qzeros"].info.fqn], AWQ_ORDER).float()
        gi = _group_index(q.shape[0], s.shape[0])
        return ((q.float() - z[gi]) * s[gi]).T.contiguous()
    if g.scheme == "mxfp4":
        return mxfp4(t[m["blocks"].info.fqn], t[m["scales"].info.fqn])
    if g.scheme == "nvfp4":
        import torch

        lut = torch.tensor(E2M1, dtype=torch.float32)
        b = t[m["weight_packed"].info.fqn].to(torch.int64)
        w = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [out, in]
        scale = t[m["weight_scale"].info.fqn].float() / t[
            m["weight_global_scale"].info.fqn
        ].float().reshape(())
        return w * scale.repeat_interleave(16, -1)[:, : w.shape[1]]
    if g.scheme == "ct-pack":
        return _ct_pack(m, t, config)
    raise InvalidInputError(
        f"verify's forward level cannot dequantize {SCHEME_NAMES[g.scheme]} weights "
        f"({g.logical.fqn})",
        hint=f"use --level bitwise; forward dequantizes {', '.join(FORWARD_SCHEMES)}",
    )


def _per_element(s: Any, member: Any, w: Any) -> Any:
    """A per-tensor / per-channel / per-group / per-block ``s`` broadcast to ``w``'s shape (or
    to a shape that broadcasts to it)."""
    if s.numel() == 1:
        return s.reshape(())
    if s.shape[0] == w.shape[0] and s.numel() == w.shape[0]:
        return s.reshape(-1, 1)
    bo, bi = (a.factor for a in member.axes)
    full = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return full[: w.shape[0], : w.shape[1]]


def _ct_pack(m: Mapping[str, Any], t: dict[str, Any], config: Mapping[str, Any]) -> Any:
    qc = config.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    first: Any = next(iter(groups.values()), {}) if isinstance(groups, Mapping) else {}
    bits = int((first.get("weights") or {}).get("num_bits", 4))
    if 32 % bits:
        raise InvalidInputError(
            f"compressed-tensors num_bits {bits}: values straddle int32 words",
            hint="use --level bitwise",
        )
    offset = 1 << (bits - 1)
    q = _unpack_rows(t[m["weight_packed"].info.fqn].T.contiguous(), bits=bits).T  # [out, in]
    s = t[m["weight_scale"].info.fqn].float()  # [out, G]
    if "weight_zero_point" in m:
        zp = _unpack_rows(t[m["weight_zero_point"].info.fqn], bits=bits)[: s.shape[0]]
    else:
        zp = offset
    group = -(-q.shape[1] // s.shape[1])
    if "weight_g_idx" in m:  # act-order: in-feature i uses group g_idx[i]
        import torch

        gi = t[m["weight_g_idx"].info.fqn].to(torch.long)
        zf = zp.float()[:, gi] if "weight_zero_point" in m else zp
        return (q.float() - zf) * s[:, gi]
    full_s = s.repeat_interleave(group, -1)[:, : q.shape[1]]
    full_z = (
        zp.float().repeat_interleave(group, -1)[:, : q.shape[1]] if "weight_zero_point" in m else zp
    )
    return (q.float() - full_z) * full_s


def _gptq(g: QuantGroup, m: Mapping[str, Any], t: dict[str, Any], config: Mapping[str, Any]) -> Any:
    import torch

    qc = config.get("quantization_config") or {}
    bits = int(qc.get("bits", 4))
    q = _unpack_rows(t[m["qweight"].info.fqn], bits=bits)  # [in, out]
    s = t[m["scales"].info.fqn].float()  # [G, out]
    z = _unpack_cols(t[m["qzeros"].info.fqn], bits=bits).float() + 1  # v1: stored minus one
    if qc.get("desc_act") and "g_idx" in m:
        gi = t[m["g_idx"].info.fqn].to(torch.long)
    else:
        gi = _group_index(q.shape[0], s.shape[0])
    return ((q.float() - z[gi]) * s[gi]).T.contiguous()


def _group_index(rows: int, groups: int) -> Any:
    """In-feature ``i``'s group without act-order: ``i // group_size`` (local rows)."""
    import torch

    size = -(-rows // groups)
    return torch.arange(rows) // size


def _unpack_rows(packed: Any, order: tuple[int, ...] | None = None, *, bits: int = 4) -> Any:
    """int32 [n/k, m] → ``bits``-bit values [n, m] (k = 32 / bits): field ``j`` (lowest first)
    holds row ``k·r + order[j]``."""
    import torch

    k = 32 // bits
    order = order or tuple(range(k))
    p = packed.to(torch.int64) & 0xFFFFFFFF
    nk, cols = p.shape
    out = torch.empty(nk, k, cols, dtype=torch.int64)
    mask = (1 << bits) - 1
    for j, dst in enumerate(order):
        out[:, dst, :] = (p >> (bits * j)) & mask
    return out.reshape(nk * k, cols)


def _unpack_cols(packed: Any, order: tuple[int, ...] | None = None, *, bits: int = 4) -> Any:
    return _unpack_rows(packed.T.contiguous(), order, bits=bits).T.contiguous()


def mxfp4(blocks: Any, scales: Any) -> Any:
    """``blocks`` U8 ``[*lead, out, in/32, 16]``, ``scales`` U8 ``[*lead, out, in/32]`` →
    float32 ``[*lead, in, out]``."""
    import torch

    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.int64)
    lo, hi = lut[b & 0x0F], lut[b >> 4]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # [*lead, out, in/32, 32]
    exp = scales.to(torch.int32) - 127
    vals = torch.ldexp(vals, exp.unsqueeze(-1).to(torch.float32))
    w = vals.flatten(-2)  # [*lead, out, in]
    return w.transpose(-1, -2).contiguous()
