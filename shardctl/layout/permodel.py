"""A function of ``(model, rules)`` cached per model object: the layout search asks for
hundreds of meshes of one model, and a rule per tensor costs ~20 MB at 90,000 tensors."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelInfo

T = TypeVar("T")


class PerModel(Generic[T]):
    """``fn(model, rules)``, kept for the last few ``(model object, rules)`` asked (by the
    model's id, checked through a weak reference: a new model at a dead one's address misses)."""

    def __init__(self, fn: Callable[[ModelInfo, tuple[RuleSpec, ...]], T], size: int = 16):
        self._fn = fn
        self._size = size
        self.entries: dict[tuple[int, tuple[RuleSpec, ...]], tuple[weakref.ref[ModelInfo], T]]
        self.entries = {}

    def __call__(self, model: ModelInfo, rules: Sequence[RuleSpec]) -> T:
        key = (id(model), tuple(rules))
        hit = self.entries.get(key)
        if hit is not None and hit[0]() is model:
            return hit[1]
        result = self._fn(model, key[1])
        if len(self.entries) >= self._size:
            self.entries.clear()
        self.entries[key] = (weakref.ref(model), result)
        return result

    def forget(self, model: ModelInfo) -> None:
        """Drop ``model``'s results and those of models no longer alive."""
        for key, (ref, _) in list(self.entries.items()):
            alive = ref()
            if alive is None or alive is model:  # identity: an equal model is another entry
                del self.entries[key]

    def clear(self) -> None:
        self.entries.clear()
