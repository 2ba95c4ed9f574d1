"""Group J (issue 13): names are data — glob characters, markup, non-ASCII, identity by inode,
``--force`` limits, pickle names and links, usage lines, temp dirs of killed runs.

In process except J5 (real ``PYTHONIOENCODING=ascii`` subprocesses) and J2's bind mounts (root,
inside ``unshare -m``). docs/reliability.md lists the IDs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardctl.checkpoint import record
from shardctl.console import exit_code_for
from shardctl.errors import InvalidInputError, OutputConflictError
from shardctl.io import atomic
from shardctl.io.checksum import default_hash
from shardctl.io.lock import OutputLock
from shardctl.layout.types import Mesh
from shardctl.reshard import resume
from shardctl.reshard.api import reshard
from tests._hostile import REPO, cli, one_line, sub, tree_sha, u8_checkpoint
from tests._models import make_checkpoint

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("j-src") / "llama")


# ---- J1: glob characters in DST and SRC names (staging, resume, locks) ----------------------


def test_J1_glob_characters_in_dst_do_not_touch_other_runs(llama: Path, tmp_path: Path) -> None:
    other = tmp_path / ".mx.shardctl-staging-1-abcd"  # a concurrent run's staging for "mx"
    other.mkdir()
    (other / "rank-00000-of-00002.safetensors").write_bytes(b"theirs")
    for name in ("m?", "m*", "m[x]", "[m]x", "m]"):
        reshard(llama, tmp_path / name, mesh=Mesh(tp=2))
        record.read(tmp_path / name)
        assert (other / "rank-00000-of-00002.safetensors").read_bytes() == b"theirs", name


def test_J1_glob_characters_never_adopt_another_runs_staging(tmp_path: Path) -> None:
    theirs = tmp_path / ".m1.shardctl-staging-7-beef"
    theirs.mkdir()
    (theirs / resume.IDENT).write_text(json.dumps({"id": "same-run"}))
    for name in ("m[0-9]", "m?", "m*", "[m]1"):
        assert resume.adopt(tmp_path / name, "same-run", default_hash()) == (None, {}), name
        atomic.recover(tmp_path / name)
        assert theirs.is_dir(), name
    found, _ = resume.adopt(tmp_path / "m1", "same-run", default_hash())  # its own run: yes
    assert found == theirs


def test_J1_glob_characters_in_src_and_locks(llama: Path, tmp_path: Path) -> None:
    src = tmp_path / "s*[1]?"
    shutil.copytree(llama, src)
    before = tree_sha(src)
    dst = tmp_path / "d*[0]?"
    with OutputLock(tmp_path / "d*"):  # another output's lock: a different file
        reshard(src, dst, mesh=Mesh(tp=2))
    back = tmp_path / "b[a]ck*"
    reshard(dst, back, fmt="hf")
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert tree_sha(src) == before


# ---- J2: SRC/DST identity by (st_dev, st_ino) -----------------------------------------------


@pytest.mark.root
@root_only
def test_J2_bind_mounts_do_not_hide_an_overlap(llama: Path, tmp_path: Path) -> None:
    """DST == SRC through a bind mount (``--force``), DST inside SRC through one, SRC inside DST
    through one: exit 4 before any write, input sha256 unchanged."""
    src = tmp_path / "a" / "src"
    shutil.copytree(llama, src)
    script = textwrap.dedent(
        f"""
        import subprocess, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from shardctl.console import exit_code_for
        from shardctl.layout.types import Mesh
        from shardctl.reshard.api import reshard
        t = Path({str(tmp_path)!r}); src = t / "a" / "src"
        for d in ("same", "b"):
            (t / d).mkdir()
        subprocess.run(["mount", "--bind", str(src), str(t / "same")], check=True)
        subprocess.run(["mount", "--bind", str(t / "a"), str(t / "b")], check=True)
        for dst, force in ((t / "same", True), (t / "same" / "out", False), (t / "b", True)):
            try:
                reshard(src, dst, mesh=Mesh(tp=2), force=force)
                print("ACCEPTED", dst)
            except BaseException as e:
                print(exit_code_for(e)[0], exit_code_for(e)[1])
        """
    )
    before = tree_sha(src)
    p = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 3 and all(ln.startswith("4 ") for ln in lines), p.stdout
    assert "is the input" in lines[0] and "inside the input" in lines[1]
    assert "contains the input" in lines[2]
    assert tree_sha(src) == before


def test_J2_identity_by_inode_without_mounts(llama: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    (tmp_path / "alias").symlink_to(src)
    for dst in (tmp_path / "alias" / "x", tmp_path, src / ".." / "src"):
        with pytest.raises(OutputConflictError):
            reshard(src, dst, mesh=Mesh(tp=2), force=True)


# ---- J3: --force replaces only what it may --------------------------------------------------


def test_J3_force_refuses_unrelated_directories(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / "model.safetensors.index.json").write_text("{}")  # not ours: no record
    for dst in (home, tmp_path / "file"):
        if dst.name == "file":
            dst.write_text("data")
        with pytest.raises(OutputConflictError) as info:
            reshard(llama, dst, mesh=Mesh(tp=2), force=True)
        code, line = exit_code_for(info.value)
        assert code == 4 and "--force replaces only" in line
    assert (home / "thesis.tex").read_text() == "years of work"
    monkeypatch.chdir(home)  # DST "." (the red-team case)
    code, _out, err = cli("reshard", str(llama), ".", "--tp", "2", "--force")
    one_line(code, err, 4)
    assert sorted(os.listdir(home)) == ["model.safetensors.index.json", "thesis.tex"]


def test_J3_force_replaces_an_empty_dir_or_a_shardctl_output(llama: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    reshard(llama, empty, mesh=Mesh(tp=2), force=True)
    reshard(llama, empty, fmt="hf", force=True)  # a previous shardctl output (its record)
    assert record.read(empty).format == "hf"


# ---- J4/J5: rendering: markup and non-ASCII, PYTHONIOENCODING=ascii --------------------------

NAMES = {"[/]": 8, "[bold]x[/bold]": 8, "ü[/red]\u200b": 8, "[link=file:///etc]y": 8}


def test_J4_markup_names_in_process(tmp_path: Path) -> None:
    src = u8_checkpoint(tmp_path / "s[/x]", NAMES)
    dst = tmp_path / "o[/x]"  # "[/x]" closes a tag rich never opened
    dst.parent.mkdir()
    code, out, err = cli("reshard", str(src), str(dst), "--format", "hf")
    one_line(code, err, 0)
    assert "o[/x]" in out
    code, out, err = cli("inspect", str(src))
    one_line(code, err, 0)
    assert "s[/x]" in out
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last tensor differs: a finding row naming it
    (dst / "model.safetensors").write_bytes(bytes(data))
    code, out, err = cli("verify", str(src), str(dst), "--level", "bitwise")
    one_line(code, err, 1)
    assert "[link=file:///etc]y" in out


@pytest.mark.slow
def test_J5_markup_and_non_ascii_under_ascii_stdio(tmp_path: Path) -> None:
    """Real subprocesses with PYTHONIOENCODING=ascii: names with markup and non-ASCII never
    crash a renderer (characters are replaced), and the output commits exactly once."""
    src = u8_checkpoint(tmp_path / "sü[/]", NAMES)
    dst = tmp_path / "oü[/x]"
    dst.parent.mkdir()
    env = {"PYTHONIOENCODING": "ascii", "LC_ALL": "C"}
    for args in (
        ("reshard", str(src), str(dst), "--format", "hf"),
        ("inspect", str(dst)),
        ("verify", str(src), str(dst), "--level", "bitwise"),
    ):
        p = sub(*args, env=env)
        one_line(p.returncode, p.stderr, 0)
    p = sub("reshard", str(src), str(dst), "--format", "hf", env=env)  # exists: one line, exit 4
    line = one_line(p.returncode, p.stderr, 4)
    assert "output exists" in line
    p = sub("reshard", str(tmp_path / "nope[/]ü"), str(tmp_path / "x"), env=env)
    one_line(p.returncode, p.stderr, 3)


# ---- J6: usage errors are one line ---------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("reshard", "--tpp", "3", "a", "b"),
        ("reshard", "a"),
        ("nonesuch",),
        ("plan", "x.yaml", "--tp", "abc"),
        ("verify", "a", "b", "--seed", "-1"),
        ("reshard", "a", "b", "--tp", "0"),
    ],
    ids=lambda a: " ".join(a),
)
def test_J6_usage_errors_are_one_line(args: tuple[str, ...]) -> None:
    code, _out, err = cli(*args)
    line = one_line(code, err, 2)
    assert "--help" in line and "╭" not in err


# ---- J7–J9: pickle inputs -------------------------------------------------------------------


def _pickle_dir(tmp_path: Path, obj: object, name: str = "pytorch_model.bin") -> Path:
    import torch

    d = tmp_path / "pk"
    d.mkdir(exist_ok=True)
    torch.save(obj, d / name)
    (d / "config.json").write_text("{}")
    return d


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {_MARKER}",))


_MARKER = Path("/tmp") / f"shardctl-j7-marker-{os.getpid()}"


def test_J7_refusal_names_the_global_never_weights_only_false(tmp_path: Path) -> None:
    import torch

    src = _pickle_dir(tmp_path, {"w": torch.ones(2), "x": _Evil()})
    with pytest.raises(InvalidInputError) as info:
        reshard(src, tmp_path / "out", allow_pickle=True)
    line = exit_code_for(info.value)[1]
    assert "system'" in line and "unsupported global" in line, line
    assert "weights_only" not in line.replace("weights-only", "") and "False" not in line
    assert not _MARKER.exists()


def test_J8_pickle_symlink_outside_src_refused(tmp_path: Path) -> None:
    import torch

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    torch.save({"w": torch.ones(4)}, outside / "weights.bin")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").symlink_to(outside / "weights.bin")
    for allow in (False, True):
        with pytest.raises(InvalidInputError, match="outside the checkpoint directory"):
            reshard(src, tmp_path / "out", allow_pickle=allow)
    reshard(src, tmp_path / "out", allow_pickle=True, follow_external_symlinks=True)


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_J9_meta_and_sparse_pickle_tensors_exit_3(tmp_path: Path, kind: str) -> None:
    import torch

    t = torch.empty(4, device="meta") if kind == "meta" else torch.eye(3).to_sparse()
    src = _pickle_dir(tmp_path, {"w": t})
    with pytest.raises(InvalidInputError, match=kind):
        reshard(src, tmp_path / "out", allow_pickle=True)
    assert not (tmp_path / "out").exists()


# ---- J10: names that are not text -----------------------------------------------------------


def test_J10_lone_surrogate_tensor_name_exit_3(tmp_path: Path) -> None:
    from tests._hostile import safetensors

    src = tmp_path / "s"
    safetensors(
        src / "model.safetensors",
        '{"w\\ud800":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}',
        b"1234",
    )
    for args in (
        ("reshard", str(src), str(tmp_path / "o"), "--format", "hf"),
        ("inspect", str(src)),
    ):
        code, _out, err = cli(*args)
        one_line(code, err, 3)
        assert "lone surrogate" in err


# ---- J11: temp dirs of killed verifies are reaped -------------------------------------------


def test_J11_killed_runs_temp_dirs_are_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from shardctl.io import tempdirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); import tempfile; "
            "tempfile.tempdir = sys.argv[2]; from shardctl.io.tempdirs import owned_tempdir\n"
            "with owned_tempdir('shardctl-verify-') as p:\n"
            "    print(p, flush=True); time.sleep(600)",
            str(REPO),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    victim = Path(child.stdout.readline().strip())
    with tempdirs.owned_tempdir("shardctl-verify-") as mine:
        assert victim.is_dir()
        assert tempdirs.reap("shardctl-verify-") == []  # the owner lives: kept
        foreign = tmp_path / "shardctl-verify-not-ours"  # no owner file: not ours to judge
        foreign.mkdir()
        (tmp_path / "shardctl-verify-link").symlink_to(tmp_path / "elsewhere")
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 30
        while victim.is_dir() and time.monotonic() < deadline:
            tempdirs.reap("shardctl-verify-")
        assert not victim.exists()
        assert mine.is_dir() and foreign.is_dir()
        assert (tmp_path / "shardctl-verify-link").is_symlink()


_CONCURRENT_OWNER = """
import sys, tempfile
sys.path.insert(0, sys.argv[1])
tempfile.tempdir = sys.argv[2]
from shardctl.io.tempdirs import owned_tempdir
lost = 0
for _ in range(int(sys.argv[3])):
    try:
        with owned_tempdir("shardctl-verify-") as p:
            (p / "model.safetensors").write_bytes(b"x")  # as the reference merge writes
    except OSError:
        lost += 1
print(lost)
"""


def test_J11_concurrent_runs_never_reap_a_live_directory(tmp_path: Path) -> None:
    """Verifies run side by side (xdist, CI matrix): each one's reap must spare the others'.

    With the owner file created first and locked after, another run's reap could open it in
    between, take the free lock and remove the live directory (seen in CI: the forward level's
    reference merge failed with ENOENT; 75 of 8,000 runs here lost theirs).
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_OWNER, str(REPO), str(tmp_path), "1500"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    lost = [int(p.communicate(timeout=600)[0]) for p in procs]
    assert lost == [0, 0, 0, 0]
    assert os.listdir(tmp_path) == []  # each removed its own on exit


# ---- J12: resume does not trust an input rewritten in place ---------------------------------


def test_J12_resume_identity_moves_with_in_place_rewrites(llama: Path, tmp_path: Path) -> None:
    from shardctl.checkpoint.source import open_source
    from shardctl.reshard.api import plan

    src = tmp_path / "src"
    shutil.copytree(llama, src)

    def ident() -> str:
        s = open_source(src)
        return resume.run_id(s, plan(s, mesh=Mesh(tp=2)), default_hash())

    first = ident()
    assert ident() == first  # unchanged input: an identical run (resumable)
    f = src / "model.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime kept
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert ident() != first  # ctime moved: a clean restart, never mixed output
