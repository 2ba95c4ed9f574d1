"""What Qwen2-MoE and Qwen3-MoE share: per-expert tensors on disk, a router, dense layers.

On disk (``save_pretrained`` of transformers 5.23 and the published checkpoints alike)::

    mlp.gate.weight                          [E, H]      router, replicated
    mlp.experts.{e}.gate_proj/up_proj.weight [I_moe, H]  column-parallel inside expert e
    mlp.experts.{e}.down_proj.weight         [H, I_moe]  row-parallel inside expert e

transformers 5 packs the experts in memory (``mlp.experts.gate_up_proj [E, 2·I_moe, H]``,
``mlp.experts.down_proj [E, H, I_moe]``); the inventory follows the on-disk names and verify's
forward level maps them (:class:`~shardctl.archs.ExpertSpec`). A layer is sparse when it is not
in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the others carry a dense
``mlp.{gate,up,down}_proj`` of ``intermediate_size``. ``ModelDims.intermediate_size`` is the
experts' ``moe_intermediate_size`` (what the expert rules and memory model need).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from shardctl.archs._decoder import R, decoder_local_config
from shardctl.archs._family import Config, ExpertSpec, Family, get_int, local_div
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

EXPERT_RULES: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.mlp.experts.*.gate_proj.*", tp="colwise", expert=True),
    RuleSpec("model.layers.*.mlp.experts.*.up_proj.*", tp="colwise", expert=True),
    RuleSpec("model.layers.*.mlp.experts.*.down_proj.*", tp="rowwise", expert=True),
    RuleSpec("model.layers.*.mlp.gate.*", tp=R),  # router [E, H]
)

EXPERTS = ExpertSpec(
    router="mlp.gate.weight",
    router_param="mlp.gate.weight",
    pattern=r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    module="mlp.experts",
)

# Both configs' keys that set which layers are sparse and how wide the experts are.
MOE_SHAPES = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)
MOE_OTHER = ("norm_topk_prob", "output_router_logits", "router_aux_loss_coef")


def num_experts(config: Config, where: str) -> int:
    """``num_experts`` (the hub's key) or ``num_local_experts`` (what transformers 5 writes for
    Qwen3-MoE: its config maps one onto the other)."""
    key = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    return get_int(config, key, where)


def sparse_layers(config: Config, num_layers: int, where: str) -> list[int]:
    """The layers with experts, as transformers' ``Qwen2MoeDecoderLayer`` decides."""
    step = get_int(config, "decoder_sparse_step", where, default=1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise InvalidInputError(
            f"'mlp_only_layers': expected a list of layer indices, got {dense!r}", where=where
        )
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def moe_dims(base: ModelDims, config: Config, where: str) -> ModelDims:
    """``base`` (the decoder's dims) with the experts' count, top-k and width."""
    return dataclasses.replace(
        base,
        num_experts=num_experts(config, where),
        experts_per_token=get_int(config, "num_experts_per_tok", where),
        intermediate_size=get_int(config, "moe_intermediate_size", where),
    )


def moe_local_config(
    cfg: Config, d: ModelDims, tp: int, ep: int, first_layer: int, num_layers: int
) -> dict[str, Any]:
    """A rank's config: the decoder's, plus local expert / shared-expert / dense widths, and
    the stage's sparse layers renumbered from 0 (``decoder_sparse_step`` 1, dense layers listed
    in ``mlp_only_layers``) so a stage that starts mid-pattern keeps each layer's kind."""
    local = decoder_local_config(cfg, d, tp, ep, first_layer, num_layers)
    dense = get_int(cfg, "intermediate_size", "config")
    local["intermediate_size"] = local_div("intermediate_size", dense, tp)
    local["moe_intermediate_size"] = local_div("moe_intermediate_size", d.intermediate_size, tp)
    if cfg.get("shared_expert_intermediate_size"):
        shared = int(cfg["shared_expert_intermediate_size"])
        local["shared_expert_intermediate_size"] = local_div(
            "shared_expert_intermediate_size", shared, tp
        )
    local_div("num_experts", d.num_experts, ep)
    sparse = set(sparse_layers(cfg, d.num_layers, "config"))
    local["decoder_sparse_step"] = 1
    local["mlp_only_layers"] = [
        i - first_layer for i in range(first_layer, first_layer + num_layers) if i not in sparse
    ]
    return local


def localize(model: Any, config: Any, d: ModelDims, tp: int, ep: int, dtype: Any) -> None:
    """Each sparse layer's experts module rebuilt with this ep rank's ``E / ep`` experts (the
    router keeps scoring all ``E``)."""
    sub = copy.copy(config)
    sub.num_experts = d.num_experts // ep
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            layer.mlp.experts = type(experts)(sub).to(dtype)


def with_moe(base: Family, dims: Callable[[Config, bool, str], ModelDims]) -> Family:
    """``base`` (a :func:`~shardctl.archs._decoder.decoder_family`) with MoE dims and the MoE
    local config for verify's forward level."""
    assert base.forward is not None
    forward = dataclasses.replace(base.forward, local_config=moe_local_config)
    return dataclasses.replace(base, dims=dims, forward=forward)
