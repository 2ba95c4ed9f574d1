"""GPU presets for ``hardware.gpu``: memory capacity and link bandwidths, from vendor data sheets.

``device_memory`` is the HBM/GDDR capacity the data sheet states (``80GB`` on an H100 is 80 GiB
of HBM3: five 16 GiB stacks); the CUDA context, NCCL buffers and fragmentation are the memory
model's ``overhead`` terms, not subtracted here. Bandwidths are **per GPU, per direction**, in
bytes/s: NVLink figures are the data sheet's bidirectional total halved; inter-node assumes the
usual one NIC per GPU (ConnectX-7 400 Gb/s on H100/H200/MI300X nodes, HDR 200 Gb/s on A100).
Every value can be overridden in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
GB = 10**9


@dataclass(frozen=True)
class GpuPreset:
    name: str
    device_memory: int  # bytes
    intra_node_bandwidth: int  # bytes/s per direction
    inter_node_bandwidth: int  # bytes/s per direction
    source: str


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset(
            "h100-sxm",
            80 * GiB,
            450 * GB,
            50 * GB,
            "H100 SXM5: 80 GB HBM3; NVLink 4 900 GB/s bidirectional; CX-7 400 Gb/s",
        ),
        GpuPreset(
            "h200",
            141 * GiB,
            450 * GB,
            50 * GB,
            "H200 SXM: 141 GB HBM3e; NVLink 4 900 GB/s bidirectional; CX-7 400 Gb/s",
        ),
        GpuPreset(
            "a100-80gb",
            80 * GiB,
            300 * GB,
            25 * GB,
            "A100 SXM4 80GB: HBM2e; NVLink 3 600 GB/s bidirectional; HDR 200 Gb/s",
        ),
        GpuPreset(
            "a100-40gb",
            40 * GiB,
            300 * GB,
            25 * GB,
            "A100 SXM4 40GB: HBM2; NVLink 3 600 GB/s bidirectional; HDR 200 Gb/s",
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
        ),
        GpuPreset(
            "mi300x",
            192 * GiB,
            448 * GB,
            50 * GB,
            "MI300X: 192 GB HBM3; Infinity Fabric 896 GB/s bidirectional peer "
            "aggregate; 400 Gb/s NIC",
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
    return (*GPU_PRESETS, *GPU_ALIASES)


def gpu_preset(name: str) -> GpuPreset | None:
    key = name.strip().lower()
    return GPU_PRESETS.get(GPU_ALIASES.get(key, key))
