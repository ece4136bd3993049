"""The allocator each device gets: files or memfds for a simulated device, CUDA for a real one."""

from __future__ import annotations

import logging
from pathlib import Path

from ...cuda import DeviceError
from .cuda_memory import CudaAllocator, CudaVmmAllocator
from .devices import GpuDevice
from .fake import FakeAllocator, FakeVmmAllocator
from .memory import SHARING_MODES, DeviceAllocator

log = logging.getLogger("modelcache.gpu")


def allocator_for(device: GpuDevice, fake_dir: str | Path, sharing: str = "ipc", runtime=None,
                  driver=None) -> DeviceAllocator:
    """The allocator a device needs: files under `fake_dir` (a memfd each, with "vmm-read-only") for a `fake_devices`
    one, CUDA otherwise. Where the driver refuses "vmm-read-only", legacy CUDA IPC, with a warning and the reason
    in `sharing_note` (status shows it)."""
    if sharing not in SHARING_MODES:
        raise ValueError(f"gpu_sharing must be one of {', '.join(SHARING_MODES)}, not {sharing!r}")
    if device.uuid.startswith("fake-"):
        return FakeVmmAllocator(device) if sharing == "vmm-read-only" else FakeAllocator(device, fake_dir)
    if sharing == "vmm-read-only":
        try:
            return CudaVmmAllocator(device, runtime, driver)
        except DeviceError as e:
            allocator = CudaAllocator(device, runtime)
            allocator.sharing_note = f"vmm-read-only refused by the driver: {e}"
            log.warning("GPU %d (%s): gpu_sharing = vmm-read-only refused by the driver, so clients map its "
                        "weights read-write by legacy CUDA IPC: %s", device.index, device.uuid, e)
            return allocator
    return CudaAllocator(device, runtime)
