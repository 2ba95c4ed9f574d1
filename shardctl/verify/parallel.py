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

    @property
    def weight(self) -> torch.Tensor:
        """The local table (Llama-4's model reads ``embed_tokens.weight.device``)."""
        return self.inner.weight

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
    ``down_proj [n, H, I/tp]``, or gpt-oss's ``[n, H, 2·I/tp]``): ids outside the range go to
    local expert 0 with weight 0, so they add nothing (not to a "no expert" slot ``n``: gpt-oss's
    module has none). Each rank's output is a partial sum over its experts (and, with tp, over
    its slice of I): one all-reduce over the stage's ``ep × tp`` ranks completes it.
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
        outside = (local < 0) | (local >= self.count)
        weights = top_k_weights.masked_fill(outside, 0)
        out: torch.Tensor = self.inner(hidden, local.masked_fill(outside, 0), weights)
        return self.comm.all_reduce(out, "moe")


class StackedLocalExperts(nn.Module):
    """This rank's experts ``[first, first + n)`` of a module called on every expert's input
    stacked, ``x [E·T, H]`` (Llama-4: rows ``e·T .. (e+1)·T`` are expert ``e``'s tokens, scaled
    by its router score). The rank runs its ``n·T`` rows; the other experts' rows stay zero, and
    the all-reduce over the stage's ``ep × tp`` ranks fills them in and sums the tp slices.
    """

    def __init__(self, inner: nn.Module, comm: Comm, *, first: int, count: int, total: int):
        super().__init__()
        self.inner = inner
        self.comm = comm
        self.first = first
        self.count = count
        self.total = total  # E: x holds total·T rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0] // self.total
        rows = slice(self.first * tokens, (self.first + self.count) * tokens)
        out = torch.zeros_like(x)
        out[rows] = self.inner(x[rows])
        return self.comm.all_reduce(out, "moe")
