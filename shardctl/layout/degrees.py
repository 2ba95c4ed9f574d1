"""The tp degrees a model allows under every constraint at once, for the hint of a refused tp.

One tensor's remedy is not enough: ``--tp 3`` on Llama-3-8B fails first on ``down_proj``
(14336 columns), whose divisors include 7 and 14 — degrees that then fail on the 32 heads. The
hint instead tries every distinct split of the model (q heads, K/V heads with replication,
intermediate, vocab under its padding policy, experts' matrices, manifest rules) and lists the
degrees that pass them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shardctl.errors import LayoutError
from shardctl.layout.resolve import TensorRule
from shardctl.layout.types import LayoutOptions

MAX_TP = 256  # beyond any tp group a node (or NVL72 rack) runs


def valid_tp_degrees(
    tensors: Iterable[TensorRule],
    options: LayoutOptions,
    split_spec: Callable[[TensorRule, int, LayoutOptions], object],
    *,
    limit: int = MAX_TP,
) -> tuple[int, ...]:
    """Every ``tp`` in ``1..limit`` that splits every one of ``tensors`` (a model's, or its
    classes' first tensors: the same distinct splits; ``split_spec`` is the engine's own
    per-tensor split, which raises :class:`LayoutError` when it cannot)."""
    distinct: dict[tuple[object, ...], TensorRule] = {}
    for t in tensors:
        if t.dim is not None:
            distinct.setdefault((t.info.shape, t.dim, t.parts, t.groups, t.vocab, t.quant), t)
    # The split that refused the last degree is tried first: most degrees fail on the same
    # one, and the others' splits (up to ``limit`` shards each) are then never computed
    # (DeepSeek-V3 FP8: 0.5 s for the hint, every degree splitting the vocab first).
    order = list(distinct.values())
    out = []
    for tp in range(1, limit + 1):
        for i, t in enumerate(order):
            try:
                split_spec(t, tp, options)
            except LayoutError:
                order.insert(0, order.pop(i))
                break
        else:
            out.append(tp)
    return tuple(out)


def with_valid_degrees(
    err: LayoutError,
    tensors: Iterable[TensorRule],
    tp: int,
    options: LayoutOptions,
    split_spec: Callable[[TensorRule, int, LayoutOptions], object],
) -> LayoutError:
    """``err`` (one tensor refused ``tp``) with a hint listing the degrees every tensor allows."""
    ok = valid_tp_degrees(tensors, options, split_spec)
    listed = "{" + ", ".join(map(str, ok)) + "}"
    hint = (
        "tp degrees that split every tensor (heads, K/V heads, intermediate, vocab, "
        f"quantization groups, experts): {listed}"
    )
    if options.uneven != "chunk" and "uneven" in (err.hint or ""):
        hint += ", or layout.uneven: chunk (torch.chunk rule)"
    return LayoutError(err.message, where=err.where, hint=hint)
