"""The model inventory: every tensor's name, shape and dtype, plus the dimensions rules need.

Built from a ``config.json`` (closed-form shapes per architecture), from safetensors headers, or
from a bare parameter count — never from tensor data.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from shardctl.dtypes import DTYPE_BITS, nbytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as stored on disk: ``model.layers.0.mlp.down_proj.weight [4096, 14336] BF16``.

    Slots: ~60 B a tensor instead of ~160 with a ``__dict__`` (90,000 of them per model)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.numel)

    def __str__(self) -> str:
        return f"{self.fqn} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class ModelDims:
    """The numbers layout rules and memory formulas need, derived from the config.

    ``head_dim`` is independent of ``hidden_size`` (Gemma: 256 with hidden 3072 / 16 heads).
    ``num_experts`` is 0 for dense models.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    experts_per_token: int = 0
    max_position_embeddings: int = 0
    gated_mlp: bool = True  # SwiGLU / GeGLU (three matrices) vs GPT-2's two
    # Layers after the decoder stack that a checkpoint may carry (DeepSeek-V3's multi-token
    # prediction, ``model.layers.{num_layers + k}``): placed on the last pipeline stage.
    mtp_layers: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """An inventory: the architecture, its dims, and every tensor on disk in file order.

    ``tensors`` is empty for a bare parameter count (``parameters`` is then the count).
    ``config`` is the raw HF config (read-only view) for rules that need more fields.
    """

    architecture: str  # HF model_type: "llama", "gpt2", ... or "unknown"
    dims: ModelDims | None
    tensors: tuple[TensorInfo, ...]
    dtype: str
    source: str  # "config", "checkpoint", "parameters", "inline"
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    parameter_count: int | None = None  # only for source == "parameters"

    @property
    def parameters(self) -> int:
        if self.parameter_count is not None and not self.tensors:
            return self.parameter_count
        return sum(self.numel_by_dtype.values())

    @property
    def weight_bytes(self) -> int:
        if self.parameter_count is not None and not self.tensors:
            return nbytes(self.dtype, self.parameter_count)
        return sum(self.bytes_by_dtype.values())

    @cached_property
    def numel_by_dtype(self) -> dict[str, int]:
        """Elements per dtype, in order of first appearance (computed once: at 90,000
        tensors the per-tensor sums were a second of ``inspect``)."""
        return numel_by_dtype(self.tensors)

    @cached_property
    def bytes_by_dtype(self) -> dict[str, int]:
        return bytes_by_dtype(self.tensors, self.numel_by_dtype)

    def tensor(self, fqn: str) -> TensorInfo:
        for t in self.tensors:
            if t.fqn == fqn:
                return t
        raise KeyError(fqn)


_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


def numel_by_dtype(tensors: tuple[TensorInfo, ...]) -> dict[str, int]:
    """Elements per dtype, in order of first appearance."""
    # 90,000 expert tensors are a few dozen (dtype, shape) pairs: count those (C-speed
    # hashing), then multiply out once per pair. A Counter keeps first-appearance order.
    pairs = Counter(zip(map(_DTYPE, tensors), map(_SHAPE, tensors), strict=True))
    out: dict[str, int] = {}
    for (dtype, shape), count in pairs.items():
        out[dtype] = out.get(dtype, 0) + math.prod(shape) * count
    return out


def bytes_by_dtype(
    tensors: tuple[TensorInfo, ...], numels: dict[str, int] | None = None
) -> dict[str, int]:
    """Bytes per dtype; sub-byte dtypes round up per tensor, as ``TensorInfo.nbytes`` does."""
    out: dict[str, int] = {}
    for dtype, numel in (numels if numels is not None else numel_by_dtype(tensors)).items():
        if DTYPE_BITS[dtype] % 8 == 0:
            out[dtype] = DTYPE_BITS[dtype] // 8 * numel
        else:
            out[dtype] = sum(t.nbytes for t in tensors if t.dtype == dtype)
    return out
