"""Communication per rank: bytes each rank sends, and an α-β time estimate.

Collective volumes per rank for a message of ``M`` bytes over ``n`` ranks (ring algorithms;
Patarasuk & Yuan 2009; NCCL's ``busbw`` convention in nccl-tests PERFORMANCE.md):

    all-reduce        2·(n-1)/n · M
    all-gather        (n-1)/n · M        (M = the gathered size)
    reduce-scatter    (n-1)/n · M        (M = the input size)
    all-to-all        (n-1)/n · M
    send/recv         M

Where the collectives come from:

- inference, per generated token: 2 TP all-reduces per layer of ``b·h·B`` (after attention
  and after the MLP; Shoeybi et al. 2019 §3, Figure 3), one after the vocab-parallel
  embedding, the logits gathered on the last stage; PP sends ``b·h·B`` per stage boundary.
- training, per step of ``m`` micro-batches: TP 2 all-reduces forward and 2 backward per layer
  of ``b·s·h·B`` (+2 when full recompute replays the forward); sequence parallel replaces each
  all-reduce by an all-gather and a reduce-scatter of the same total volume (Korthikanti et al.
  2022 §4.2.2); PP one activation forward and one gradient backward per micro-batch and
  boundary (``/t`` with sequence parallel, Megatron's scatter-gather); EP 4 all-to-alls per MoE
  layer of ``T·k·h·B`` (dispatch and combine, forward and backward; Lepikhin et al. 2021);
  DP once per step an all-reduce of the gradients (ZeRO 0–1: ``2Ψ``), ZeRO-2 a
  reduce-scatter of gradients per micro-batch and an all-gather of parameters per step,
  ZeRO-3 two parameter all-gathers and one gradient reduce-scatter per micro-batch (``3Ψ``,
  Rajbhandari et al. 2020 §7).

Time ``= α · collectives + bytes / (bandwidth · efficiency)``, the link chosen per axis: a
group whose ranks share one node uses the intra-node bandwidth. No overlap with compute is
assumed (an upper bound on exposed communication).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardctl.layout.types import Mesh
from shardctl.plan.memory.hardware import HardwareSpec

# Axis order outer -> inner (shardctl.layout.types.AXES): pp, dp, ep, tp.


def axis_is_intra_node(mesh: Mesh, axis: str, gpus_per_node: int) -> bool:
    """Whether every group along ``axis`` lies within one node (ranks ordered pp, dp, ep, tp;
    TP ranks adjacent)."""
    span = {
        "tp": mesh.tp,
        "ep": mesh.tp * mesh.ep,
        "dp": mesh.tp * mesh.ep * mesh.dp,
        "pp": mesh.world,
    }[axis]
    return span <= gpus_per_node and gpus_per_node % span == 0


def all_reduce(n: int, m: float) -> float:
    return 2 * (n - 1) / n * m if n > 1 else 0.0


def gather(n: int, m: float) -> float:
    """all-gather, reduce-scatter or all-to-all of ``m`` bytes over ``n`` ranks."""
    return (n - 1) / n * m if n > 1 else 0.0


@dataclass
class CommTally:
    """Bytes a rank sends and collective calls, per axis; then the time on ``hardware``."""

    unit: str  # "token" (inference decode step) or "step" (training)
    bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, axis: str, nbytes: float, calls: int = 1) -> None:
        if nbytes <= 0:
            return
        self.bytes[axis] = self.bytes.get(axis, 0.0) + nbytes
        self.calls[axis] = self.calls.get(axis, 0) + calls

    def time(self, mesh: Mesh, hw: HardwareSpec) -> dict[str, float]:
        out = {}
        for key, nbytes in self.bytes.items():
            axis = "tp" if key == "sp" else key
            intra = axis_is_intra_node(mesh, axis, hw.gpus_per_node)
            bw = (hw.intra_node_bandwidth if intra else hw.inter_node_bandwidth) * hw.efficiency
            lat = hw.intra_node_latency if intra else hw.inter_node_latency
            out[key] = self.calls[key] * lat + nbytes / bw
        return out

    def to_json(self, mesh: Mesh, hw: HardwareSpec) -> dict[str, object]:
        times = self.time(mesh, hw)
        return {
            "unit": self.unit,
            "bytes": {k: int(v) for k, v in self.bytes.items()},
            "bytes_total": int(sum(self.bytes.values())),
            "time_s": {k: round(v, 9) for k, v in times.items()},
            "time_total_s": round(sum(times.values()), 9),
            "intra_node": {
                a: axis_is_intra_node(mesh, a, hw.gpus_per_node)
                for a in ("tp", "ep", "dp", "pp")
                if getattr(mesh, a) > 1
            },
        }


def inference_comm(
    mesh: Mesh,
    *,
    stage: int,
    layers: int,
    batch: int,
    hidden: int,
    vocab_rows: int,
    act_bytes: int = 2,
) -> CommTally:
    """Bytes one rank of ``stage`` sends per generated token (a decode step of ``batch``)."""
    t, tally = mesh.tp, CommTally("token")
    m = batch * hidden * act_bytes
    tally.add("tp", all_reduce(t, m) * 2 * layers, 2 * layers)
    if stage == 0:
        tally.add("tp", all_reduce(t, m), 1)  # vocab-parallel embedding
    if stage == mesh.pp - 1:
        tally.add("tp", gather(t, 4 * batch * vocab_rows * t), 1)  # fp32 logits
    if mesh.pp > 1 and stage < mesh.pp - 1:
        tally.add("pp", m, 1)
    return tally


def training_comm(
    mesh: Mesh,
    *,
    stage: int,
    layers: int,
    moe_layers: int,
    micro_batch: int,
    seq: int,
    microbatches: int,
    hidden: int,
    top_k: int,
    params_dense: int,
    params_expert: int,
    grad_bytes: float,
    weight_bytes: float,
    zero: int,
    sequence_parallel: bool,
    recompute: str,
    act_bytes: int = 2,
    capacity_factor: float = 1.0,
) -> CommTally:
    """Bytes one rank of ``stage`` sends per optimizer step."""
    t, mb, tally = mesh.tp, microbatches, CommTally("step")
    m = micro_batch * seq * hidden * act_bytes
    per_layer = 4 + (2 if recompute == "full" else 0)
    key = "sp" if sequence_parallel else "tp"
    ops = per_layer * layers * mb
    if sequence_parallel:
        tally.add(key, 2 * gather(t, m) * ops, 2 * ops)  # AG + RS per former all-reduce
    else:
        tally.add(key, all_reduce(t, m) * ops, ops)
    if mesh.pp > 1:
        sends = (stage < mesh.pp - 1) + (stage > 0)
        tally.add("pp", sends * mb * m / (t if sequence_parallel else 1), sends * mb)
    if mesh.ep > 1 and moe_layers:
        routed = micro_batch * seq * top_k * capacity_factor * hidden * act_bytes
        tally.add("ep", 4 * moe_layers * mb * gather(mesh.ep, routed), 4 * moe_layers * mb)
    for n, p in ((mesh.dp * mesh.ep, params_dense), (mesh.dp, params_expert)):
        if n <= 1 or p <= 0:
            continue
        if zero <= 1:
            tally.add("dp", all_reduce(n, p * grad_bytes), 1)
        elif zero == 2:
            tally.add("dp", mb * gather(n, p * grad_bytes) + gather(n, p * weight_bytes), mb + 1)
        else:
            tally.add(
                "dp", mb * (2 * gather(n, p * weight_bytes) + gather(n, p * grad_bytes)), 3 * mb
            )
    return tally
