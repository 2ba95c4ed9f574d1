"""``quantization_config`` (config.json) → a typed :class:`QuantConfig`; no torch.

The methods shardctl reads, with the fields each one's on-disk layout depends on:

==================== ========================================================================
``quant_method``     fields
==================== ========================================================================
``fp8``              ``weight_block_size`` ``[128, 128]`` (DeepSeek-V3, Qwen3-FP8): block
                     scales ``weight_scale_inv``; absent: per-tensor / per-channel
                     ``weight_scale``
``gptq``             ``bits`` (4), ``group_size`` (128, ``-1`` = one group), ``desc_act``
``awq``              ``bits`` (``w_bit``), ``group_size`` (``q_group_size``)
``compressed-tensors`` ``format`` (``pack-quantized``, ``nvfp4-pack-quantized``,
                     ``float-quantized``, ``int-quantized``, ``naive-quantized``),
                     ``config_groups.*.weights`` (num_bits, type, strategy, group_size,
                     block_structure, symmetric), ``input_activations`` (``dynamic``: false
                     stores ``input_scale``)
``mxfp4``            none (gpt-oss: ``*_blocks`` / ``*_scales``, 32 values per scale)
``fbgemm_fp8``       none (Meta's Llama-3.1-405B-FP8: ``weight`` F8_E4M3, ``weight_scale`` F32
                     ``[out, 1]`` per row; ``modules_to_not_convert`` stay bf16)
==================== ========================================================================

``modules_to_not_convert`` (transformers) and ``ignore`` (compressed-tensors) name modules kept
in the model's 16-bit dtype; they matter only when shapes come from the config (``plan``
without a checkpoint), since a checkpoint's names already say which tensors are quantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardctl.errors import InvalidInputError

METHODS: tuple[str, ...] = ("fp8", "gptq", "awq", "compressed-tensors", "mxfp4", "fbgemm_fp8")
CT_FORMATS: tuple[str, ...] = (
    "pack-quantized",
    "nvfp4-pack-quantized",
    "float-quantized",
    "int-quantized",
    "naive-quantized",
)
# compressed-tensors formats that store the quantized values one per element (I8 or F8_E4M3,
# the weight's own shape) beside ``weight_scale`` shaped by the strategy (RedHatAI's W8A8 /
# W8A16 INT8 releases are ``int-quantized``, FP8 ones ``float-quantized``).
CT_UNPACKED: tuple[str, ...] = ("float-quantized", "int-quantized", "naive-quantized")
CT_STRATEGIES: tuple[str, ...] = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class QuantConfig:
    """One checkpoint's quantization, as its config says.

    >>> read_quant({"quantization_config": {"quant_method": "gptq", "bits": 4,
    ...     "group_size": 128, "desc_act": False}}).describe()
    'gptq int4 group_size 128'
    """

    method: str
    bits: int = 4
    group_size: int = 128  # -1: one group over all in-features
    desc_act: bool = False  # GPTQ act-order: g_idx permutes in-features into groups
    block: tuple[int, int] | None = None  # fp8 weight_block_size (out, in)
    fmt: str = ""  # compressed-tensors format
    input_scales: bool = False  # compressed-tensors: static activation scales are stored
    symmetric: bool = True  # compressed-tensors pack-quantized: no weight_zero_point
    ignore: tuple[str, ...] = ()
    channel: bool = False  # fp8: one F32 scale per output row (FBGEMM ``fbgemm_fp8``)
    # compressed-tensors: ``weights.strategy`` (tensor, channel, group, block; "" if not
    # given), ``weights.type`` ("int" or "float"), and whether ``input_activations`` are
    # static (``dynamic: false``: an ``input_scale`` per weight is stored, with an
    # ``input_zero_point`` when they are asymmetric)
    strategy: str = ""
    wtype: str = "int"
    static_inputs: bool = False
    inputs_symmetric: bool = True

    def describe(self) -> str:
        if self.method == "fp8":
            if self.channel:
                return "fp8 e4m3 per-row (fbgemm_fp8)"
            if self.block:
                return f"fp8 e4m3 block {self.block[0]}x{self.block[1]}"
            return "fp8 e4m3 per-tensor/channel"
        if self.method in ("gptq", "awq"):
            g = "per-channel" if self.group_size == -1 else f"group_size {self.group_size}"
            act = " desc_act" if self.desc_act else ""
            return f"{self.method} int{self.bits} {g}{act}"
        if self.method == "compressed-tensors":
            if self.fmt in CT_UNPACKED:
                kind = "fp8 e4m3" if self.wtype == "float" else f"int{self.bits}"
                how = {
                    "tensor": "per-tensor",
                    "group": f"group_size {self.group_size}",
                    "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block",
                }.get(self.strategy, "per-channel")
                acts = " static activations" if self.static_inputs else ""
                return f"compressed-tensors {self.fmt} {kind} {how}{acts}"
            return f"compressed-tensors {self.fmt} int{self.bits} group_size {self.group_size}"
        return "mxfp4 (e2m1, e8m0 scale per 32)"


def read_quant(config: Mapping[str, Any], *, where: str = "config") -> QuantConfig | None:
    """The config's quantization, or None for an unquantized model."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    w = f"{where}: quantization_config"
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"expected an object, got {type(raw).__name__}", where=w)
    method = raw.get("quant_method")
    if method not in METHODS:
        raise InvalidInputError(
            f"quant_method {method!r} is not supported",
            where=w,
            hint=f"shardctl reads quant_method {', '.join(METHODS)}",
        )
    ignore = _names(raw.get("modules_to_not_convert") or raw.get("ignore") or [], w)
    if method == "fbgemm_fp8":
        return QuantConfig("fp8", bits=8, ignore=ignore, channel=True)
    if method == "fp8":
        block = raw.get("weight_block_size")
        if block is None:
            return QuantConfig("fp8", bits=8, ignore=ignore)
        pair = isinstance(block, (list, tuple)) and len(block) == 2  # inline manifests: tuples
        if not pair or not all(_positive(b) for b in block):
            raise InvalidInputError(
                f"weight_block_size: expected [rows, cols] of positive integers, got {block!r}",
                where=w,
            )
        return QuantConfig("fp8", bits=8, block=(block[0], block[1]), ignore=ignore)
    if method in ("gptq", "awq"):
        bits = raw.get("bits", raw.get("w_bit", 4))
        group = raw.get("group_size", raw.get("q_group_size", 128))
        if bits not in (2, 4, 8):
            raise InvalidInputError(f"bits: expected 2, 4 or 8, got {bits!r}", where=w)
        if not (group == -1 or _positive(group)):
            raise InvalidInputError(
                f"group_size: expected a positive integer or -1, got {group!r}", where=w
            )
        desc = raw.get("desc_act", False)
        if not isinstance(desc, bool):
            raise InvalidInputError(f"desc_act: expected true or false, got {desc!r}", where=w)
        return QuantConfig(method, bits=bits, group_size=group, desc_act=desc, ignore=ignore)
    if method == "compressed-tensors":
        return _compressed_tensors(raw, ignore, w)
    return QuantConfig("mxfp4", bits=4, group_size=32, ignore=ignore)


def _compressed_tensors(raw: Mapping[str, Any], ignore: tuple[str, ...], w: str) -> QuantConfig:
    fmt = raw.get("format")
    if fmt not in CT_FORMATS:
        raise InvalidInputError(
            f"compressed-tensors format {fmt!r} is not supported",
            where=w,
            hint=f"shardctl reads format {', '.join(CT_FORMATS)}",
        )
    groups = raw.get("config_groups")
    weights: Mapping[str, Any] = {}
    if isinstance(groups, Mapping) and groups:
        first = next(iter(groups.values()))
        if isinstance(first, Mapping) and isinstance(first.get("weights"), Mapping):
            weights = first["weights"]
    bits = weights.get("num_bits", 8 if fmt in CT_UNPACKED else 4)
    group = weights.get("group_size") or -1
    desc = weights.get("actorder") not in (None, False, "static")
    first_group = next(iter(groups.values())) if isinstance(groups, Mapping) and groups else {}
    acts = first_group.get("input_activations") if isinstance(first_group, Mapping) else None
    symmetric = weights.get("symmetric", True) is not False
    if fmt == "pack-quantized" and bits not in (2, 4, 8):
        # pack_to_int32 packs densely: other widths straddle int32 words, no clean split
        raise InvalidInputError(
            f"pack-quantized num_bits {bits!r}: shardctl splits 2-, 4- and 8-bit packing only",
            where=w,
            hint="values of other widths straddle int32 words; reshard such a model unsplit",
        )
    if not isinstance(bits, int) or not (group == -1 or _positive(group)):
        raise InvalidInputError(
            f"config_groups weights: num_bits {bits!r} / group_size {group!r} are not integers",
            where=w,
        )
    strategy = weights.get("strategy") or ""
    wtype = weights.get("type") or ("float" if fmt == "float-quantized" else "int")
    block = None
    if fmt in CT_UNPACKED:
        if strategy not in ("", *CT_STRATEGIES) or wtype not in ("int", "float"):
            raise InvalidInputError(
                f"config_groups weights: strategy {strategy!r} / type {wtype!r} is not one "
                f"shardctl reads for format {fmt}",
                where=w,
                hint=f"strategies {', '.join(CT_STRATEGIES)}; types int, float",
            )
        fp8 = wtype == "float" and bits == 8 and fmt != "int-quantized"
        if not (fp8 or (wtype == "int" and 0 < bits <= 8 and fmt != "float-quantized")):
            raise InvalidInputError(
                f"config_groups weights: {wtype} num_bits {bits} in format {fmt}: expected "
                "float 8 (F8_E4M3) or int of at most 8 bits (stored one per I8)",
                where=w,
            )
        if strategy == "group" and group == -1:
            raise InvalidInputError(
                "config_groups weights: strategy group without a group_size", where=w
            )
        if strategy == "block":
            bs = weights.get("block_structure")
            if not isinstance(bs, (list, tuple)) or len(bs) != 2 or not all(map(_positive, bs)):
                raise InvalidInputError(
                    f"block_structure: expected [rows, cols] of positive integers, got {bs!r}",
                    where=w,
                )
            block = (bs[0], bs[1])
    static = isinstance(acts, Mapping) and acts.get("dynamic") is False
    acts_symmetric = not isinstance(acts, Mapping) or acts.get("symmetric", True) is not False
    return QuantConfig(
        "compressed-tensors",
        bits=bits,
        group_size=group,
        desc_act=desc,
        block=block,
        fmt=fmt,
        ignore=ignore,
        input_scales=acts is not None,
        symmetric=symmetric,
        strategy=strategy,
        wtype=wtype,
        static_inputs=static,
        inputs_symmetric=not static or acts_symmetric,
    )


def _positive(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _names(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InvalidInputError(
            f"modules_to_not_convert / ignore: expected a list of names, got {value!r}",
            where=where,
        )
    return tuple(value)
