"""Dtypes as safetensors spells them, their sizes, and the aliases configs and users write.

We keep dtypes as the safetensors header codes (``"BF16"``, ``"F8_E4M3"``) everywhere: they are
what the files hold, and they need no torch import.
"""

from __future__ import annotations

from shardctl.errors import InvalidInputError

# Bytes per element for every dtype safetensors 0.8 writes. Sub-byte types are counted in bits.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}

# What configs (`torch_dtype`, `dtype`) and manifests may say, mapped to safetensors codes.
_ALIASES: dict[str, str] = {
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float64": "F64",
    "double": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "fp8": "F8_E4M3",
    "fp8_e4m3": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "fp8_e5m2": "F8_E5M2",
}

# safetensors code -> torch dtype attribute name (used only where torch is already imported).
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def normalize_dtype(name: str, *, where: str | None = None) -> str:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``"BF16"`` -> ``"BF16"``."""
    key = name.strip()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    if key.upper() in DTYPE_BITS:
        return key.upper()
    code = _ALIASES.get(key.lower())
    if code is None:
        known = ", ".join(sorted({*_ALIASES, *(k.lower() for k in DTYPE_BITS)}))
        raise InvalidInputError(f"unknown dtype {name!r}", where=where, hint=f"use one of: {known}")
    return code


def itemsize(dtype: str) -> int:
    """Bytes per element; sub-byte dtypes are an error here (they have no per-element size)."""
    bits = DTYPE_BITS[dtype]
    assert bits % 8 == 0, f"{dtype} is sub-byte"
    return bits // 8


def nbytes(dtype: str, numel: int) -> int:
    """Exact bytes for ``numel`` elements, rounding sub-byte dtypes up to whole bytes."""
    return (DTYPE_BITS[dtype] * numel + 7) // 8
