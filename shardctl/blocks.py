"""Block geometry shared by the copy (``reshard/copy.py``) and the bitwise compare
(``verify/bitwise/``): how a local tensor made of pieces is addressed in its file, and how
its rows are cut into blocks. Both engines walk tensors in row-major blocks — rows
``[r0, r1)`` of one dim, every dim before it fixed, every dim after it whole — so one set of
strides, flat offsets and contiguity rules serves both, and a fix lands in both at once.

A scalar (shape ``()``) is treated as shape ``(1,)`` and its piece as one element::

    >>> strides((4, 3, 2))
    (6, 2, 1)
    >>> flat_index((1, 2, 0), (4, 3, 2))
    10
    >>> is_contiguous((2, 3, 2), (4, 3, 2)), is_contiguous((2, 2, 2), (4, 3, 2))
    (True, False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardctl.layout.types import Piece

SCALAR_PIECE = Piece((0,), (1,), (0,))


def scalar_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape``, or ``(1,)`` for a scalar."""
    return shape if shape else (1,)


def scalar_piece(p: Piece) -> Piece:
    """``p``, or the one-element piece of a scalar."""
    return p if p.sizes else SCALAR_PIECE


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def flat_index(idx: Sequence[int], shape: tuple[int, ...]) -> int:
    """The element offset of ``idx`` in a row-major tensor of ``shape``."""
    return sum(i * s for i, s in zip(idx, strides(shape), strict=True))


def is_contiguous(sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Is a box of ``sizes`` in a tensor of ``shape`` one contiguous run (whatever its start)?"""
    k = next((i for i, n in enumerate(sizes) if n != 1), len(sizes))
    return all(sizes[j] == shape[j] for j in range(k + 1, len(sizes)))


def block_dim(shape: tuple[int, ...], item: int, block_bytes: int) -> int:
    """The dim blocks run along: the first whose one index (the dims after it) fits a block."""
    k = 0
    while k < len(shape) - 1 and math.prod(shape[k + 1 :]) * item > block_bytes:
        k += 1
    return k
