"""The manifest: YAML → validated, typed, frozen objects, and its JSON Schema.

>>> from shardctl.manifest import parse_manifest
>>> m = parse_manifest("model: {parameters: 7.5e9}\\nmesh: {tp: 8}\\n", base_dir=Path("."))
>>> m.model.parameters, m.mesh.tp
(7500000000, 8)
"""

from __future__ import annotations

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
