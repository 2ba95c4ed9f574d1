"""Resuming a reshard killed hard: the finished files of an identical run are reused, the rest
written; anything that differs (the target, the input, a damaged staged file) starts clean.

Every run is a real ``python -m shardctl reshard`` subprocess, killed by ``SIGKILL`` at a named
fault point (``shard_fsynced:N``: file N is fsynced but not yet closed and journaled). With
``--workers 1`` files finish in order, so after the kill at file 3 exactly two are journaled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._models import make_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("resume") / "llama")


@pytest.fixture(scope="module")
def clean_tp4(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "tp4"
    assert run(llama, out, "--tp", "4").returncode == 0
    return out


def shardctl(*args: str | Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCTL_FAULT", "SHARDCTL_DEBUG")}
    if fault:
        env["SHARDCTL_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "shardctl", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def run(
    src: Path, dst: Path, *args: str, fault: str | None = None
) -> subprocess.CompletedProcess[str]:
    return shardctl("reshard", src, dst, *args, "--json", fault=fault)


def killed(src: Path, dst: Path, *args: str, at: str = "shard_fsynced:3:kill") -> Path:
    """Run until the fault kills it; returns the staging directory it left."""
    p = run(src, dst, "--workers", "1", *args, fault=at)
    assert p.returncode == -9, p.stderr
    (staging,) = dst.parent.glob(f".{dst.name}.shardctl-staging-*")
    return staging


def shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def test_killed_run_resumes_reusing_its_finished_files(
    llama: Path, clean_tp4: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "tp4"
    staging = killed(llama, dst, "--tp", "4")
    journal = [json.loads(x) for x in (staging / ".shardctl-journal").read_text().splitlines()]
    assert len(journal) == 2
    inodes = {e["name"]: (staging / e["name"]).stat().st_ino for e in journal}
    p = run(llama, dst, "--tp", "4")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert sorted(doc["resumed"]) == sorted(inodes)
    for name, ino in inodes.items():  # the very files the killed run wrote: not rewritten
        assert (dst / name).stat().st_ino == ino
    assert shards(dst) == shards(clean_tp4)
    rec, clean = (json.loads((d / "shardctl.layout.json").read_text()) for d in (dst, clean_tp4))
    assert rec["files"] == clean["files"]  # digests of reused files carried into the record
    assert not (dst / ".shardctl-journal").exists() and not (dst / ".shardctl-run.json").exists()
    assert leftovers(dst) == []
    verify = shardctl("verify", llama, dst, "--level", "bitwise")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_different_target_starts_clean(llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    killed(llama, dst, "--tp", "4")
    p = run(llama, dst, "--tp", "2")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] == []
    assert sorted(shards(dst)) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert leftovers(dst) == []  # the killed run's staging removed (E3)


def test_no_resume_starts_clean(llama: Path, clean_tp4: Path, tmp_path: Path) -> None:
    dst = tmp_path / "tp4"
    killed(llama, dst, "--tp", "4")
    p = run(llama, dst, "--tp", "4", "--no-resume")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] == []
    assert shards(dst) == shards(clean_tp4) and leftovers(dst) == []


def test_a_damaged_staged_file_is_written_again(
    llama: Path, clean_tp4: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "tp4"
    staging = killed(llama, dst, "--tp", "4")
    first, second = (
        json.loads(x)["name"] for x in (staging / ".shardctl-journal").read_text().splitlines()
    )
    victim = staging / first
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # same size, one bit off: only the hash can tell
    victim.write_bytes(bytes(data))
    p = run(llama, dst, "--tp", "4")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] == [second]
    assert shards(dst) == shards(clean_tp4)


def test_changed_input_is_not_resumed(llama: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    dst = tmp_path / "tp4"
    killed(src, dst, "--tp", "4")
    os.utime(src / "model.safetensors", ns=(1, 1))  # same bytes, another mtime: another input
    p = run(src, dst, "--tp", "4")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed"] == []


def test_resumed_run_still_checks_every_input_digest(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs with known digests are hashed in full even when the outputs they feed are reused:
    a bit flipped (mtime kept, so the run is 'identical' and resumes) in the input is exit 3."""
    from shardctl.errors import InvalidInputError
    from shardctl.layout.types import Mesh
    from shardctl.reshard import resume
    from shardctl.reshard.api import reshard

    layout = tmp_path / "tp2"
    assert run(llama, layout, "--tp", "2").returncode == 0
    dst = tmp_path / "tp4"
    killed(layout, dst, "--tp", "4")
    victim = layout / "rank-00000-of-00002.safetensors"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x10
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    adopted: list[dict[str, str]] = []
    real = resume.adopt

    def adopt(*args: object) -> tuple[Path | None, dict[str, str]]:
        found = real(*args)  # type: ignore[arg-type]
        adopted.append(found[1])
        return found

    monkeypatch.setattr(resume, "adopt", adopt)
    with pytest.raises(InvalidInputError, match="input hash mismatch"):
        reshard(layout, dst, mesh=Mesh(tp=4))  # in process, to see that it resumed
    assert len(adopted) == 1 and len(adopted[0]) == 2, adopted  # two finished files reused
    assert not dst.exists() and leftovers(dst) == []
    killed(layout, dst, "--tp", "4")  # again, for the CLI: exit 3, one line
    p = run(layout, dst, "--tp", "4")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "input hash mismatch" in p.stderr and not dst.exists()


def test_summary_names_what_was_reused(llama: Path, tmp_path: Path) -> None:
    dst = tmp_path / "tp4"
    killed(llama, dst, "--tp", "4")
    p = shardctl("reshard", llama, dst, "--tp", "4")
    assert p.returncode == 0, p.stderr
    assert "resumed a killed run: reused 2 finished files" in " ".join(p.stdout.split())
