"""The manifest: YAML → validated, typed, frozen objects, and its JSON Schema.

>>> from pathlib import Path
>>> from shardctl.manifest import parse_manifest
>>> m = parse_manifest("model: {parameters: 7.5e9}\\nmesh: {tp: 8}\\n", base_dir=Path("."))
>>> m.model.parameters, m.mesh.tp
(7500000000, 8)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardctl.manifest.load import load_manifest, parse_manifest
    from shardctl.manifest.model import (
        HardwareSpec,
        Manifest,
        ModelSpec,
        QuantOverride,
        QuantSpec,
        TrainingSpec,
        Workload,
    )
    from shardctl.manifest.schema import manifest_json_schema

# Loaded on first use (PEP 562): ``shardctl.manifest.fields`` (what every CLI command imports
# for its option bounds) must not pull the model, layout and plan chain into each start-up.
_LAZY = {
    "load_manifest": "load",
    "parse_manifest": "load",
    "manifest_json_schema": "schema",
    **{
        n: "model"
        for n in (
            "HardwareSpec",
            "Manifest",
            "ModelSpec",
            "QuantOverride",
            "QuantSpec",
            "TrainingSpec",
            "Workload",
        )
    },
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


__all__ = [
    "HardwareSpec",
    "Manifest",
    "ModelSpec",
    "QuantOverride",
    "QuantSpec",
    "TrainingSpec",
    "Workload",
    "load_manifest",
    "manifest_json_schema",
    "parse_manifest",
]
