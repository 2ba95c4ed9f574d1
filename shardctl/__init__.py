"""shardctl: plan, reshard and verify LLM checkpoints.

The public API (each a thin, documented function in :mod:`shardctl.api`)::

    from shardctl import Mesh, inspect, plan, reshard, search, verify
    from shardctl import ShardctlError  # and its subclasses, one per exit code

``import shardctl`` stays cheap: the functions load on first use and torch only inside
``reshard`` / ``verify``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from shardctl.errors import (
    EnvironmentFailure,
    Interrupted,
    InvalidInputError,
    LayoutError,
    ManifestError,
    OutputConflictError,
    ShardctlError,
    UsageError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from shardctl.api import inspect, plan, reshard, search, verify
    from shardctl.layout.types import Mesh

_API = frozenset({"plan", "search", "reshard", "verify", "inspect", "Mesh"})


def __getattr__(name: str) -> Any:
    if name in _API:
        from shardctl import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardctl' has no attribute {name!r}")


class _Package(ModuleType):
    """Keeps ``shardctl.plan`` / ``.reshard`` / ``.verify`` the API functions.

    Importing a subpackage (``shardctl.plan.api``) makes Python set ``shardctl.plan`` to the
    subpackage; that assignment is dropped here, so the name stays the function. The
    subpackages stay importable by their full names (``from shardctl.plan.api import ...``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "EnvironmentFailure",
    "Interrupted",
    "InvalidInputError",
    "LayoutError",
    "ManifestError",
    "Mesh",
    "OutputConflictError",
    "ShardctlError",
    "UsageError",
    "__version__",
    "inspect",
    "plan",
    "reshard",
    "search",
    "verify",
]
