"""DeepSeek-V3 / R1: DeepSeek-V2's MLA + MoE (see :mod:`shardctl.archs.deepseek_v2`) with

- a sigmoid router with a per-expert ``mlp.gate.e_score_correction_bias [E]`` (replicated:
  vLLM ``DeepseekV2MoE`` keeps it beside the ``ReplicatedLinear`` gate) that only biases which
  experts are chosen, group-limited (``n_group`` / ``topk_group``);
- MLPs without biases;
- one multi-token-prediction layer in the published checkpoint (``model.layers.61.*``, vLLM
  ``deepseek_mtp.py``): placed on the last pipeline stage, counted by the inventory from a
  config only with ``include_mtp_layers: true``.

The BF16 tensors are what ``save_pretrained`` writes. The published DeepSeek-V3 / R1 files are
FP8: a config with their ``quantization_config`` (``quant_method: fp8``, ``weight_block_size
[128, 128]``) inventories them as stored (shardctl/quant/expand.py)::

    every q_a / q_b / kv_a_proj_with_mqa / kv_b / o projection and every dense, shared and routed
    expert gate / up / down projection:  weight F8_E4M3 + weight_scale_inv F32 [⌈out/128⌉, ⌈in/128⌉]
    mlp.gate.e_score_correction_bias     F32 (transformers keeps it fp32; save_pretrained from a
                                         bf16 model writes BF16 before 5.24, F32 with the router
                                         weight from 5.24 on: ``fp32_kept``)
    MTP eh_proj [H, 2H]                  BF16, no scale (vLLM deepseek_mtp.py builds it as a plain
                                         nn.Linear); embeddings, head, norms, router weight BF16

That inventory equals the published checkpoint tensor for tensor: 91,991 tensors; elements BF16
3,918,786,560 / F8_E4M3 680,571,043,840 / F32 41,555,600 (the Hub's per-dtype safetensors counts);
688,574,839,360 bytes of tensor data (tests/test_flagships.py cites the sources).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardctl.archs._family import (
    Config,
    MegatronDecl,  # megatron-moe
)
from shardctl.archs.deepseek_v2 import CONFIG_KEYS, mla_family


def sigmoid_weights(logits: Any, indices: Any, config: Config) -> Any:
    """transformers ``DeepseekV3TopkRouter``: sigmoid scores (without the correction bias) at
    the chosen experts, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``."""
    import torch

    weights = torch.sigmoid(logits.float()).gather(-1, indices)
    if config.get("norm_topk_prob", True):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * float(config.get("routed_scaling_factor") or 1.0)


# transformers 5.23 DeepseekV3Config defaults for the keys a hub config may leave out
V3_DEFAULTS: Config = {
    "q_lora_rank": 1536,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
}

FAMILY = mla_family(
    "deepseek_v3",
    router_bias=True,
    mlp_bias=False,
    route_weights=sigmoid_weights,
    defaults=V3_DEFAULTS,
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(moe="mlp", shared="shared_experts", router="sigmoid_bias", mla=True),
    # transformers 5.24 saves the router and its bias in F32 (_keep_in_fp32_modules_strict =
    # ["e_score_correction_bias", "gate.weight"]); 5.23 saved both in the model's dtype
    fp32_kept=(
        ("5.24", "model.layers.*.mlp.gate.weight"),
        ("5.24", "model.layers.*.mlp.gate.e_score_correction_bias"),
    ),
)

# flagships: the published FP8 checkpoint's storage (see the module docstring)
FAMILY = dataclasses.replace(
    FAMILY,
    config_keys=(*CONFIG_KEYS, "quantization_config"),
    quantizable=(
        "model.layers.*.self_attn.*_proj.weight",
        "model.layers.*.self_attn.*_proj_with_mqa.weight",
        "model.layers.*.mlp.*_proj.weight",  # dense, shared_experts.* and experts.{e}.*
    ),
    quantized_dtypes=(("model.layers.*.mlp.gate.e_score_correction_bias", "F32"),),
)

# vllm-families: how vLLM names these tensors in sharded_state (shardctl/formats/vllm/spec.py)
from shardctl.formats.vllm.spec import DEEPSEEK_V3, declare  # noqa: E402

FAMILY = declare(FAMILY, DEEPSEEK_V3)
