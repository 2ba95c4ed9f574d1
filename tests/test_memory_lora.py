"""LoRA and QLoRA training plans, with PEFT itself as the producer of the adapter count.

PEFT (``get_peft_model``) builds the adapters on transformers' own model (on the meta device:
real shapes, no memory), and its trainable parameters are what the plan must count; PEFT's
default ``autocast_adapter_dtype=True`` keeps them in fp32 over a bf16 base.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardctl

peft = pytest.importorskip("peft")  # a dev dependency: present in CI

LLAMA_3_8B = """\
model:
  model_type: llama
  hidden_size: 4096
  intermediate_size: 14336
  num_hidden_layers: 32
  num_attention_heads: 32
  num_key_value_heads: 8
  vocab_size: 128256
  max_position_embeddings: 8192
  tie_word_embeddings: false
  torch_dtype: bfloat16
mesh: {{tp: {tp}, dp: {dp}}}
hardware: {{device_memory: 24GiB, gpus_per_node: 8}}
workload:
  mode: training
  batch_size: {dp}
  sequence_length: 2048
training:
  optimizer: adamw
  recompute: full
  zero: {zero}
  lora_rank: 16
  lora_targets: {targets}
"""


def _manifest(tmp_path: Path, *, tp=1, dp=1, zero=0, targets="all-linear", quant="") -> Path:
    path = tmp_path / "lora.yaml"
    text = LLAMA_3_8B.format(tp=tp, dp=dp, zero=zero, targets=targets)
    path.write_text(text + (f"quantization: {{method: {quant}}}\n" if quant else ""))
    return path


def _peft_trainable(targets: list[str] | str) -> tuple[int, set[str]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets))
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    return sum(p.numel() for p in trainable), {str(p.dtype) for p in trainable}


@pytest.mark.parametrize(
    ("targets", "modules"),
    [
        ("all-linear", "all-linear"),
        ("attention", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ],
)
def test_trainable_parameters_and_states_equal_pefts(
    tmp_path: Path, targets: str, modules: list[str] | str
) -> None:
    trainable, dtypes = _peft_trainable(modules)
    assert dtypes == {"torch.float32"}  # fp32 adapters: 4 B weights and gradients
    rank = shardctl.plan(_manifest(tmp_path, targets=targets)).memory.coords[(0, 0, 0)]
    assert rank.detail["lora.trainable_params"] == trainable
    assert rank.gradients == 4 * trainable  # the frozen base has none
    assert rank.optimizer == 8 * trainable  # AdamW m and v, no master copy of fp32 adapters
    # The base weights are all there, frozen, plus the adapters.
    full = shardctl.plan(_manifest(tmp_path, targets=targets)).memory
    assert rank.weights == 16_060_522_496 + 4 * trainable == full.coords[(0, 0, 0)].weights


def test_tensor_parallel_adapters_sum_to_pefts_plus_replicated_halves(tmp_path: Path) -> None:
    """Column-parallel ``A [r, in]`` and row-parallel ``B [out, r]`` replicate over tp."""
    one = shardctl.plan(_manifest(tmp_path)).memory.coords[(0, 0, 0)]
    two = shardctl.plan(_manifest(tmp_path, tp=2)).memory.coords[(0, 0, 0)]
    n1, n2 = one.detail["lora.trainable_params"], two.detail["lora.trainable_params"]
    h, r, layers = 4096, 16, 32
    replicated = r * 7 * h * layers  # A [r, h] of q, k, v, gate, up; B [h, r] of o, down
    assert 2 * n2 - replicated == n1


def test_zero3_shards_adapter_states_and_frozen_base(tmp_path: Path) -> None:
    one = shardctl.plan(_manifest(tmp_path, dp=1, zero=0)).memory.coords[(0, 0, 0)]
    eight = shardctl.plan(_manifest(tmp_path, dp=8, zero=3)).memory.coords[(0, 0, 0)]
    assert eight.optimizer == -(-one.optimizer // 8)
    assert eight.gradients == -(-one.gradients // 8)
    gather = eight.detail["weights.zero3_gather"]
    assert eight.weights - gather < one.weights // 4


def test_qlora_base_is_4bit_and_full_training_of_a_4bit_base_is_refused(tmp_path: Path) -> None:
    lora = shardctl.plan(_manifest(tmp_path)).memory.coords[(0, 0, 0)]
    qlora = shardctl.plan(_manifest(tmp_path, quant="nf4")).memory.coords[(0, 0, 0)]
    assert qlora.gradients == lora.gradients and qlora.optimizer == lora.optimizer
    assert qlora.weights < lora.weights * 0.4  # nf4 linears, 16-bit embeddings and head
    path = _manifest(tmp_path, quant="nf4")
    path.write_text(path.read_text().replace("  lora_rank: 16\n", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "lora_rank" in proc.stderr and "Traceback" not in proc.stderr
