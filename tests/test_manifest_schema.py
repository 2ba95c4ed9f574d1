"""`shardctl schema`: the committed JSON Schema is the generated one, it agrees with the
validator's key lists, and every bundled manifest validates against it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardctl.manifest import manifest_json_schema
from shardctl.manifest.fields import SECTION_KEYS
from shardctl.manifest.values import thaw, to_plain
from shardctl.manifest.yamlstrict import parse

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "shardctl" / "schema" / "manifest.schema.json"
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))


def rendered() -> str:
    """Exactly what `shardctl schema` prints."""
    return json.dumps(manifest_json_schema(), indent=2, sort_keys=True) + "\n"


def test_committed_schema_is_up_to_date() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == rendered(), (
        "regenerate: python -m shardctl schema -o shardctl/schema/manifest.schema.json"
    )


def test_schema_sections_match_the_validator() -> None:
    schema = manifest_json_schema()
    assert tuple(schema["properties"]) == SECTION_KEYS[""]
    for section, keys in SECTION_KEYS.items():
        if section in ("", "model"):
            continue
        if section == "quantization.overrides[]":
            node = schema["properties"]["quantization"]["properties"]["overrides"]["items"]
        else:
            node = (
                schema["properties"]["rules"]["items"]
                if section == "rules[]"
                else (schema["properties"][section])
            )
        assert tuple(node["properties"]) == keys, section
        assert node["additionalProperties"] is False


# ----------------------------------------------------------------------------- a small validator
def _type_ok(value: Any, kind: str) -> bool:
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "null": value is None,
    }[kind]


def check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "$") -> list[str]:
    """The subset of JSON Schema 2020-12 our schema uses; returns the errors found."""
    if "$ref" in schema:
        ref = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            ref = ref[part]
        return check(value, ref, root, path)
    errors: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_type_ok(value, k) for k in kinds):
            return [f"{path}: {value!r} is not {kinds}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} !~ {schema['pattern']}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: too short")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            errors.append(f"{path}: {value} <= {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing {key}")
        for key, item in value.items():
            if key in props:
                errors += check(item, props[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected {key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: too few items")
        for i, item in enumerate(value):
            errors += check(item, schema.get("items", {}), root, f"{path}[{i}]")
    if "anyOf" in schema and not any(not check(value, s, root, path) for s in schema["anyOf"]):
        errors.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema:
        hits = sum(not check(value, s, root, path) for s in schema["oneOf"])
        if hits != 1:
            errors.append(f"{path}: matches {hits} of oneOf")
    return errors


def as_json(path: Path) -> Any:
    """The manifest as a YAML 1.2 editor would see it (our strict reading, then plain JSON)."""
    tree = parse(path.read_text(encoding="utf-8"), source=path.name)
    return thaw(to_plain(tree, "$"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_bundled_manifests_validate_against_the_schema(path: Path) -> None:
    schema = manifest_json_schema()
    assert check(as_json(path), schema, schema) == []


def test_the_small_validator_catches_what_the_schema_forbids() -> None:
    schema = manifest_json_schema()
    good = {"model": {"parameters": 7.5e9}, "mesh": {"tp": 8}}
    assert check(good, schema, schema) == []
    bad_cases = [
        {"mesh": {"tp": 8}},  # no model
        {"model": {"parameters": 5, "config": "x"}},  # two sources
        {"model": {"parameters": 5}, "mesh": {"tp": 0}},
        {"model": {"parameters": 5}, "mesh": {"tpp": 2}},
        {"model": {"parameters": 5}, "hardware": {"device_memory": "80 gigs"}},
        {"model": {"parameters": 5}, "rules": [{"match": "x"}]},
        {"model": {"parameters": 5}, "rules": [{"match": "x", "tp": "S(-1)"}]},
        {"model": {"parameters": 5}, "training": {"zero": 4}},
        {"model": {"parameters": 5}, "quantization": {"group_size": 4}},
        {"model": {"parameters": 5}, "workload": {"gpu_memory_utilization": 0}},
    ]
    for case in bad_cases:
        assert check(case, schema, schema) != [], case


def test_bundled_manifests_validate_with_jsonschema_when_installed() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = manifest_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in MANIFESTS:
        assert list(validator.iter_errors(as_json(path))) == [], path.name
    # A YAML 1.2 editor reads `7.5e9` as a number and `80GiB` as a string; both are fine.
    assert validator.is_valid(yaml.safe_load("model: {parameters: 7.5e9}\n"))
