"""Per-process GPU memory through NVML (``nvidia-ml-py``, imported only here and only when asked).

NVML reports, per device, the compute processes and the bytes each holds
(``nvmlDeviceGetComputeRunningProcesses``). A rank that touches several GPUs is the sum of its
entries; its device is the one where it holds the most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuMemory:
    used: int  # bytes held on all devices
    device: int  # index of the device holding most of them


class Nvml:
    """An initialised NVML; :meth:`open` returns ``None`` when there is no GPU or no NVML."""

    def __init__(self, lib: Any, handles: list[Any]) -> None:
        self._lib = lib
        self._handles = handles

    @classmethod
    def open(cls) -> Nvml | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            return None
        if count == 0:
            pynvml.nvmlShutdown()
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        return cls(pynvml, handles)

    def per_pid(self) -> dict[int, GpuMemory]:
        """GPU bytes per process id, over every device."""
        held: dict[int, dict[int, int]] = {}
        for index, handle in enumerate(self._handles):
            for proc in self._lib.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory or 0  # None when the driver hides it (MIG, rights)
                devices = held.setdefault(int(proc.pid), {})
                devices[index] = devices.get(index, 0) + int(used)
        return {
            pid: GpuMemory(used=sum(d.values()), device=max(d, key=lambda i: d[i]))
            for pid, d in held.items()
        }

    def close(self) -> None:
        self._lib.nvmlShutdown()
