"""GPU and interconnect presets, and the hardware a plan runs on.

One table (:data:`GPUS`) and one lookup (:func:`gpu_preset`) for the whole tool: the
manifest's ``hardware.gpu`` and :meth:`HardwareSpec.preset` both read it. Capacities are the
data sheets' HBM capacity in GiB (an "80 GB" H100 is five 16 GiB HBM3 stacks); B200 is
180 GiB (DGX B200: 1,440 GB for 8 GPUs). Bandwidths are per GPU and per
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

MiB = 1 << 20
GiB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GpuPreset:
    """One GPU from its data sheet; bandwidths are per GPU, per direction, in bytes/s."""

    name: str
    memory: int  # bytes: the data sheet's HBM/GDDR capacity
    intra_node_bandwidth: float  # NVLink / fabric / PCIe
    inter_node_bandwidth: float  # the usual one NIC per GPU
    source: str
    intra_node_latency: float = 5e-6  # seconds per collective step (NCCL small-message latency)
    # The size CUDA reports (``torch.cuda.mem_get_info()[1]``, vLLM's ``total_gpu_memory``),
    # where a published log gives it; the vLLM profile budgets from this, not the data sheet.
    cuda_memory: int | None = None
    # GPUs of a node all-to-all through a switch fabric (NVSwitch on SXM parts, Infinity Fabric
    # on MI300X), where NCCL opens many channels: the engines' per-rank communicator buffers
    # (vLLM ``TP_GROUP_BYTES``, SGLang ``INIT_DISTRIBUTED``) are the large ones measured there.
    switched: bool = False


@dataclass(frozen=True)
class LinkPreset:
    name: str
    bandwidth: float  # bytes/s per GPU per direction
    latency: float = 10e-6


# The one GPU table of the tool (``hardware.gpu`` in a manifest, HardwareSpec.preset, search).
# ``memory`` is the HBM/GDDR capacity the data sheet states (``80GB`` on an H100 is 80 GiB of
# HBM3: five 16 GiB stacks); the CUDA context, NCCL buffers and fragmentation are the memory
# model's ``overhead`` terms, not subtracted here. NVLink figures are the data sheet's
# bidirectional total halved; inter-node assumes ConnectX-7 400 Gb/s on H100/H200/MI300X
# nodes, HDR 200 Gb/s on A100.
GPUS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset(
            "h100-sxm",
            80 * GiB,
            450 * GB,
            50 * GB,
            "H100 SXM5: 80 GB HBM3; NVLink 4 900 GB/s bidirectional; CX-7 400 Gb/s",
            # vLLM PR #10511 and #12126 logs: "total_gpu_memory 79.22GiB", "can use 71.29GiB"
            # at 0.9, so the size is in [79.215, 79.2166] GiB
            cuda_memory=round(79.216 * GiB),
            switched=True,
        ),
        GpuPreset(
            "h200",
            141 * GiB,
            450 * GB,
            50 * GB,
            "H200 SXM: 141 GB HBM3e; NVLink 4 900 GB/s bidirectional; CX-7 400 Gb/s",
            switched=True,
        ),
        GpuPreset(
            "a100-80gb",
            80 * GiB,
            300 * GB,
            25 * GB,
            "A100 SXM4 80GB: HBM2e; NVLink 3 600 GB/s bidirectional; HDR 200 Gb/s",
            # "79.25 GiB total capacity" in a PyTorch OOM message on an A100 (a weak source:
            # levihsu/OOTDiffusion issue #235)
            cuda_memory=round(79.25 * GiB),
            switched=True,
        ),
        GpuPreset(
            "a100-40gb",
            40 * GiB,
            300 * GB,
            25 * GB,
            "A100 SXM4 40GB: HBM2; NVLink 3 600 GB/s bidirectional; HDR 200 Gb/s",
            switched=True,
        ),
        GpuPreset(
            "l40s",
            48 * GiB,
            32 * GB,
            25 * GB,
            "L40S: 48 GB GDDR6 (ECC on leaves ~44.5 GiB); no NVLink, PCIe 4.0 x16 "
            "~32 GB/s; 200 Gb/s NIC",
        ),
        GpuPreset(
            "h100-pcie",
            80 * GiB,
            64 * GB,
            50 * GB,
            "H100 PCIe: 80 GB HBM2e; PCIe Gen5 x16 ~64 GB/s per direction (NVLink bridge "
            "optional); 400 Gb/s NIC",
        ),
        GpuPreset(
            "b200",
            180 * GiB,
            900 * GB,
            50 * GB,
            "B200: 180 GB HBM3e; NVLink 5 1.8 TB/s bidirectional; CX-7 400 Gb/s",
            switched=True,
        ),
        GpuPreset(
            "mi300x",
            192 * GiB,
            448 * GB,
            50 * GB,
            "MI300X: 192 GB HBM3; Infinity Fabric 896 GB/s bidirectional peer "
            "aggregate; 400 Gb/s NIC",
            switched=True,
        ),
    )
}

# Names people write for the same part.
GPU_ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "mi300": "mi300x",
}


def gpu_names() -> tuple[str, ...]:
    """Every name :func:`gpu_preset` accepts: presets, then aliases."""
    return (*GPUS, *GPU_ALIASES)


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
    """The cluster: per-device memory, GPUs per node, nodes, and link speeds (bytes/s per
    GPU per direction). The manifest's ``hardware:`` section builds exactly this.

    ``HardwareSpec.preset("h100-sxm", nodes=2)`` is two DGX-H100-like nodes with IB NDR.
    ``device_memory`` ``None`` means "unknown": nothing is said about fit.
    """

    device_memory: int | None = None
    gpus_per_node: int = 8
    nodes: int = 1
    intra_node_bandwidth: float = 450 * GB
    inter_node_bandwidth: float = 50 * GB
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    efficiency: float = 0.8
    gpu: str | None = None
    link: str | None = None
    allow_tp_across_nodes: bool = False

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise InvalidInputError(
                    f"expected a positive integer, got {getattr(self, name)}",
                    where=f"hardware.{name}",
                )
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
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
            intra_node_bandwidth=g.intra_node_bandwidth,
            inter_node_bandwidth=lk.bandwidth,
            intra_node_latency=g.intra_node_latency,
            inter_node_latency=lk.latency,
            gpu=g.name,
            link=lk.name,
        )


def switched(gpu: str | None) -> bool:
    """Whether the preset ``gpu`` (a :data:`GPUS` name) sits on a switch fabric; False for
    any other part and for no preset."""
    preset = GPUS.get(gpu or "")
    return preset is not None and preset.switched


def gpu_preset(name: str) -> GpuPreset:
    """The one lookup: ``"H100"`` → the ``h100-sxm`` preset; an unknown name raises, naming
    every known one."""
    key = name.strip().lower().replace("_", "-")
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise InvalidInputError(
            f"unknown GPU preset {name!r}",
            where="hardware.gpu",
            hint=f"use one of: {', '.join(gpu_names())}; or give hardware.device_memory",
        )
    return GPUS[key]


def link_preset(name: str) -> LinkPreset:
    key = name.strip().lower().replace("_", "-")
    if key not in LINKS:
        raise InvalidInputError(
            f"unknown link preset {name!r}",
            where="hardware.link",
            hint=f"use one of: {', '.join(LINKS)}, or give inter_node_bandwidth",
        )
    return LINKS[key]
