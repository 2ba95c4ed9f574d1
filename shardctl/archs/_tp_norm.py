"""A norm over a vector that tensor parallelism splits across ranks (imports torch: only the
forward level's hooks import this module).

OLMo-2 normalizes the whole q projection ``[heads·head_dim]``; under tp each rank holds
``heads/tp`` of those heads. RMS over the full vector = ``sqrt(all_reduce(sum(x_r²)) / n)``, so one
all-reduce of a ``[.., 1]`` tensor replaces vLLM's all-gather of q and k.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TPRMSNorm(nn.Module):
    """RMSNorm of a tp-split vector: ``x_r * rsqrt(mean_all(x²) + eps) * w[start:start+n]``.

    ``inner`` holds the whole (replicated) weight; ``start`` / ``size``: this rank's slice. With
    replicated kv heads (``tp > kv``) every head is counted ``tp/kv`` times in the sum, which the
    divisor ``tp · size`` matches, so the mean is the same.
    """

    def __init__(
        self, inner: nn.Module, comm: Any, *, tp: int, start: int, size: int, eps: float
    ) -> None:
        super().__init__()
        self.inner = inner
        self.comm = comm
        self.tp = tp
        self.start = start
        self.size = size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = self.comm.all_reduce(h.pow(2).sum(-1, keepdim=True), "tp")
        h = h * torch.rsqrt(squares / (self.tp * self.size) + self.eps)
        weight = self.inner.get_parameter("weight")[self.start : self.start + self.size]
        return (weight * h).to(dtype)
