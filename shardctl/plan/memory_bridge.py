"""Glue between the manifest/layout world and the memory model.

Weights come from the layout engine (exact bytes per model-parallel coordinate); the other
components come from :mod:`shardctl.plan.memory` (see docs/memory-model.md).
"""

from shardctl.plan.memory.adapter import memory_per_rank, search_layouts

__all__ = ["memory_per_rank", "search_layouts"]
