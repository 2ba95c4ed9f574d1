"""DeepSeek-V3 / R1: DeepSeek-V2's MLA + MoE (see :mod:`shardctl.archs.deepseek_v2`) with

- a sigmoid router with a per-expert ``mlp.gate.e_score_correction_bias [E]`` (replicated:
  vLLM ``DeepseekV2MoE`` keeps it beside the ``ReplicatedLinear`` gate) that only biases which
  experts are chosen, group-limited (``n_group`` / ``topk_group``);
- MLPs without biases;
- one multi-token-prediction layer in the published checkpoint (``model.layers.61.*``, vLLM
  ``deepseek_mtp.py``): placed on the last pipeline stage, counted by the inventory from a
  config only with ``include_mtp_layers: true``.

The published DeepSeek-V3 weights are FP8 (``weight_scale_inv`` per 128×128 block); this file
describes the BF16 tensors (``save_pretrained``, the community BF16 conversions).
"""

from __future__ import annotations

from typing import Any

from shardctl.archs._family import (
    Config,
    MegatronDecl,  # megatron-moe
)
from shardctl.archs.deepseek_v2 import mla_family


def _sigmoid_weights(logits: Any, indices: Any, config: Config) -> Any:
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
    route_weights=_sigmoid_weights,
    defaults=V3_DEFAULTS,
    # megatron-moe: how Megatron-Core holds this family (shardctl/formats/megatron)
    megatron=MegatronDecl(moe="mlp", shared="shared_experts", router="sigmoid_bias", mla=True),
)
