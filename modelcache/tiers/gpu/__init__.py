"""The device tier: content-addressed model weights in GPU memory, promoted from the host tier and lent by IPC handle.

Layout: one allocation (one cudaMalloc) per promoted model, holding the tensors that no
resident model on this device has yet, at 256-byte-aligned offsets. A tensor already
on the device (same sha256, in any model) is reused, so a later model may span its own
allocation and those of earlier ones; an allocation lives while any resident model uses
it. Clients get each allocation's IPC handle plus (offset, dtype, shape) per tensor.

Freeing reclaims nothing while a client still maps the allocation (imported CUDA memory
outlives the exporter's cudaFree, GPU.md): the daemon frees only models no live lease
maps; this tier keeps the accounting that lets it choose.

The allocator is behind a small interface: `CudaAllocator` (cupy's runtime API) on a
GPU, `FakeAllocator` (one shared-memory file per allocation) everywhere else, so the
tier's logic runs the same calls in CI as on a device.

How clients share an allocation is the `gpu_sharing` setting. "ipc" (the default): legacy
CUDA IPC handles, which every client maps read-write. "vmm-read-only": `CudaVmmAllocator`
allocates with CUDA's virtual memory API (cuMemCreate), maps it writable in the daemon
alone, and exports a file descriptor that the client maps read-only (the fd travels over
the lane, SCM_RIGHTS); `FakeVmmAllocator` plays it with a sealed memfd. Where the driver
refuses VMM, `allocator_for` falls back to legacy IPC and says so (log, `status`).
Unverified on a GPU: off by default until a GPU run has checked it (benchmarks/gpu/check_vmm.py).

Threads: `plan`, `commit`, `abort`, `free_model`, `export` and `stop` run on the owner
loop and alone touch the tables; `write` runs on a loader thread and only allocates
and copies for one plan. Every CUDA call is preceded by `setDevice` in its own thread.

Devices are named by UUID on the wire, never by index (indices change with
CUDA_VISIBLE_DEVICES). Without cupy or a CUDA device, `probe()` returns [].

The package: `devices` (what devices there are), `memory` (the allocator interface and what allocators share),
`fake` and `cuda_memory` (the allocators), `allocators` (which one a device gets), `tier` (the DeviceTier,
its arenas the regions of a store shared with the host tier: tiers/regions.py).
"""

from .allocators import allocator_for
from .cuda_memory import CudaAllocator, CudaVmmAllocator
from .devices import GpuDevice, _runtime_uuid, device_uuid, fake_devices, probe
from .fake import FakeAllocator, FakeVmmAllocator
from .memory import (CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY, CUDA_ERROR_MEMORY_ALLOCATION, CUDA_HOST_REGISTER_READ_ONLY,
                     DEVICE_ALIGN, F_SEAL_FUTURE_WRITE, SHARING_MODES, Allocation, DeviceAllocator, DeviceMemoryError,
                     mmap_read_only, munmap)
from .tier import DevicePlan, DeviceTier, _coalesce

__all__ = ["Allocation", "CudaAllocator", "CudaVmmAllocator", "DeviceAllocator", "DeviceMemoryError",
           "DevicePlan", "DeviceTier", "FakeAllocator", "FakeVmmAllocator", "GpuDevice", "SHARING_MODES",
           "allocator_for", "device_uuid", "fake_devices", "probe", "DEVICE_ALIGN",
           "CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY", "CUDA_ERROR_MEMORY_ALLOCATION", "CUDA_HOST_REGISTER_READ_ONLY",
           "F_SEAL_FUTURE_WRITE", "_coalesce", "mmap_read_only", "munmap", "_runtime_uuid"]
