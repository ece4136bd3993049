"""Host -> GPU promotion from a read-only /dev/shm mapping, pinned in place, against pageable and pinned copies.

    python3 benchmarks/gpu/check_pinned.py --out DIR     (checks.py runs it; the contract is there)

The GPU tier promotes a model by mapping the host tier's /dev/shm segment read-only and registering the
mapping with cudaHostRegister(ReadOnly), then copying at pinned speed (modelcache/tiers/gpu/cuda_memory.py,
CudaAllocator.copy_in); where the driver refuses the registration it copies through a ring of pinned
staging buffers. Neither path has run on a GPU. Here, over one 512 MiB /dev/shm file: the tier's own
copy_in (bytes checked), the registration alone, a pageable copy from the same mapping, a copy from
cudaHostAlloc memory (the pinned bandwidth of this run), and the staging ring. Each figure the median of
RUNS; GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

LIMIT_S = 45
SIZE = 512 << 20
RUNS = 5


def gb_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2)


def median_time(fn, runs: int = RUNS) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check(r) -> None:
    from checks import CannotRun
    from modelcache.tiers import gpu
    devices = gpu.probe()
    if not devices:
        raise CannotRun("cupy sees no CUDA device (or cannot be imported)")
    from cupy.cuda import runtime
    device = devices[0]
    runtime.setDevice(device.index)
    r.set("device", f"{device.name} ({device.uuid})")
    try:
        supported = bool(runtime.deviceGetAttribute(gpu.CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY, device.index))
    except runtime.CUDARuntimeError as e:
        supported = f"unknown: {e}"
    r.set("read_only_register_supported", supported)

    path = Path(f"/dev/shm/modelcache-check-pinned-{os.getpid()}")
    block = os.urandom(1 << 20)
    allocator = gpu.CudaAllocator(device)
    staging = gpu.CudaAllocator(device)
    allocation = pinned = None
    try:
        with open(path, "wb") as f:
            for _ in range(SIZE >> 20):
                f.write(block)
        os.chmod(path, 0o440)       # as the host tier leaves its segments: read-only
        want = hashlib.sha256(block * (SIZE >> 20)).hexdigest()
        allocation = allocator.alloc(SIZE)
        r.set("bytes", SIZE)

        # The tier's own promotion path: map read-only, register, copy, unregister, unmap.
        copy_in = median_time(lambda: allocator.copy_in(allocation, [(0, 0, 0, SIZE)], [str(path)]))
        registered = allocator._register_read_only is not False
        r.set("copy_in_path", "registered read-only mapping" if registered else "pinned staging ring (registration "
                                                                                 "refused)")
        r.set("copy_in_gb_s", gb_s(SIZE, copy_in))
        same = hashlib.sha256(allocator.copy_out(allocation, 0, SIZE)).hexdigest() == want
        r.set("bytes_identical", same)
        r.require(same, "the bytes copy_in put on the device differ from the /dev/shm file's")

        fd = os.open(path, os.O_RDONLY)
        try:
            addr = gpu.mmap_read_only(fd, SIZE, 0)
        finally:
            os.close(fd)
        try:
            # pageable: the same read-only mapping, not registered
            r.set("pageable_gb_s", gb_s(SIZE, median_time(lambda: runtime.memcpy(
                allocation.ptr, addr, SIZE, runtime.memcpyHostToDevice))))
            regs, copies = [], []
            for _ in range(3):
                t = time.perf_counter()
                try:
                    runtime.hostRegister(addr, SIZE, gpu.CUDA_HOST_REGISTER_READ_ONLY)
                except runtime.CUDARuntimeError as e:
                    r.set("register_error", str(e))
                    break
                regs.append(time.perf_counter() - t)
                copies.append(median_time(lambda: runtime.memcpy(allocation.ptr, addr, SIZE,
                                                                 runtime.memcpyHostToDevice), 3))
                runtime.hostUnregister(addr)
            if regs:
                r.set("register_ms", round(statistics.median(regs) * 1e3, 2))
                r.set("registered_memcpy_gb_s", gb_s(SIZE, statistics.median(copies)))
            r.set("read_only_register_accepted", bool(regs))
        finally:
            gpu.munmap(addr, SIZE)

        # pinned: cudaHostAlloc memory, the bandwidth a promotion is held to (issue #36: >= 0.8x of it)
        t = time.perf_counter()
        pinned = runtime.hostAlloc(SIZE, runtime.hostAllocDefault)
        r.set("host_alloc_ms", round((time.perf_counter() - t) * 1e3, 1))
        pinned_s = median_time(lambda: runtime.memcpy(allocation.ptr, pinned, SIZE, runtime.memcpyHostToDevice))
        r.set("pinned_gb_s", gb_s(SIZE, pinned_s))
        r.set("copy_in_vs_pinned", round(pinned_s / copy_in, 3))

        # the fallback: the staging ring, as where the driver refuses the registration
        staging._register_read_only = False
        r.set("staging_gb_s", gb_s(SIZE, median_time(lambda: staging.copy_in(
            allocation, [(0, 0, 0, SIZE)], [str(path)]), 3)))
    finally:
        if pinned is not None:
            runtime.freeHost(pinned)
        if allocation is not None:
            allocator.free(allocation)
        allocator.close()
        staging.close()
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checks import main_for
    sys.exit(main_for("pinned", check))
