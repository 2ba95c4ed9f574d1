"""Context parallelism (``mesh.cp``) and the global batch with a given micro-batch.

Megatron-LM's CP (``--context-parallel-size``) splits every sequence over ``cp`` ranks of a
replica: a rank keeps the activations of its ``s/cp`` tokens (queries against all ``s`` keys in
ring attention), holds the same weights as its replica's other cp ranks, and the distributed
optimizer shards over ``dp × cp``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardctl

BASE = """\
model:
  model_type: llama
  hidden_size: 8192
  intermediate_size: 28672
  num_hidden_layers: 80
  num_attention_heads: 64
  num_key_value_heads: 8
  vocab_size: 128256
  max_position_embeddings: 131072
  tie_word_embeddings: false
  torch_dtype: bfloat16
mesh: {{tp: 8, pp: 4, dp: {dp}{cp}}}
hardware: {{gpu: h100-sxm, gpus_per_node: 8, nodes: 64}}
workload:
  mode: training
  batch_size: {batch}
  micro_batch_size: 1
  sequence_length: {seq}
  flash_attention: {flash}
training:
  optimizer: adamw
  zero: 1
  recompute: selective
  sequence_parallel: true
"""


ACCUM_4 = "micro_batch_size: 1\n  gradient_accumulation_steps: 4"


def _manifest(tmp_path: Path, *, dp=2, cp=1, seq=131072, batch=64, flash="true") -> Path:
    path = tmp_path / f"cp{cp}-dp{dp}-s{seq}-{flash}.yaml"
    cp_key = f", cp: {cp}" if cp > 1 else ""
    path.write_text(BASE.format(dp=dp, cp=cp_key, seq=seq, batch=batch, flash=flash))
    return path


def _rank0(path: Path):
    return shardctl.plan(path).memory.coords[(0, 0, 0)]


def test_a_cp_rank_keeps_the_activations_of_its_tokens(tmp_path: Path) -> None:
    cp4 = _rank0(_manifest(tmp_path, cp=4)).detail
    quarter = _rank0(_manifest(tmp_path, seq=131072 // 4)).detail
    assert cp4["activations.per_layer"] == quarter["activations.per_layer"]
    assert cp4["activations.logits_and_loss"] == quarter["activations.logits_and_loss"]


def test_eager_scores_are_local_queries_against_all_keys(tmp_path: Path) -> None:
    s, cp, heads, t = 8192, 2, 64, 8
    cp2 = _rank0(_manifest(tmp_path, cp=cp, seq=s, flash="false")).detail["activations.per_layer"]
    half = _rank0(_manifest(tmp_path, seq=s // cp, flash="false")).detail["activations.per_layer"]
    # selective recompute drops the scores; without it they are (a/t)·(s/cp)·s·b·B
    assert cp2 == half  # selective: no scores stored either way
    path = _manifest(tmp_path, cp=cp, seq=s, flash="false")
    path.write_text(path.read_text().replace("recompute: selective", "recompute: none"))
    none_cp = _rank0(path).detail["activations.per_layer"]
    path2 = _manifest(tmp_path, seq=s // cp, flash="false")
    path2.write_text(path2.read_text().replace("recompute: selective", "recompute: none"))
    none_half = _rank0(path2).detail["activations.per_layer"]
    local, b, nb = s // cp, 1, 2
    assert none_cp - none_half == (heads // t) * local * (s - local) * b * nb


def test_the_optimizer_shards_over_dp_times_cp(tmp_path: Path) -> None:
    cp2 = _rank0(_manifest(tmp_path, dp=2, cp=2))
    dp4 = _rank0(_manifest(tmp_path, dp=4, batch=128))
    assert cp2.optimizer == dp4.optimizer and cp2.weights == dp4.weights


def test_gpu_count_and_header(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(_manifest(tmp_path, cp=4))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "mesh PP4×DP2×EP1×TP8×CP4 = 256 GPUs" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t.replace("nodes: 64", "nodes: 8"), "needs 256 GPUs"),
        (lambda t: t.replace("sequence_length: 131072", "sequence_length: 131070"), "2 × cp"),
        (
            lambda t: t.replace("mode: training", "mode: inference").split("training:\n")[0],
            "mesh.cp",
        ),
        (lambda t: t.replace("batch_size: 64", "batch_size: 63"), "workload.batch_size"),
        (lambda t: t.replace("micro_batch_size: 1", ACCUM_4), "workload.batch_size"),
    ],
)
def test_refusals_exit_3(tmp_path: Path, change, needle: str) -> None:
    path = _manifest(tmp_path, cp=4)
    path.write_text(change(path.read_text()))
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_search_refuses_cp(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(_manifest(tmp_path, cp=2)), "--search"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3 and "mesh.cp" in proc.stderr, proc.stderr


def test_global_batch_sets_the_accumulation(tmp_path: Path) -> None:
    plan = shardctl.plan(_manifest(tmp_path, dp=2, batch=64))
    assert plan.memory.inputs["grad_accumulation"] == 32  # 64 / (micro 1 × dp 2)
    assert plan.memory.coords[(0, 0, 0)].detail["activations.in_flight"] == 4  # min(pp, m)
