"""verify's forward level: the sharded checkpoint runs as a sharded model.

- simulation (every rank a thread, collectives through ThreadComm): every architecture at
  several meshes, and the wrong-but-consistent layouts that only the forward level can catch;
- real gloo process groups: one world of 4 processes for the whole module (start-up once);
- GPU: NCCL / one-GPU simulation, skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shardctl.layout.types import Mesh
from shardctl.verify.api import verify
from shardctl.verify.launch import ProcessWorld
from tests._verify_fixtures import Checkpoints


@pytest.fixture(scope="module")
def cks(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("verify-forward"))


@pytest.fixture(scope="module")
def gloo4() -> Iterator[ProcessWorld]:
    with ProcessWorld(4, backend="gloo") as world:
        yield world


def _forward(result):  # type: ignore[no-untyped-def]
    return result.level_result("forward")


CASES = [
    ("llama", Mesh(tp=2)),
    ("llama", Mesh(tp=4)),  # tp > kv heads: replicated K/V
    ("llama", Mesh(pp=2, tp=2)),
    ("llama-tied-mha", Mesh(pp=3)),
    ("llama-bias-headdim", Mesh(tp=2)),
    ("mistral", Mesh(tp=2)),
    ("qwen2", Mesh(tp=2)),
    ("qwen2-tied", Mesh(pp=2, tp=2)),
    ("qwen3", Mesh(tp=2)),  # q_norm / k_norm per head: replicated
    ("qwen3", Mesh(pp=2, tp=4)),  # tp > kv heads
    ("gemma2", Mesh(tp=2)),  # soft-capping, alternating sliding-window layers
    ("gemma2", Mesh(pp=2, tp=2)),
    ("gemma", Mesh(tp=2)),
    ("gemma", Mesh(pp=2, tp=4)),
    ("phi3", Mesh(tp=2)),
    ("phi3-mha", Mesh(tp=4)),
    ("gpt2", Mesh(tp=4)),  # vocab 250 padded to 252
    ("gpt2", Mesh(pp=2, tp=2)),
    ("mixtral", Mesh(ep=2, tp=2)),
    ("mixtral", Mesh(ep=4)),
]


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_simulated_forward_matches(cks: Checkpoints, name: str, mesh: Mesh) -> None:
    result = verify(cks.ckpt(name), cks.resharded(name, mesh), device="cpu", simulate=True)
    fw = _forward(result)
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    assert result.environment["simulated"] is True
    assert result.environment["world_size"] == mesh.model_parallel
    for m in ("max_abs", "mean_abs", "kl"):
        assert fw.figures["sharded"][m] <= fw.figures["bounds"][m]


def test_float32_checkpoint_uses_the_floor(cks: Checkpoints) -> None:
    src = cks.ckpt("llama", "float32")
    result = verify(src, cks.resharded("llama", Mesh(tp=4), "float32"), device="cpu", simulate=True)
    assert result.ok
    fw = _forward(result)
    assert fw.figures["dtype"] == "float32"
    assert fw.figures["sharded"]["max_abs"] < 1e-2


# -- wrong but self-consistent layouts: structure and bitwise pass, forward fails -----------

NEGATIVE = [
    ("phi3", Mesh(tp=2), "naive-fused"),  # plain chunk of [Q;K;V] and [gate;up]
    ("gpt2", Mesh(tp=2), "naive-fused"),  # plain chunk of c_attn [in, 3·out]
    ("phi3", Mesh(tp=2), "swap-gate-up"),  # each rank holds [up_r; gate_r]
    ("llama", Mesh(tp=4), "kv-replication"),  # rank r holds kv head r % 2, not r // 2
    ("granite", Mesh(tp=4), "kv-replication"),  # the same, under its config multipliers
    ("llama", Mesh(tp=2), "rowwise-dim0"),  # o_proj split on dim 0
]


@pytest.mark.parametrize("name,mesh,fault", NEGATIVE, ids=[n[2] + "-" + n[0] for n in NEGATIVE])
def test_consistent_but_wrong_layouts_fail_forward(
    cks: Checkpoints, name: str, mesh: Mesh, fault: str
) -> None:
    result = verify(cks.ckpt(name), cks.hand_split(name, mesh, fault), device="cpu", simulate=True)
    statuses = {lv.name: lv.status for lv in result.levels}
    assert statuses == {"structure": "pass", "bitwise": "pass", "forward": "fail"}, statuses
    assert not result.ok
    fw = _forward(result)
    assert fw.findings
    if fault == "rowwise-dim0":  # caught while loading, naming the tensor
        assert fw.findings[0].fqn == "model.layers.0.self_attn.o_proj.weight"
        assert "[32, 64]" in fw.findings[0].message
    else:
        assert fw.figures["sharded"]["mean_abs"] > 4 * fw.figures["unsharded"]["mean_abs"]


def test_correct_hand_split_passes_forward(cks: Checkpoints) -> None:
    # the same splitter without a fault: the negative results above come from the fault
    assert verify(
        cks.ckpt("phi3"), cks.hand_split("phi3", Mesh(tp=2)), device="cpu", simulate=True
    ).ok


def test_sharded_src_against_hf_dst_runs_src_sharded(cks: Checkpoints) -> None:
    result = verify(
        cks.resharded("qwen2", Mesh(tp=2)), cks.ckpt("qwen2"), device="cpu", simulate=True
    )
    assert result.ok and result.environment["world_size"] == 2


# -- both sides sharded: the reference is SRC reassembled from its shards ------------------

BOTH = [
    ("llama", Mesh(tp=2), Mesh(tp=4)),  # SRC's K/V split, DST's replicated
    ("mixtral", Mesh(ep=2), Mesh(ep=2, tp=2)),
    ("gpt2", Mesh(tp=4), Mesh(pp=2, tp=2)),  # SRC's vocab padded (250 -> 252)
]


@pytest.mark.parametrize("name,a,b", BOTH, ids=[f"{n}-{a}-to-{b}" for n, a, b in BOTH])
def test_both_sides_sharded(cks: Checkpoints, name: str, a: Mesh, b: Mesh) -> None:
    result = verify(cks.resharded(name, a), cks.resharded(name, b), device="cpu", simulate=True)
    assert result.ok, [str(f) for lv in result.levels for f in lv.findings]
    fw = _forward(result)
    assert fw.figures["reference"] == "merged from SRC's shards"
    assert result.environment["world_size"] == b.model_parallel  # DST is the side that runs
    for m in ("max_abs", "mean_abs", "kl"):
        assert fw.figures["sharded"][m] <= fw.figures["bounds"][m]


def test_both_sides_sharded_wrong_dst_fails_forward(cks: Checkpoints) -> None:
    # DST self-consistent (structure and bitwise pass against the TP2 SRC) but rank r holds
    # kv head r % 2 instead of r // 2: only a forward against SRC's model can tell.
    src = cks.resharded("llama", Mesh(tp=2))
    result = verify(
        src, cks.hand_split("llama", Mesh(tp=4), "kv-replication"), device="cpu", simulate=True
    )
    statuses = {lv.name: lv.status for lv in result.levels}
    assert statuses == {"structure": "pass", "bitwise": "pass", "forward": "fail"}, statuses
    fw = _forward(result)
    assert fw.figures["reference"] == "merged from SRC's shards"
    assert fw.figures["sharded"]["mean_abs"] > 4 * fw.figures["unsharded"]["mean_abs"]


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("llama", Mesh(tp=4)),
        ("mixtral", Mesh(ep=2, tp=2)),
        ("gpt2", Mesh(tp=4)),
        ("qwen2-tied", Mesh(pp=2, tp=2)),
        ("qwen3", Mesh(tp=2)),  # q_norm / k_norm per head: replicated
        ("qwen3", Mesh(pp=2, tp=4)),  # tp > kv heads
        ("gemma2", Mesh(tp=2)),  # soft-capping, alternating sliding-window layers
        ("gemma2", Mesh(pp=2, tp=2)),
    ],
)
def test_reference_merge_is_the_original_bit_for_bit(
    cks: Checkpoints, name: str, mesh: Mesh
) -> None:
    from safetensors import safe_open

    from shardctl.verify.reference import hf_reference

    original = cks.ckpt(name)
    expected: dict[str, torch.Tensor] = {}
    for path in original.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            expected.update({k: f.get_tensor(k) for k in f.keys()})
    figures: dict[str, object] = {}
    with hf_reference(cks.resharded(name, mesh), figures) as merged:
        with safe_open(merged / "model.safetensors", "pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
        assert (merged / "config.json").read_bytes() == (original / "config.json").read_bytes()
        where = merged
    assert not where.exists()  # the temporary copy is gone
    assert sorted(got) == sorted(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].view(torch.int16), t.view(torch.int16)), k
    assert figures["reference_merge_bytes"] == sum(t.nbytes for t in expected.values())
    # an HF checkpoint is its own reference: nothing written
    with hf_reference(original) as same:
        assert same == original


@pytest.mark.slow
def test_cli_both_sides_sharded_gloo(cks: Checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``shardctl verify TP2 TP4 --level forward`` as a user runs it: real gloo processes."""
    import json
    import subprocess
    import sys

    src = cks.resharded("llama", Mesh(tp=2))
    cases = [
        (cks.resharded("llama", Mesh(tp=4)), 0),
        (cks.hand_split("llama", Mesh(tp=4), "kv-replication"), 1),
    ]
    for dst, code in cases:
        cmd = [
            sys.executable,
            "-m",
            "shardctl",
            "verify",
            str(src),
            str(dst),
            "--level",
            "forward",
            "--device",
            "cpu",
            "--json",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        data = json.loads(done.stdout)
        assert data["ok"] is (code == 0)
        levels = {lv["name"]: lv for lv in data["levels"]}
        assert [lv["status"] for lv in data["levels"]] == (
            ["pass", "pass", "pass"] if code == 0 else ["pass", "pass", "fail"]
        )
        assert levels["forward"]["figures"]["reference"] == "merged from SRC's shards"
        assert data["environment"]["backend"] == "gloo"
        assert data["environment"]["world_size"] == 4


# -- real process groups ---------------------------------------------------------------------

GLOO = [
    ("llama", Mesh(tp=4), None),
    ("gpt2", Mesh(pp=2, tp=2), None),
    ("mixtral", Mesh(ep=2, tp=2), None),
    ("gemma", Mesh(pp=2, tp=2), None),
    ("phi3", Mesh(tp=4), "naive-fused"),
]


@pytest.mark.parametrize("name,mesh,fault", GLOO, ids=[f"{n}-{m}-{f}" for n, m, f in GLOO])
def test_gloo_processes(
    cks: Checkpoints, gloo4: ProcessWorld, name: str, mesh: Mesh, fault: str | None
) -> None:
    dst = cks.hand_split(name, mesh, fault) if fault else cks.resharded(name, mesh)
    result = verify(cks.ckpt(name), dst, device="cpu", simulate=False, world=gloo4)
    assert result.environment["backend"] == "gloo"
    assert result.environment["simulated"] is False
    assert result.ok is (fault is None), [str(f) for f in _forward(result).findings]


def test_gloo_one_shot_launch(cks: Checkpoints) -> None:
    """The default path: spawn one process per rank for this run, gloo, then tear down."""
    result = verify(cks.ckpt("qwen2"), cks.resharded("qwen2", Mesh(tp=2)), device="cpu")
    assert result.ok and result.environment["backend"] == "gloo"


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,mesh", [("llama", Mesh(tp=2)), ("mixtral", Mesh(ep=2, tp=2))])
def test_cuda_forward(cks: Checkpoints, name: str, mesh: Mesh) -> None:
    result = verify(cks.ckpt(name), cks.resharded(name, mesh), device="cuda")
    assert result.ok
    gpus = torch.cuda.device_count()
    assert result.environment["simulated"] is (gpus < mesh.model_parallel)
    assert result.environment["backend"] == ("threads" if gpus < mesh.model_parallel else "nccl")


@pytest.mark.slow
def test_torchrun_worker(cks: Checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The multi-node entry point, on one node: torchrun sets RANK/WORLD_SIZE, rank 0 reports."""
    import json
    import subprocess
    import sys

    report = tmp_path / "verify.json"
    dst = cks.resharded("qwen2", Mesh(tp=2))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "shardctl.verify.worker",
        str(cks.ckpt("qwen2")),
        str(dst),
        "--report",
        str(report),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["schema"] == "shardctl.verify/1" and data["ok"] is True
    assert data["environment"]["launcher"] == "torchrun"
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_two_nodes_on_localhost(cks: Checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two torchrun agents started as two nodes would start them (README, multi-node): one rank
    each, c10d rendezvous at one endpoint. SRC is itself sharded (TP4) and DST is TP2, so the
    rank 0 the rendezvous picks also rebuilds SRC's model from its shards for the reference."""
    import json
    import subprocess
    import sys

    src, dst = cks.resharded("llama", Mesh(tp=4)), cks.resharded("llama", Mesh(tp=2))
    report = tmp_path / "verify.json"
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "verify-two-nodes",
            "--rdzv-conf",
            "join_timeout=60",
            "-m",
            "shardctl.verify.worker",
            str(src),
            str(dst),
            "--report",
            str(report),
        ]
        log = open(tmp_path / f"node{node}.log", "wb")  # closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    codes: list[int | str] = []
    try:
        for p, _ in procs:
            try:  # a hang guard, not a speed limit: the logs say where it stood
                codes.append(p.wait(timeout=600))
            except subprocess.TimeoutExpired:
                codes.append("hung")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [(tmp_path / f"node{n}.log").read_text(errors="replace")[-1500:] for n in (0, 1)]
    assert codes == [0, 0], logs
    data = json.loads(report.read_text())
    assert data["ok"] is True, data
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"]
    assert data["environment"]["launcher"] == "torchrun"
    assert data["environment"]["nodes"] == "2" and data["environment"]["world_size"] == 2
    forward = data["levels"][2]["figures"]
    assert forward["reference"] == "merged from SRC's shards"
    assert all("Traceback" not in text for text in logs)


def test_torchrun_device_is_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun a rank's GPU is LOCAL_RANK: global rank 9 of 2 nodes × 8 is cuda:1."""
    from shardctl.errors import EnvironmentFailure
    from shardctl.verify import distributed

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.local_device() == "cuda:1" and chosen == [1]
    monkeypatch.setenv("LOCAL_RANK", "8")  # more processes than GPUs on the node
    with pytest.raises(EnvironmentFailure, match="LOCAL_RANK 8"):
        distributed.local_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.local_device() == "cpu"


def test_cli_forward_output_scales_and_has_no_third_party_bars(
    cks: Checkpoints,
) -> None:
    """The text report counts what passed instead of listing it; ``--verbose`` lists every
    tensor; transformers' "Loading weights" bar (the reference load) never leaks into it."""
    import subprocess
    import sys

    src, dst = cks.ckpt("llama"), cks.resharded("llama", Mesh(tp=2))
    base = [sys.executable, "-m", "shardctl", "verify", str(src), str(dst)]
    done = subprocess.run(
        [*base, "--level", "forward", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "Loading weights" not in out and "it/s]" not in out, out
    tensors = len(cks_tensors(src))
    assert f"{tensors} tensors bit-identical" in " ".join(done.stdout.split())
    assert "model.layers.0.self_attn.q_proj.weight" not in done.stdout  # counted, not listed
    assert "EQUIVALENT" in done.stdout
    verbose = subprocess.run(
        [*base, "--level", "bitwise", "--verbose"], capture_output=True, text=True, timeout=300
    )
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    assert "model.layers.0.self_attn.q_proj.weight" in verbose.stdout


def cks_tensors(src):  # type: ignore[no-untyped-def]
    from shardctl.checkpoint.source import open_source

    return open_source(src).model.tensors
