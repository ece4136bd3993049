"""The GPU tier: capacity bookkeeping and device discovery; the CUDA arena + IPC export is its own issue.

Devices are named by UUID on the wire, never by index (indices change with
CUDA_VISIBLE_DEVICES). Without cupy or a CUDA device, `probe()` returns [] and the
daemon answers GPU requests with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int


def probe() -> list[GpuDevice]:
    """CUDA devices visible to this process, or [] when cupy or a GPU is missing."""
    try:
        import cupy  # noqa: F401  (the [gpu] extra)
        from cupy.cuda import runtime
        count = runtime.getDeviceCount()
    except Exception:  # ImportError, CUDARuntimeError: no GPU tier here
        return []
    devices = []
    for i in range(count):
        props = runtime.getDeviceProperties(i)
        uuid = props.get("uuid", b"")
        uuid = uuid.hex() if isinstance(uuid, (bytes, bytearray)) else str(uuid)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        devices.append(GpuDevice(i, uuid, name, int(props["totalGlobalMem"])))
    return devices


class GpuTier:
    """Bookkeeping for one device; allocation and export arrive with the CUDA issue."""

    name = "gpu"

    def __init__(self, device: GpuDevice, capacity_bytes: int):
        self.device = device
        self.capacity_bytes = min(capacity_bytes, device.total_bytes)
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes
