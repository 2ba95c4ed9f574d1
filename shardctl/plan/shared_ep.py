"""Experts spread over the ranks that run attention (``mesh.expert_placement: shared``).

The layout engines serve MoE models this way: vLLM's ``--enable-expert-parallel`` makes the
expert-parallel group the whole ``tp × dp`` attention group (``ep_size = tp · dp``,
``ep_rank = dp_rank · tp + tp_rank``); attention and the other dense weights stay TP-sharded and
DP-replicated; each expert lives whole on one EP rank (not TP-split). Megatron-Core's expert
parallelism likewise forms its EP groups out of the data-parallel ranks of attention. So there
are ``pp · dp · tp`` GPUs, not ``pp · dp · ep · tp``, and each attention DP rank holds the KV
cache of its own share of the batch (``batch / dp``, heads ``/ tp``).

Weights per rank, from the layout engine (the bytes ``reshard`` would write for each part):
the dense tensors of the ``(pp, tp)`` mesh, plus the expert tensors of the ``(pp, ep)`` mesh
at ``tp = 1``, expert rank ``dp_rank · tp + tp_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardctl.dtypes import nbytes
from shardctl.errors import InvalidInputError
from shardctl.layout.split import local_numels
from shardctl.layout.types import LayoutOptions, Mesh, RuleSpec, Stage
from shardctl.model.types import ModelInfo

# (pp, dp, tp) of the attention mesh -> weight bytes
Coord = tuple[int, int, int]


def attention_mesh(mesh: Mesh) -> Mesh:
    """The GPUs of a shared-EP mesh: ``pp × dp × tp``; refuses ``ep != tp · dp``."""
    if mesh.ep != mesh.tp * mesh.dp:
        raise InvalidInputError(
            f"expert_placement: shared spreads experts over the tp×dp = {mesh.tp}×{mesh.dp} = "
            f"{mesh.tp * mesh.dp} attention ranks, but mesh.ep is {mesh.ep}",
            where="mesh.ep",
            hint=f"set ep: {mesh.tp * mesh.dp}, or expert_placement: separate for an ep axis of "
            "its own",
        )
    return Mesh(pp=mesh.pp, dp=mesh.dp, ep=1, tp=mesh.tp)


def shared_ep_weights(
    model: ModelInfo,
    mesh: Mesh,
    *,
    rules: Sequence[RuleSpec],
    options: LayoutOptions,
) -> tuple[tuple[Stage, ...], dict[Coord, int]]:
    """Stages and weight bytes per attention coordinate ``(pp, dp, tp)`` of a shared-EP
    ``mesh`` (``mesh.ep == tp · dp``)."""
    from shardctl.layout.engine import resolve

    attn = attention_mesh(mesh)
    if not model.tensors:
        raise InvalidInputError(
            "expert_placement: shared needs the model's tensors (a bare count has no experts)",
            where="mesh.expert_placement",
            hint="give model.config or model.checkpoint",
        )
    dense = resolve(model, Mesh(pp=mesh.pp, tp=mesh.tp), rules=rules, options=options)
    experts = resolve(model, Mesh(pp=mesh.pp, ep=mesh.ep), rules=rules, options=options)
    out = {(p, d, t): 0 for p in range(mesh.pp) for d in range(mesh.dp) for t in range(mesh.tp)}
    for plan in dense.tensors:
        if plan.ep_rank is not None or plan.packed:
            continue  # an expert: placed by the second resolution
        sizes = [nbytes(plan.info.dtype, n) for n in local_numels(plan.split, mesh.tp)]
        for p in plan.stages:
            for d in range(mesh.dp):
                for t in range(mesh.tp):
                    out[(p, d, t)] += sizes[t]
    for plan in experts.tensors:
        if plan.packed:  # every expert in one tensor: each ep rank holds E/ep rows of dim 0
            size = nbytes(plan.info.dtype, local_numels(plan.split, 1)[0] // mesh.ep)
            for p in plan.stages:
                for key in out:
                    if key[0] == p:
                        out[key] += size
            continue
        if plan.ep_rank is None:
            continue
        size = nbytes(plan.info.dtype, local_numels(plan.split, 1)[0])
        d, t = divmod(plan.ep_rank, mesh.tp)  # vLLM: ep_rank = dp_rank · tp + tp_rank
        for p in plan.stages:
            out[(p, d, t)] += size
    assert dense.stages == experts.stages and attn.world == len(out)
    return dense.stages, out


def memory_coords(weights: dict[Coord, int], mesh: Mesh) -> dict[tuple[int, int, int], int]:
    """The memory model's ``(pp, ep, tp)`` weights for the attention mesh (``ep`` = 0): the
    largest over the dp ranks (equal when the experts divide evenly, which the engine checks)."""
    return {
        (p, 0, t): max(weights[(p, d, t)] for d in range(mesh.dp))
        for p in range(mesh.pp)
        for t in range(mesh.tp)
    }


def check_modeled(training: bool, quantized: bool) -> None:
    """Shared EP is modeled for serving unquantized weights; say so instead of guessing."""
    if training or quantized:
        what = "training" if training else "quantization"
        raise InvalidInputError(
            f"expert_placement: shared with {what} is not modeled",
            where="mesh.expert_placement",
            hint="plan it with expert_placement: separate, or serve unquantized weights",
        )
