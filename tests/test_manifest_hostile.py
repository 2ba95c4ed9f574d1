"""Hostile and broken manifests (RELIABILITY.md group D): each refused with exit 3, one line,
naming the key path and line — in-process here; a few real CLI runs in test_manifest_cli.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardctl.errors import EXIT_INVALID_INPUT, ManifestError
from shardctl.manifest import load_manifest, parse_manifest
from shardctl.manifest.yamlstrict import MAX_BYTES, MAX_DEPTH, MAX_NODES

ROOT = Path(__file__).resolve().parent.parent
M = "model: {parameters: 1000}\n"  # a valid model section to put broken sections beside


def refuse(text: str, pattern: str) -> ManifestError:
    """Parse ``text``; it must fail with one line matching ``pattern`` and exit code 3."""
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, base_dir=ROOT, source="bad.yaml")
    err = info.value
    assert err.exit_code == EXIT_INVALID_INPUT
    line = err.render()
    assert "\n" not in line
    assert line.startswith("bad.yaml: ")
    assert re.search(pattern, line), line
    return err


def refuse_bytes(tmp_path: Path, data: bytes, pattern: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    line = info.value.render()
    assert "\n" not in line and str(path) in line
    assert re.search(pattern, line), line
    return line


# ----------------------------------------------------------------------------- D1 code execution
def test_d1_python_tags_are_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for tag in ("!!python/object/apply:os.system", "!!python/object/new:os.system"):
        refuse(f"model: {tag} ['touch {marker}']\n", r"YAML tags not allowed .*\(line 1\)|tags")
    refuse("model: !!python/name:os.system ''\n", r"YAML tags not allowed")
    refuse("model: {parameters: !!int '5'}\n", r"YAML tags not allowed")
    refuse("model: !custom {parameters: 5}\n", r"YAML tags not allowed")
    assert not marker.exists()


def test_d1_no_unsafe_yaml_loading_anywhere_in_the_source() -> None:
    forbidden = re.compile(r"yaml\.load\(|unsafe_load|FullLoader|UnsafeLoader|full_load")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "shardctl").rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if forbidden.search(line)
    ]
    assert offenders == []


# ----------------------------------------------------------------------------- D2 billion laughs
BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(ord('b') + i)}: &{chr(ord('b') + i)} [{','.join(['*' + chr(ord('a') + i)] * 9)}]\n"
    for i in range(8)
)


def test_d2_billion_laughs_refused_fast() -> None:
    assert len(BILLION_LAUGHS.encode()) < 600
    refuse(BILLION_LAUGHS, r"anchors/aliases not allowed \(anchor &a at line 1\)")


def test_d2_alias_alone_is_refused() -> None:
    refuse("model: *x\n", r"anchors/aliases not allowed|undefined alias|alias")
    refuse("model: &m {parameters: 5}\n", r"anchors/aliases not allowed")


def test_d2_billion_laughs_under_a_1gib_address_space_limit(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from pathlib import Path\n"
        "from shardctl.errors import ManifestError\n"
        "from shardctl.manifest import load_manifest\n"
        "try:\n"
        "    load_manifest(Path(sys.argv[1]))\n"
        "except ManifestError as exc:\n"
        "    print(exc.render()); sys.exit(exc.exit_code)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 3, run.stderr
    assert "anchors/aliases not allowed" in run.stdout


# ----------------------------------------------------------------------------- D3 duplicate keys
def test_d3_duplicate_keys() -> None:
    refuse(
        M + "mesh:\n  tp: 2\n  tp: 8\n",
        r"mesh\.tp: duplicate key 'tp' \(line 4; first at "
        r"line 3\)",
    )
    refuse(
        "model: {parameters: 5}\nmodel: {parameters: 6}\n",
        r"model: duplicate key 'model' "
        r"\(line 2",
    )
    refuse(M + "rules:\n  - {match: a, tp: R, tp: R}\n", r"rules\[0\]\.tp: duplicate key")
    refuse(M + "mesh: {tp: 2, 'tp': 2}\n", r"duplicate key 'tp'")


# ----------------------------------------------------------------------------- D4 deep nesting
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 100_000])
def test_d4_deep_flow_nesting(depth: int) -> None:
    refuse("model: " + "[" * depth + "]" * depth + "\n", rf"nesting deeper than {MAX_DEPTH}")
    refuse("model: " + "{a: " * depth + "1" + "}" * depth + "\n", r"nesting deeper|limit")
    refuse("- " * depth + "x\n", r"nesting deeper")


def test_d4_deep_nesting_from_a_file_never_crashes(tmp_path: Path) -> None:
    refuse_bytes(tmp_path, b"model: " + b"[" * 100_000 + b"\n", r"nesting deeper")


def test_d4_block_nesting_is_capped_by_size_or_depth() -> None:
    text = "".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 2)) + " " * 40 + "v\n"
    refuse(text, r"nesting deeper")


def test_d4_size_cap(tmp_path: Path) -> None:
    big = b"model: {parameters: 1000}\n" + b"# padding\n" * (MAX_BYTES // 10)
    refuse_bytes(tmp_path, big, rf"manifest is {len(big)} bytes, over the {MAX_BYTES}-byte limit")
    refuse("x" * (MAX_BYTES + 1), rf"{MAX_BYTES + 1} characters, over the {MAX_BYTES}-byte limit")


def test_d4_value_count_cap_keeps_hostile_files_fast() -> None:
    flat = M + "x: [" + "1," * (MAX_BYTES // 2 - 40) + "]\n"
    assert len(flat) <= MAX_BYTES
    refuse(flat, rf"more than {MAX_NODES} values \(line 2\)")
    refuse(M + "x:\n" + "  - 1\n" * (MAX_NODES + 1), r"more than .* values")


def test_d4_worst_case_text_at_the_size_cap_is_refused() -> None:
    room = MAX_BYTES - len(M) - 10
    for filler in ("a " * (room // 2), "\n" * room, "# comment\n" * (room // 10)):
        text = f"{M}{filler}\nx: 1\n"
        assert len(text) <= MAX_BYTES
        refuse(text, r"unknown key|invalid YAML")


# ----------------------------------------------------------------------------- D5 spellings
@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ("yes", r"mesh\.tp: expected a positive integer, got 'yes' \(line 3\)"),
        ("true", r"mesh\.tp: expected a positive integer, got true \(a boolean\) \(line 3\)"),
        ("on", r"expected a positive integer, got 'on'"),
        ("010", r"mesh\.tp: non-decimal number spelling '010' \(leading zero"),
        ("0x10", r"non-decimal number spelling '0x10' \(hexadecimal\)"),
        ("0o10", r"non-decimal number spelling '0o10' \(octal\)"),
        ("0b10", r"non-decimal number spelling '0b10' \(binary\)"),
        ("1:30", r"non-decimal number spelling '1:30' \(sexagesimal"),
        ("1_000", r"non-decimal number spelling '1_000' \(digit separators\)"),
        ("1e3", r"expected a positive integer, got string '1e3'"),
        ("2.0", r"expected a positive integer, got '2\.0'"),
    ],
)
def test_d5_integer_spellings(value: str, pattern: str) -> None:
    refuse(f"{M}mesh:\n  tp: {value}\n", pattern)


def test_d5_bool_spellings_for_bool_keys() -> None:
    refuse(
        M + "hardware: {allow_tp_across_nodes: yes}\n",
        r"hardware\.allow_tp_across_nodes: expected true or false, got 'yes'.*YAML 1\.1",
    )
    refuse(M + "workload: {flash_attention: 1}\n", r"expected true or false, got '1'")
    refuse(
        "model: {model_type: llama, tie_word_embeddings: no}\n",
        r"model\.tie_word_embeddings: ambiguous value 'no'",
    )


# ----------------------------------------------------------------------------- D6 floats
def test_d6_scientific_only_where_documented() -> None:
    refuse(
        M + "workload: {gpu_memory_utilization: 9e-1}\n",
        r"workload\.gpu_memory_utilization: expected a number, got string '9e-1'.*scientific",
    )
    refuse(M + "workload: {batch_size: 1e3}\n", r"expected a positive integer, got string '1e3'")
    # documented: parameters, sizes, bandwidths, inline config
    assert parse_manifest("model: {parameters: 1e3}\n", base_dir=ROOT).model.parameters == 1000


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "+.INF"])
def test_d6_non_finite_refused_everywhere(value: str) -> None:
    refuse(f"{M}workload: {{gpu_memory_utilization: {value}}}\n", r"non-finite number")
    refuse(f"model: {{parameters: {value}}}\n", r"model\.parameters: non-finite")
    refuse(f"model: {{model_type: llama, rope_theta: {value}}}\n", r"model\.rope_theta: non-")
    refuse(f"{M}hardware: {{device_memory: {value}}}\n", r"hardware\.device_memory: non-finite")


def test_d6_overflowing_floats_refused() -> None:
    refuse("model: {model_type: llama, lr: 1e309}\n", r"model\.lr: '1e309' out of range")
    refuse("model: {parameters: 1e309}\n", r"model\.parameters: '1e309' out of range")
    refuse(M + "hardware: {device_memory: 1e400GB}\n", r"out of range")
    refuse("model: {parameters: 1e999999999}\n", r"out of range")  # no 10**999999999 computed


# ----------------------------------------------------------------------------- D7 huge integers
def test_d7_huge_integers_out_of_range() -> None:
    big = "9" * 38
    refuse(f"{M}mesh: {{tp: {big}}}\n", r"mesh\.tp: .*out of range")
    refuse(f"{M}mesh: {{tp: {2**40}}}\n", r"mesh\.tp: 1099511627776 out of range")
    refuse(f"model: {{model_type: llama, hidden_size: {2**63}}}\n", r"out of range")
    refuse(
        f"model: {{model_type: llama, hidden_size: {2**40}}}\n",
        r"model\.hidden_size: 1099511627776 out of range \(at most 4294967296\)",
    )
    refuse(f"model: {{model_type: llama, x: {big}}}\n", r"model\.x: .*out of range")
    refuse(f"model: {{parameters: {big}}}\n", r"model\.parameters: .*out of range")
    refuse(f"{M}hardware: {{device_memory: {big}}}\n", r"out of range")
    refuse(f"{M}mesh: {{tp: {'9' * 5000}}}\n", r"out of range")  # beyond int-parsing limits


def test_d7_never_zero_or_negative_memory() -> None:
    refuse(M + "hardware: {device_memory: -80GiB}\n", r"below the minimum")
    refuse(M + "hardware: {device_memory: 0}\n", r"below the minimum")
    refuse(M + "hardware: {device_memory: 80}\n", r"80 bytes.*give a unit")
    refuse(M + "hardware: {device_memory: 0.5B}\n", r"not a whole number of bytes")
    refuse(M + "hardware: {device_memory: 80Gb}\n", r"unknown unit 'Gb'.*counts bits")
    refuse(M + "hardware: {device_memory: 80 gigs}\n", r"unknown unit 'gigs'")


# ----------------------------------------------------------------------------- D8 types and keys
def test_d8_wrong_types() -> None:
    refuse(M + "mesh: {tp: [1, 2]}\n", r"mesh\.tp: expected a positive integer, got a list")
    refuse(M + "mesh: {tp: '8'}\n", r"mesh\.tp: expected a positive integer, got string '8'")
    refuse(M + "mesh: [tp, 8]\n", r"mesh: expected a mapping, got a list")
    refuse(M + "rules: {match: x}\n", r"rules: expected a list of rules, got a mapping")
    refuse(M + "rules: [x]\n", r"rules\[0\]: expected a mapping")
    refuse(
        "model: {model_type: llama, num_hidden_layers: '32'}\n",
        r"model\.num_hidden_layers: expected a positive integer, got string '32'",
    )
    refuse("model: 7\n", r"model: expected a mapping, got '7'")
    refuse("- model\n", r"expected a mapping of sections at the top level, got a list")
    refuse("just a string\n", r"top level, got the scalar")


def test_d8_null_and_missing() -> None:
    refuse(M + "mesh: {tp: null}\n", r"mesh\.tp: expected a positive integer, got null")
    refuse(M + "mesh: {tp: ~}\n", r"got null")
    refuse("mesh: {tp: 2}\n", r"model: missing required section \(line 1\)")
    refuse("model: {}\n", r"model: no model source")
    refuse("model: {dtype: bf16}\n", r"model: no model source")
    refuse(M + "rules: [{tp: R}]\n", r"rules\[0\]: missing required key 'match'")
    refuse(M + "quantization: {group_size: 64}\n", r"quantization: missing required key 'method'")


def test_d8_unknown_keys_with_did_you_mean() -> None:
    refuse(
        M + "mesh: {tp: 2, tpp: 4}\n",
        r"mesh\.tpp: unknown key \(line 2\); did you mean 'tp'\?; valid keys: pp, dp, tp, ep",
    )
    refuse(
        M + "hardwre: {nodes: 2}\n",
        r"hardwre: unknown key \(line 2\); did you mean "
        r"'hardware'\?",
    )
    refuse(M + "workload: {sequence_len: 8}\n", r"did you mean 'sequence_length'")
    refuse(M + "pipeline: {uneven: chunk}\n", r"'uneven' belongs under 'layout:'")
    refuse("model: {model_type: llama, dtyp: bf16}\n", r"model\.dtyp: unknown key.*'dtype'")
    refuse("model: {parameters: 5, hidden_size: 4096}\n", r"model\.hidden_size: unknown key")
    refuse(M + "rules: [{match: x, tp: R, head: q}]\n", r"rules\[0\]\.head: unknown key.*'heads'")


def test_d8_every_problem_is_listed_with_its_line() -> None:
    err = refuse(
        "model: {parameters: 1000}\nmesh:\n  tp: yes\n  pp: 0\nhardware: {nodes: -1}\n"
        "workload: {mode: serving}\n",
        r"mesh\.tp: .*\(line 3\) \| mesh\.pp: .*\(line 4\) \| hardware\.nodes: .*\(line 5\) \| "
        r"workload\.mode: expected one of inference, training, weights-only; "
        r"got 'serving' \(line 6\)",
    )
    assert err.where == "bad.yaml"


def test_d8_enum_and_placement_errors() -> None:
    refuse(M + "pipeline: {convention: megatrom}\n", r"did you mean 'megatron'")
    # S(-1) is a valid placement now (one parser with the engine): S(x) is not.
    refuse(M + "rules: [{match: x, tp: S(x)}]\n", r"rules\[0\]\.tp: expected S\(<dim>\)")
    refuse(M + "rules: [{match: x, tp: colwsie}]\n", r"did you mean 'colwise'")
    refuse(M + "rules: [{match: x, tp: R, parts: [q, kv]}]\n", r"need a sharded tp placement")
    refuse(M + "rules: [{match: x, parts: [q]}]\n", r"at least two part sizes")
    refuse(M + "rules: [{match: x, parts: [q, 0]}]\n", r"rules\[0\]\.parts\[1\]")
    refuse(M + "rules: [{match: ''}]\n", r"rules\[0\]")
    refuse(M + "hardware: {gpu: h1OO}\n", r"unknown GPU 'h1OO'")
    refuse("model: {parameters: 5, dtype: int8}\n", r"model\.dtype: expected a floating-point")
    refuse("model: {parameters: 5, dtype: bfloat61}\n", r"model\.dtype: unknown dtype")


# ----------------------------------------------------------------------------- D9 file forms
def test_d9_multi_document() -> None:
    refuse(M + "---\nmesh: {tp: 2}\n", r"more than one YAML document \(second starts at line 2\)")


def test_d9_non_utf8(tmp_path: Path) -> None:
    refuse_bytes(
        tmp_path,
        b"model: {parameters: 1000}\n# caf\xe9\n",
        r"not valid UTF-8: byte 0xe9 at offset \d+ \(line 2\)",
    )
    refuse_bytes(tmp_path, "model: {parameters: 1}\n".encode("utf-16"), r"UTF-16")


def test_d9_tabs_and_control_characters(tmp_path: Path) -> None:
    refuse(M + "mesh:\n\ttp: 2\n", r"tab character at line 3, column 1")
    refuse(M + "mesh: {tp: 2}\t# x\n", r"tab character at line 2, column 14")
    refuse(M + "mesh: {tp: 2}\x07\n", r"invalid YAML")
    refuse_bytes(tmp_path, b"model: {parameters: 1000}\x00\n", r"invalid YAML")


@pytest.mark.parametrize("text", ["", "   \n\n", "# only a comment\n", "---\n", "~\n", "null\n"])
def test_d9_empty(text: str) -> None:
    refuse(text, r"empty manifest")


def test_d9_empty_file_and_not_a_file(tmp_path: Path) -> None:
    refuse_bytes(tmp_path, b"", r"empty manifest")
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(tmp_path)
    with pytest.raises(ManifestError, match="manifest not found"):
        load_manifest(tmp_path / "missing.yaml")


def test_d9_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError, match="not a regular file"):
        load_manifest(fifo)


def test_d9_syntax_errors_are_one_line_with_position() -> None:
    refuse("model: {parameters: 5\n", r"invalid YAML: .*\(line \d+, column \d+\)")
    refuse("model:\n  a: 1\n b: 2\n", r"invalid YAML")
    refuse("model: 'unterminated\n", r"invalid YAML")


# ----------------------------------------------------------------------------- D10 semantics
@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (M + "mesh: {tp: 0}\n", r"mesh\.tp: must be at least 1, got 0"),
        (M + "mesh: {pp: -2}\n", r"mesh\.pp: must be at least 1, got -2"),
        (M + "hardware: {gpus_per_node: 0}\n", r"hardware\.gpus_per_node: must be at least 1"),
        (M + "workload: {batch_size: 0}\n", r"workload\.batch_size: must be at least 1"),
        (M + "workload: {sequence_length: -1}\n", r"must be at least 0"),
        (M + "workload: {gpu_memory_utilization: 0}\n", r"greater than 0\.0 and at most 1\.0"),
        (M + "workload: {gpu_memory_utilization: 1.5}\n", r"got 1\.5"),
        (
            M + "mesh: {pp: 2}\npipeline: {layers_per_stage: [16, 8, 8]}\n",
            r"pipeline\.layers_per_stage: lists 3 stages but mesh\.pp is 2",
        ),
        (M + "pipeline: {layers_per_stage: [0]}\n", r"no layers in any stage"),
        ("model: {parameters: 0}\n", r"model\.parameters: expected a positive number"),
        ("model: {parameters: 7.25}\n", r"not a whole number of parameters"),
        ("model: {parameters: 5, config: x.json}\n", r"exactly one of config, checkpoint"),
        (
            "model: {model_type: llama, num_attention_heads: 0}\n",
            r"model\.num_attention_heads: must be at least 1",
        ),
        (
            M + "workload: {mode: inference}\ntraining: {zero: 3}\n",
            r"workload\.mode: is inference but a training: section is given",
        ),
        (M + "training: {zero: 4}\n", r"training\.zero: expected a ZeRO stage 0-3"),
        (M + "training: {zero: FULL}\n", r"training\.zero: expected a ZeRO stage"),
        (
            M + "training: {zero: 2, offload_params: cpu}\n",
            r"training\.offload_params: cpu offload needs zero: 3",
        ),
        (M + "training: {zero: 0, offload_optimizer: cpu}\n", r"needs zero: 1, 2 or 3"),
        (M + "training: {zero: 1, offload_optimizer: nvme}\n", r"nvme offload needs zero: 3"),
        (M + "quantization: {method: mxfp4, group_size: 64}\n", r"32 elements by definition"),
        (M + "quantization: {method: int4, double_quant: true}\n", r"applies to nf4 only"),
        (M + "quantization: {method: int4, fp8_scaling: block}\n", r"applies to fp8 only"),
        (M + "quantization: {method: none, group_size: 64}\n", r"no effect with method: none"),
        (M + "overhead: {fragmentation: 1.5}\n", r"overhead\.fragmentation"),
        (M + "overhead: {cuda_ctx: 1GiB}\n", r"did you mean 'cuda_context'"),
    ],
)
def test_d10_impossible_values(text: str, pattern: str) -> None:
    refuse(text, pattern)
