"""Group K (issue 13): bounds on every size from a flag or file, exit 3 (never 70) for inputs the
tool cannot accept, and hypothesis fuzzing of records, headers and CLI flags.

The fuzz asserts what RELIABILITY asks of every case: exit in {0..5}, one line on stderr, no
traceback, input unchanged. In process (``tests._hostile.cli`` drives ``shardctl.cli.main``),
plus a handful of real subprocesses (K10). docs/reliability.md lists the IDs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardctl.checkpoint import record, record_v2
from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.io import faults
from shardctl.io.safetensors_header import read_header
from shardctl.layout.types import Mesh
from shardctl.reshard.api import reshard
from tests._hostile import OK_CODES, cli, one_line, safetensors, sub, tree_sha
from tests._models import make_checkpoint

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("k-src") / "llama")


@pytest.fixture(scope="module")
def tp2(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("k-tp2") / "tp2"
    reshard(llama, out, mesh=Mesh(tp=2))
    return out


@pytest.fixture
def no_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a layout gets built (the bound must be checked before any work)."""
    import importlib

    target = importlib.import_module("shardctl.reshard.target")  # shardctl.reshard: the API

    def forbidden(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("build_layout called: the bound was checked too late")

    monkeypatch.setattr(target, "build_layout", forbidden)


# ---- K1: flags are bounded before any work --------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("reshard", "SRC", "DST", "--tp", str(2**20 + 1)),
        ("reshard", "SRC", "DST", "--tp", str(2**70)),
        ("reshard", "SRC", "DST", "--tp", "2**70"),
        ("reshard", "SRC", "DST", "--pp", "10000000"),
        ("reshard", "SRC", "DST", "--ep", "-1"),
        ("reshard", "SRC", "DST", "--workers", "1000000"),
        ("reshard", "SRC", "DST", "--max-header-bytes", "2GiB"),
        ("reshard", "SRC", "DST", "--max-shard-size", "1e999"),
        ("plan", "MANIFEST", "--search", "--gpus", "1000000000"),
        ("plan", "MANIFEST", "--search", "--gpus", "1e9"),
        ("plan", "MANIFEST", "--tp", str(2**21)),
        ("plan", "MANIFEST", "--search", "--top", str(10**9)),
        ("verify", "SRC", "DST", "--seed", str(2**64)),
        ("inspect", "SRC", "--max-header-bytes", "4"),
    ],
    ids=lambda a: " ".join(a[3:] if a[0] != "plan" else a[2:])[:40],
)
def test_K1_flag_bounds_exit_2_before_any_work(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    import importlib

    api = importlib.import_module("shardctl.reshard.api")  # shardctl.reshard is the API verb
    monkeypatch.setattr(api, "open_source", _forbidden)
    manifest = str(Path(__file__).resolve().parents[1] / "manifests" / "llama-3-70b-tp8.yaml")
    real = [
        {"SRC": str(llama), "DST": str(tmp_path / "out"), "MANIFEST": manifest}.get(a, a)
        for a in args
    ]
    code, _out, err = cli(*real)
    one_line(code, err, 2)
    assert not (tmp_path / "out").exists()


def _forbidden(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("the input was opened: the bound was checked too late")


def test_K2_huge_tp_on_a_small_model_refused_before_layout(
    llama: Path, tmp_path: Path, no_layout: None
) -> None:
    for flag in (("--tp", str(2**20)), ("--pp", "64"), ("--ep", "4")):
        code, _out, err = cli("reshard", str(llama), str(tmp_path / "o"), *flag)
        line = one_line(code, err, 3)
        assert f"mesh.{flag[0][2:]}" in line


# ---- K3: config contradicting the tensors: exit 3 before splitting -------------------------


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("num_key_value_heads", 8, "num_key_value_heads × head_dim"),
        ("vocab_size", 300, "vocab_size"),
        ("head_dim", 16, "× head_dim"),
    ],
)
def test_K3_config_contradicting_tensors(
    llama: Path, tmp_path: Path, no_layout: None, key: str, value: int, what: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    before = tree_sha(src)
    code, _out, err = cli("reshard", str(src), str(tmp_path / "o"), "--tp", "2")
    line = one_line(code, err, 3)
    assert "contradicts" in line and what in line
    assert tree_sha(src) == before and not (tmp_path / "o").exists()


# ---- K4: dtypes and ranks the tool cannot take ---------------------------------------------


@pytest.mark.parametrize(
    ("header", "nbytes", "what"),
    [
        ('{"w":{"dtype":"F4","shape":[4,4],"data_offsets":[0,8]}}', 8, "sub-byte"),
        ('{"w":{"dtype":"F6_E2M3","shape":[4,4],"data_offsets":[0,12]}}', 12, "sub-byte"),
        (
            '{"w":{"dtype":"U8","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,1]}}',
            1,
            "65 dimensions",
        ),
    ],
    ids=["F4", "F6", "65-dims"],
)
def test_K4_unsupported_tensors_exit_3(tmp_path: Path, header: str, nbytes: int, what: str) -> None:
    src = tmp_path / "s"
    safetensors(src / "model.safetensors", header, b"\x01" * nbytes)
    code, _out, err = cli("reshard", str(src), str(tmp_path / "o"), "--format", "hf")
    assert what in one_line(code, err, 3)


# ---- K5: environment values --------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "value", "what"),
    [
        ("WORLD_SIZE", "abc", "WORLD_SIZE"),
        ("WORLD_SIZE", "-3", "WORLD_SIZE"),
        ("SHARDCTL_FAULT", "nonesuch:kill", "unknown point"),
        ("SHARDCTL_FAULT", "shard_written:raise:errorcode", "unknown errno"),
        ("SHARDCTL_FAULT", "shard_written:sleep:1e999", "sleep"),
    ],
)
def test_K5_environment_values_exit_3(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, what: str
) -> None:
    monkeypatch.setenv(var, value)
    faults.reset()
    try:
        code, _out, err = cli("reshard", str(llama), str(tmp_path / "o"), "--tp", "2")
    finally:
        monkeypatch.delenv(var)
        faults.reset()
    assert what in one_line(code, err, 3)
    assert not (tmp_path / "o").exists()


# ---- K6: the too-large-header hint names a flag that exists ---------------------------------


def test_K6_max_header_bytes_flag_exists_and_works(tmp_path: Path) -> None:
    src = tmp_path / "s"
    names = {
        f"tensor.{i:04d}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
        for i in range(40)
    }
    safetensors(src / "model.safetensors", json.dumps(names), b"\x02" * 40)
    code, _out, err = cli("inspect", str(src), "--max-header-bytes", "512")
    line = one_line(code, err, 3)
    assert "--max-header-bytes" in line
    for command in ("reshard", "verify", "inspect"):
        code, out, _err = cli(command, "--help")
        assert code == 0 and "--max-header-bytes" in out, command
    code, _out, err = cli("inspect", str(src), "--max-header-bytes", "64KiB")
    one_line(code, err, 0)
    code, _out, err = cli(
        "reshard", str(src), str(tmp_path / "o"), "--format", "hf", "--max-header-bytes", "4KiB"
    )
    one_line(code, err, 0)


# ---- K7–K9: fuzz -----------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            out += _paths(v, (*prefix, i))
    return out


@pytest.mark.parametrize("form", ["v2", "v1"])
@FUZZ
@given(data=st.data())
def test_K7_fuzz_records(tp2: Path, tmp_path: Path, data: st.DataObject, form: str) -> None:
    """Any record mutation: accepted, or refused with exit 3 — never another exception
    (the schema-2 record reshard writes, and the same record as schema 1)."""
    rec = json.loads((tp2 / record.RECORD_NAME).read_text())
    if form == "v1":
        rec = record_v2.to_v1(rec)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(rec) if p]
        path = data.draw(st.sampled_from(paths))
        node = rec
        for k in path[:-1]:
            node = node[k]
        if data.draw(st.booleans()):
            node[path[-1]] = data.draw(JSON)
        elif isinstance(node, dict):
            del node[path[-1]]
        else:
            node[path[-1]] = data.draw(st.integers(-5, 2**40))
    d = tmp_path / "fuzz"
    d.mkdir(exist_ok=True)
    (d / record.RECORD_NAME).write_text(json.dumps(rec))
    try:
        record.read(d)
    except InvalidInputError as exc:
        assert "\n" not in exc.render()


@FUZZ
@given(
    header=st.one_of(
        st.binary(max_size=200),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(
            st.text(max_size=6),
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["U8", "F4", "BF16", "X", 3]),
                    "shape": st.lists(st.integers(-2, 2**40), max_size=70),
                    "data_offsets": st.lists(st.integers(-2, 2**64), max_size=3),
                }
            ),
            max_size=3,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    data=st.binary(max_size=64),
)
def test_K8_fuzz_headers(tmp_path: Path, header: bytes, data: bytes) -> None:
    """Any header bytes: parsed, or exit 3 (5 for I/O) with one line."""
    path = safetensors(tmp_path / "f.safetensors", header, data)
    try:
        read_header(path)
    except (InvalidInputError, EnvironmentFailure) as exc:
        assert "\n" not in exc.render()


FLAG_VALUES = st.sampled_from(
    ["0", "1", "2", "3", "-1", "abc", "2**70", str(2**64), "1e9", "", "[/]", "ü", "5GB", "0.5"]
)
OPTIONS = st.sampled_from(
    ["--tp", "--pp", "--ep", "--workers", "--format", "--max-shard-size", "--max-header-bytes"]
)
SWITCHES = st.sampled_from(["--force", "--json", "--quiet", "--no-resume", "--allow-pickle", "--x"])


@settings(FUZZ, max_examples=40)
@given(
    opts=st.lists(st.tuples(OPTIONS, FLAG_VALUES), max_size=3),
    switches=st.lists(SWITCHES, max_size=2),
    dst_name=st.sampled_from(["o", "o[/x]", "ü*?", "[bold]o", "."]),
)
def test_K9_fuzz_cli_flags(
    llama: Path,
    tmp_path: Path,
    opts: list[tuple[str, str]],
    switches: list[str],
    dst_name: str,
) -> None:
    """reshard with random flags: exit in {0..5}, one line on stderr, no traceback, input
    unchanged, and DST either absent or a complete output."""
    before = tree_sha(llama)
    base = tmp_path / f"k9-{len(list(tmp_path.iterdir()))}"
    base.mkdir()
    (base / "o[").mkdir()
    argv = ["reshard", str(llama), str(base / dst_name) if dst_name != "." else str(base)]
    for o, v in opts:
        argv += [o, v]
    argv += switches
    code, _out, err = cli(*argv)
    assert code in OK_CODES, (argv, code, err)
    one_line(code, err, OK_CODES)
    assert tree_sha(llama) == before
    out = base / dst_name if dst_name != "." else base
    if code == 0:
        record.read(out)
    elif dst_name != ".":
        assert not out.exists(), (argv, code, err)


# ---- K10: a handful of real subprocesses -----------------------------------------------------


@pytest.mark.slow
def test_K10_real_processes(llama: Path, tp2: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tp2, bad)
    rec = record_v2.to_v1(json.loads((bad / record.RECORD_NAME).read_text()))
    for r in rec["ranks"][1:]:
        for s in r["shards"]:
            if s["fqn"] == "model.layers.0.mlp.gate_proj.weight":
                s["pieces"][0]["offsets"] = [70, 0]
    (bad / record.RECORD_NAME).write_text(json.dumps(record_v2.to_v2(rec)))
    before = tree_sha(llama), tree_sha(bad)
    cases: list[tuple[tuple[str, ...], dict[str, str], int]] = [
        (("reshard", str(bad), str(tmp_path / "m"), "--format", "hf"), {}, 3),
        (("reshard", str(llama), str(tmp_path / "w"), "--tp", "2"), {"WORLD_SIZE": "abc"}, 3),
        (
            ("reshard", str(llama), str(tmp_path / "f"), "--tp", "2"),
            {"SHARDCTL_FAULT": "x:kill"},
            3,
        ),
        (("reshard", str(llama), str(tmp_path / "t"), "--tp", str(2**70)), {}, 2),
        (("reshard", str(llama)), {}, 2),
    ]
    for args, env, code in cases:
        p = sub(*args, env=env)
        one_line(p.returncode, p.stderr, code)
    assert (tree_sha(llama), tree_sha(bad)) == before
    assert not any((tmp_path / n).exists() for n in "mwft")


# ---- K11: plan --search is bounded by its own limit, not the user's patience -----------------


def test_K11_search_over_the_manifests_cluster_is_capped(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "manifests" / "llama-3-70b-tp8.yaml"
    text = src.read_text().replace(
        "hardware: {gpu: h100-sxm, gpus_per_node: 8, nodes: 1}",
        f"hardware: {{gpu: h100-sxm, gpus_per_node: 1024, nodes: {2**20}}}",
    )
    assert "nodes: 1048576" in text
    manifest = tmp_path / "huge.yaml"
    manifest.write_text(text)
    code, _out, err = cli("plan", str(manifest), "--search")
    line = one_line(code, err, 3)
    assert "above the limit" in line and "--gpus" in line
