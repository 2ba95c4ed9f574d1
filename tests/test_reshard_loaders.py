"""Outputs load in the engines' own loaders: torch DCP's HuggingFaceStorageReader on a real gloo
group of two processes (``ranks``), and transformers' ``from_pretrained`` (``hf``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardctl.layout.types import LayoutOptions, Mesh
from shardctl.reshard.api import reshard
from tests._models import make_checkpoint

DCP_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from safetensors.torch import load_file
    dst, original = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ref = load_file(original)
    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(dst))
    for k, v in ref.items():
        assert torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)), k
    dist.barrier()
    dist.destroy_process_group()
    print("rank", dist.get_rank() if dist.is_initialized() else "done", "ok", len(ref))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [Mesh(tp=2), Mesh(tp=4, pp=2)])
def test_torch_dcp_loads_ranks_output(tmp_path: Path, mesh: Mesh) -> None:
    src = make_checkpoint("llama", tmp_path / "src")
    dst = tmp_path / "dst"
    reshard(src, dst, mesh=mesh)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", DCP_WORKER, str(dst), str(src / "model.safetensors")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tied-mha", "gpt2", "phi3"])
def test_transformers_loads_merged_output(tmp_path: Path, model: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(model, tmp_path / "src")
    mesh = Mesh(tp=2, pp=2) if model != "gpt2" else Mesh(tp=4)
    reshard(src, tmp_path / "split", mesh=mesh, options=LayoutOptions(pipeline="vllm"))
    reshard(tmp_path / "split", tmp_path / "merged", max_shard_size=50_000)
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16).state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
