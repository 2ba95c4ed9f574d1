"""GPU and interconnect presets, and the hardware a plan runs on.

Capacities are the data sheets' HBM capacity in GiB (an "80 GB" H100 is five 16 GiB HBM3
stacks), as :mod:`shardctl.manifest.presets` states them; B200 is 180 GiB (DGX B200: 1,440 GB
for 8 GPUs). Bandwidths are per GPU and per
direction, from the vendors' data sheets:

- NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional → 450 GB/s per direction
  (NVIDIA H100 Tensor Core GPU data sheet, 2023).
- NVLink 3 (A100 SXM): 600 GB/s bidirectional → 300 GB/s (NVIDIA A100 data sheet, 2021).
- NVLink 5 (B200): 1.8 TB/s bidirectional → 900 GB/s (NVIDIA Blackwell data sheet, 2024).
- L40S has no NVLink: PCIe Gen4 x16, 32 GB/s per direction (NVIDIA L40S data sheet).
- MI300X: 7 Infinity Fabric links × 64 GB/s = 448 GB/s per direction (AMD CDNA 3 white paper).
- InfiniBand NDR 400 Gb/s per GPU = 50 GB/s per direction (one ConnectX-7 per GPU, as in DGX H100).

``efficiency`` scales link bandwidth to what NCCL achieves as bus bandwidth (nccl-tests
``busbw``: about 360 of 450 GB/s on 8×H100 all-reduce, i.e. ~0.8).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.errors import InvalidInputError
from shardctl.manifest.presets import GPU_ALIASES
from shardctl.manifest.presets import GPU_PRESETS as _MANIFEST_GPUS

MiB = 1 << 20
GiB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory: int  # bytes, as the driver reports the device's total
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink / fabric / PCIe)
    intra_node_latency: float = 5e-6  # seconds per collective step (NCCL small-message latency)


@dataclass(frozen=True)
class LinkPreset:
    name: str
    bandwidth: float  # bytes/s per GPU per direction
    latency: float = 10e-6


# One table of GPUs for the whole tool: the manifest's presets (data-sheet sources there).
GPUS: dict[str, GpuPreset] = {
    name: GpuPreset(name, p.device_memory, float(p.intra_node_bandwidth))
    for name, p in _MANIFEST_GPUS.items()
}

LINKS: dict[str, LinkPreset] = {
    p.name: p
    for p in (
        LinkPreset("ib-hdr-200", 25 * GB),
        LinkPreset("ib-ndr-400", 50 * GB),
        LinkPreset("ib-xdr-800", 100 * GB),
        LinkPreset("roce-400", 50 * GB, latency=15e-6),
        LinkPreset("ethernet-100", 12.5 * GB, latency=30e-6),
    )
}


@dataclass(frozen=True)
class HardwareSpec:
    """The cluster: per-device memory, GPUs per node, nodes, and link speeds.

    ``HardwareSpec.preset("h100-sxm", nodes=2)`` is two DGX-H100-like nodes with IB NDR.
    ``device_memory`` ``None`` means "unknown": nothing is said about fit.
    """

    device_memory: int | None = None
    gpus_per_node: int = 8
    nodes: int = 1
    intra_node_bw: float = 450 * GB
    inter_node_bw: float = 50 * GB
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    efficiency: float = 0.8
    gpu: str | None = None
    link: str | None = None

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise InvalidInputError(
                    f"expected a positive integer, got {getattr(self, name)}",
                    where=f"hardware.{name}",
                )
        for name in ("intra_node_bw", "inter_node_bw"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(
                    f"expected a positive bandwidth, got {getattr(self, name)}",
                    where=f"hardware.{name}",
                )
        if not 0 < self.efficiency <= 1:
            raise InvalidInputError(
                f"expected 0 < efficiency <= 1, got {self.efficiency}",
                where="hardware.efficiency",
            )

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def preset(
        cls,
        gpu: str,
        *,
        link: str = "ib-ndr-400",
        gpus_per_node: int = 8,
        nodes: int = 1,
        device_memory: int | None = None,
    ) -> HardwareSpec:
        g = gpu_preset(gpu)
        lk = link_preset(link)
        return cls(
            device_memory=device_memory if device_memory is not None else g.memory,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            intra_node_bw=g.intra_node_bw,
            inter_node_bw=lk.bandwidth,
            intra_node_latency=g.intra_node_latency,
            inter_node_latency=lk.latency,
            gpu=g.name,
            link=lk.name,
        )


def gpu_preset(name: str) -> GpuPreset:
    key = name.strip().lower().replace("_", "-")
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise InvalidInputError(
            f"unknown GPU preset {name!r}",
            where="hardware.gpu",
            hint=f"use one of: {', '.join(GPUS)}, or give device_memory and bandwidths",
        )
    return GPUS[key]


def link_preset(name: str) -> LinkPreset:
    key = name.strip().lower().replace("_", "-")
    if key not in LINKS:
        raise InvalidInputError(
            f"unknown link preset {name!r}",
            where="hardware.link",
            hint=f"use one of: {', '.join(LINKS)}, or give inter_node_bw",
        )
    return LINKS[key]
