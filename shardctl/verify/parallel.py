"""Modules that turn a rank's local model into one shard of a tensor-parallel model.

Megatron's two kinds of split, in PyTorch storage (``nn.Linear`` weight is ``[out, in]``)::

    colwise  q/k/v, gate/up   weight [out/tp, in]   output is this rank's slice: no collective
    rowwise  o_proj, down     weight [out, in/tp]   output is a partial sum: all-reduce, then bias

GPT-2's ``Conv1D`` stores ``[in, out]``, so its rowwise weight is ``[in/tp, out]``. The vocab
embedding holds rows ``[start, start + V/tp)``: ids outside that range look up nothing (zeros),
and the all-reduce fills them in from the rank that owns them. The vocab-parallel head emits
``V/tp`` logits per rank; an all-gather in tp order rebuilds ``[.., V]`` (padding stripped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardctl.verify.comm import Comm


class RowParallel(nn.Module):
    """``y = all_reduce(x @ W_r) + b``: bias added once, after the sum."""

    def __init__(self, inner: nn.Module, comm: Comm, *, conv1d: bool) -> None:
        super().__init__()
        self.weight: torch.Tensor = inner.get_parameter("weight")
        self.bias: torch.Tensor | None = getattr(inner, "bias", None)
        self.comm = comm
        self.conv1d = conv1d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight if self.conv1d else F.linear(x, self.weight)
        y = self.comm.all_reduce(y, "tp")
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the vocabulary; other ids contribute zeros.

    Calls the model's own embedding module on the shifted ids, so whatever it does beyond the
    lookup (Gemma scales by sqrt(hidden) inside its embedding) still happens.
    """

    def __init__(self, inner: nn.Embedding, comm: Comm, *, start: int) -> None:
        super().__init__()
        self.inner = inner
        self.comm = comm
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.inner.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        out: torch.Tensor = self.inner(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out, "tp")


class GatherHead(nn.Module):
    """Vocab-parallel (or replicated, padded) lm_head: local logits (plus the rank's slice of
    the head's bias, if it has one), all-gather, strip padding."""

    def __init__(
        self,
        weight: nn.Parameter,
        comm: Comm,
        *,
        vocab: int,
        sharded: bool,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.comm = comm
        self.vocab = vocab
        self.sharded = sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.sharded:
            y = self.comm.all_gather(y, "tp")
        return y[..., : self.vocab]


class LocalExperts(nn.Module):
    """This rank's experts ``[first, first + n)``; the router still scores all of them.

    Wraps transformers' own packed expert module (``gate_up_proj [n, 2·I/tp, H]``,
    ``down_proj [n, H, I/tp]``): ids outside the range map to its "no expert" slot ``n``. Each
    rank's output is a partial sum over its experts (and, with tp, over its slice of I): one
    all-reduce over the stage's ``ep × tp`` ranks completes it.
    """

    def __init__(self, inner: nn.Module, comm: Comm, *, first: int, count: int) -> None:
        super().__init__()
        self.inner = inner
        self.comm = comm
        self.first = first
        self.count = count

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        local = top_k_index - self.first
        local = local.masked_fill((local < 0) | (local >= self.count), self.count)
        out: torch.Tensor = self.inner(hidden, local, top_k_weights)
        return self.comm.all_reduce(out, "moe")
