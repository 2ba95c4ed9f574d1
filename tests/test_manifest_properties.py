"""Property tests: exact conversions, round trips through a real YAML writer, and fuzzing that
finds nothing but ManifestError (never another exception, never a crash)."""

from __future__ import annotations

import math
import re
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import ManifestError
from shardctl.layout.types import Mesh
from shardctl.manifest import parse_manifest
from shardctl.manifest.model_keys import PASS_THROUGH
from shardctl.manifest.values import ambiguous_spelling, thaw

ROOT = Path(__file__).resolve().parent.parent
SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
FAST = settings(max_examples=150, deadline=None)


def parse(text: str) -> Any:
    return parse_manifest(text, base_dir=ROOT, source="p.yaml")


@FAST
@given(st.integers(1, 10**5), st.sampled_from(sorted(SIZE_UNITS)), st.sampled_from(["", " "]))
def test_sizes_convert_exactly(n: int, unit: str, space: str) -> None:
    size = n * SIZE_UNITS[unit]
    if size < 2**20:
        return  # below the device-memory floor; covered by the hostile tests
    m = parse(f"model: {{parameters: 1}}\nhardware: {{device_memory: '{n}{space}{unit}'}}\n")
    assert m.hardware.device_memory == size


@FAST
@given(st.integers(1, 10**15))
def test_parameter_counts_convert_exactly_in_every_spelling(count: int) -> None:
    digits = str(count)
    stripped = digits.rstrip("0")
    exponent = len(digits) - len(stripped)
    spellings = [digits, f"{stripped}e{exponent}", f"{stripped}E+{exponent}"]
    if len(stripped) > 1:  # 7.5e9 style: one digit before the point
        spellings.append(f"{stripped[0]}.{stripped[1:]}e{len(digits) - 1}")
    for spelling in spellings:
        assert parse(f"model: {{parameters: {spelling}}}\n").model.parameters == count, spelling


@FAST
@given(st.integers(1, 10**12), st.integers(1, 6))
def test_fractional_parameter_counts_are_refused(whole: int, decimals: int) -> None:
    text = f"{whole}.{'0' * (decimals - 1)}1"
    try:
        parse(f"model: {{parameters: {text}}}\n")
    except ManifestError as exc:
        assert "not a whole number" in str(exc)
    else:
        raise AssertionError(f"{text} accepted")


@FAST
@given(
    st.fixed_dictionaries({}, optional={a: st.integers(1, 2**20) for a in ("pp", "dp", "ep", "tp")})
)
def test_mesh_round_trips_through_a_yaml_writer(axes: dict[str, int]) -> None:
    text = yaml.safe_dump({"model": {"parameters": 1000}, "mesh": axes})
    assert parse(text).mesh == Mesh(**axes)


@FAST
@given(
    st.integers(1, 10**6), st.sampled_from(["0{}", "0x{:x}", "0o{:o}", "0b{:b}", "{}_0", "0{}:30"])
)
def test_non_decimal_spellings_are_refused_for_every_value(n: int, form: str) -> None:
    text = form.format(n)
    try:
        parse(f"model: {{parameters: 1}}\nmesh: {{tp: {text}}}\n")
    except ManifestError as exc:
        assert "non-decimal number spelling" in str(exc), str(exc)
    else:
        raise AssertionError(f"{text} accepted")


# Free-form values (inline HF config) written by PyYAML's own safe writer must read back as
# themselves — except strings YAML 1.1 writes plain but YAML 1.2 reads as numbers (`1e3`) or
# that we refuse as ambiguous booleans (`y`, `n`).
_WORDS = st.text(alphabet=string.ascii_letters + string.digits + "_-./", min_size=1, max_size=12)
# Words PyYAML writes plain but a manifest refuses plain: YAML 1.1 booleans, exponent floats
# without a dot, and numbers YAML 1.1 and 1.2 read differently (``08``: a string to PyYAML, 8
# to a 1.2 reader; refused with a hint to quote it, test_plain_ambiguous_spelling_is_refused...).
_SAFE_WORDS = _WORDS.filter(
    lambda s: (
        s.lower() not in {"y", "n", "yes", "no", "on", "off"}
        and not re.fullmatch(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+", s)
        and ambiguous_spelling(s) is None
    )
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _SAFE_WORDS
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True), inner, max_size=4)
    ),
    max_leaves=12,
)


# Inline keys must be the family's (shardctl/manifest/model_keys.py): free-form values go under
# its pass-through keys, which are data the plan ignores.
_PASS_KEYS = st.sampled_from([k for k in PASS_THROUGH["llama"] if k not in ("model_type", "dtype")])


@FAST
@given(st.dictionaries(_PASS_KEYS, _VALUES, max_size=5))
def test_inline_config_round_trips_through_a_yaml_writer(fields: dict[str, Any]) -> None:
    text = yaml.safe_dump({"model": {"model_type": "llama", **fields}})
    got = thaw(parse(text).model.inline_config)
    assert got == {"model_type": "llama", **fields}
    for value in got.values():
        if isinstance(value, float):
            assert math.isfinite(value)


def test_plain_ambiguous_spelling_is_refused_and_quoted_round_trips() -> None:
    # hypothesis found it: PyYAML writes the string "08" plain (not a YAML 1.1 int), which a
    # YAML 1.2 reader takes for 8; the manifest refuses it in one line, and the quoted string
    # (what a user writes once told) passes through unchanged
    with pytest.raises(ManifestError, match=r"non-decimal number spelling '08'.*quote it"):
        parse(yaml.safe_dump({"model": {"model_type": "llama", "architectures": "08"}}))
    got = thaw(parse('model:\n  model_type: llama\n  architectures: "08"\n').model.inline_config)
    assert got == {"model_type": "llama", "architectures": "08"}


# ----------------------------------------------------------------------------- fuzzing
_TOKENS = st.sampled_from(
    [
        "model",
        "mesh",
        "tp",
        "pp",
        "parameters",
        ":",
        " ",
        "\n",
        "  ",
        "- ",
        "{",
        "}",
        "[",
        "]",
        ",",
        "&a ",
        "*a",
        "!!python/object:os.system ",
        "'",
        '"',
        "#",
        "---\n",
        "yes",
        "010",
        "1e3",
        ".inf",
        "1:30",
        "0x1F",
        "~",
        "null",
        "\t",
        "\x00",
        "\ufeff",
        "é",
        "?",
        "|",
        ">",
        "%YAML 1.1\n",
        "8",
        "-1",
        "80GiB",
        "!",
        "<<: ",
        "@",
        "`",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_TOKENS, max_size=40))
def test_token_soup_yields_a_manifest_or_a_manifest_error(tokens: list[str]) -> None:
    text = "".join(tokens)
    try:
        parse(text)
    except ManifestError as exc:
        assert "\n" not in exc.render()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_yields_a_manifest_or_a_manifest_error(text: str) -> None:
    try:
        parse(text)
    except ManifestError as exc:
        assert "\n" not in exc.render()


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_from_a_file_yield_a_manifest_or_a_manifest_error(
    tmp_path_factory: Any, data: bytes
) -> None:
    from shardctl.manifest import load_manifest

    path = tmp_path_factory.mktemp("fuzz") / "m.yaml"
    path.write_bytes(data)
    try:
        load_manifest(path)
    except ManifestError as exc:
        assert "\n" not in exc.render()
