"""Device memory from CUDA: cudaMalloc and legacy IPC handles (`CudaAllocator`), or the virtual memory API with
file descriptors clients map read-only (`CudaVmmAllocator`)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections import defaultdict

from ...cuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                     CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, DeviceError, vmm_token)
from .devices import GpuDevice
from .memory import (CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY, CUDA_ERROR_MEMORY_ALLOCATION, CUDA_HOST_REGISTER_READ_ONLY,
                     Allocation, DeviceMemoryError, _check_range, mmap_read_only, munmap, _pread_into)

log = logging.getLogger("modelcache.gpu")


class CudaAllocator:
    """Device memory from cudaMalloc (cupy's runtime API, not its memory pool, which would hide frees).

    Host → device copies run at pinned speed: each host segment's needed span is mapped
    read-only and registered with cudaHostRegister (ReadOnly), then copied with
    cudaMemcpyAsync on a stream of this call's own. Where the driver refuses to register
    such a mapping, copies go through a ring of pinned staging buffers instead: the CPU
    reads into one buffer while the DMA engine empties another.
    """

    kind = "cuda"
    sharing = "ipc"
    STAGING_BUFFERS = 4
    STAGING_BYTES = 64 << 20

    def __init__(self, device: GpuDevice, runtime=None):
        if runtime is None:
            from cupy.cuda import runtime  # the [gpu] extra
        self.device = device
        self._rt = runtime
        self._register_read_only: bool | None = None   # None until asked of the device
        self._staging: list | None = None              # [(pinned ptr, event)], made on first need
        self._staging_lock = threading.Lock()          # one copy at a time may use the ring
        self.sharing_note = ""                         # why VMM sharing was asked for and refused (allocator_for)

    def rounded(self, nbytes: int) -> int:
        return nbytes

    def _use_device(self) -> None:
        # The current device is per thread: every thread that calls CUDA sets it first.
        self._rt.setDevice(self.device.index)

    def alloc(self, nbytes: int) -> Allocation:
        self._use_device()
        try:
            ptr = self._rt.malloc(nbytes)
        except self._rt.CUDARuntimeError as e:
            if getattr(e, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION:
                raise DeviceMemoryError(f"device {self.device.uuid}: cudaMalloc of {nbytes >> 20} MiB failed: {e}") from e
            raise
        try:
            handle = bytes(self._rt.ipcGetMemHandle(ptr))
        except BaseException:
            self._rt.free(ptr)
            raise
        return Allocation(ptr, nbytes, handle)

    def free(self, allocation: Allocation) -> None:
        """Give the allocation back. A CUDA error here (a sticky one, left by a serve-mode kernel in this
        process) is logged, not raised: the memory is lost either way, and the caller's bookkeeping,
        half done, must not be left so."""
        try:
            self._use_device()
            self._rt.free(allocation.ptr)
        except Exception as e:   # cupy's CUDARuntimeError
            log.error("device %s: cudaFree of %d MiB failed, the memory is lost until the daemon restarts: %s",
                      self.device.uuid, allocation.nbytes >> 20, e)

    def local_address(self, allocation: Allocation) -> int:
        """The device pointer, valid in this process (the runtime API's primary context, which ORT's CUDA
        provider shares): the daemon's own GPU workers use it directly; IPC is for other processes."""
        return allocation.ptr

    def mem_info(self) -> tuple[int, int]:
        self._use_device()
        free, total = self._rt.memGetInfo()
        return int(free), int(total)

    def copy_out(self, allocation: Allocation, offset: int, nbytes: int) -> bytes:
        """Read device bytes back (checks and tests; pageable, synchronous)."""
        _check_range(allocation, offset, nbytes)
        self._use_device()
        out = bytearray(nbytes)
        if nbytes:
            buf = (ctypes.c_char * nbytes).from_buffer(out)
            self._rt.memcpy(ctypes.addressof(buf), allocation.ptr + offset, nbytes, self._rt.memcpyDeviceToHost)
            del buf
        return bytes(out)

    def copy_in(self, allocation: Allocation, copies: list, host_files: list[str]) -> tuple[int, float]:
        t0 = time.perf_counter()
        self._use_device()
        by_file: dict[int, list] = defaultdict(list)
        for index, src_off, dst_off, nbytes in copies:
            _check_range(allocation, dst_off, nbytes)
            by_file[index].append((src_off, dst_off, nbytes))
        stream = self._rt.streamCreateWithFlags(self._rt.streamNonBlocking)
        registered = []                                  # (address, length, file offset) mapped and pinned
        try:
            for index, ranges in by_file.items():
                mapping = self._map_and_register(host_files[index], ranges)
                if mapping is None:
                    self._copy_via_staging(stream, allocation, host_files[index], ranges)
                    continue
                registered.append(mapping)
                addr, _, start = mapping
                for src_off, dst_off, nbytes in ranges:
                    self._rt.memcpyAsync(allocation.ptr + dst_off, addr + src_off - start, nbytes,
                                         self._rt.memcpyHostToDevice, stream)
        finally:
            # The DMA engine may still read the mappings (also when an error cut the loop
            # short): wait for it before unpinning and unmapping them.
            try:
                self._rt.streamSynchronize(stream)
            finally:
                for addr, length, _ in registered:
                    self._rt.hostUnregister(addr)
                    munmap(addr, length)
                self._rt.streamDestroy(stream)
        return sum(n for *_, n in copies), time.perf_counter() - t0

    def _map_and_register(self, path: str, ranges: list):
        """(address, length, file offset) of the pinned read-only span of `path` that `ranges` need, or None."""
        if self._register_read_only is None:
            try:
                self._register_read_only = bool(self._rt.deviceGetAttribute(
                    CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY, self.device.index))
            except self._rt.CUDARuntimeError:
                self._register_read_only = True           # unknown: try, and fall back if refused
            if not self._register_read_only:
                log.info("device %s cannot pin read-only host memory: copying through pinned staging buffers",
                         self.device.uuid)
        if not self._register_read_only:
            return None
        start = min(r[0] for r in ranges) // mmap.PAGESIZE * mmap.PAGESIZE
        end = max(r[0] + r[2] for r in ranges)
        length = -(-(end - start) // mmap.PAGESIZE) * mmap.PAGESIZE   # the last page is the file's own
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = mmap_read_only(fd, length, start)
        finally:
            os.close(fd)                                  # the mapping keeps the file alive
        try:
            self._rt.hostRegister(addr, length, CUDA_HOST_REGISTER_READ_ONLY)
        except self._rt.CUDARuntimeError as e:
            munmap(addr, length)
            # Unmeasured on a /dev/shm mapping (GPU.md): remember a refusal, ask once.
            self._register_read_only = False
            log.warning("cudaHostRegister(ReadOnly) of a host-tier mapping refused on %s (%s): "
                        "copying through pinned staging buffers from now on", self.device.uuid, e)
            return None
        return addr, length, start

    def _copy_via_staging(self, stream: int, allocation: Allocation, path: str, ranges: list) -> None:
        with self._staging_lock:
            ring = self._staging_ring()
            fd = os.open(path, os.O_RDONLY)
            try:
                n = 0
                for src_off, dst_off, nbytes in ranges:
                    done = 0
                    while done < nbytes:
                        ptr, event = ring[n % len(ring)]
                        if n >= len(ring):
                            self._rt.eventSynchronize(event)   # this buffer's last copy out has finished
                        chunk = min(self.STAGING_BYTES, nbytes - done)
                        _pread_into(fd, ptr, chunk, src_off + done)
                        self._rt.memcpyAsync(allocation.ptr + dst_off + done, ptr, chunk,
                                             self._rt.memcpyHostToDevice, stream)
                        self._rt.eventRecord(event, stream)
                        done += chunk
                        n += 1
            finally:
                os.close(fd)
                self._rt.streamSynchronize(stream)         # the next user of the ring must find it idle

    def _staging_ring(self) -> list:
        if self._staging is None:
            ring = []
            try:
                for _ in range(self.STAGING_BUFFERS):
                    ptr = self._rt.hostAlloc(self.STAGING_BYTES, self._rt.hostAllocDefault)
                    event = self._rt.eventCreateWithFlags(self._rt.eventDisableTiming)
                    ring.append((ptr, event))
            except BaseException:
                self._free_ring(ring)
                raise
            self._staging = ring
        return self._staging

    def _free_ring(self, ring: list) -> None:
        for ptr, event in ring:
            self._rt.eventDestroy(event)
            self._rt.freeHost(ptr)

    def close(self) -> None:
        with self._staging_lock:
            if self._staging is not None:
                self._use_device()
                self._free_ring(self._staging)
                self._staging = None


class CudaVmmAllocator(CudaAllocator):
    """Device memory from CUDA's virtual memory API, shared read-only: gpu_sharing = "vmm-read-only".

    alloc: cuMemCreate (a POSIX-fd exportable allocation, its size rounded up to the device's granularity)
    -> mapped read-write at addresses of the daemon's own (cuMemAddressReserve, cuMemMap, cuMemSetAccess)
    -> cuMemExportToShareableHandle: one descriptor, kept until free and sent to each client, who maps
    it read-only. Copies in and out run through the daemon's mapping with the runtime's calls, as
    CudaAllocator's do. free: close the descriptor, unmap, cuMemRelease: the memory returns once every
    client's mapping is gone too. Construction asks the device (both attributes) and exports one granule:
    a driver that refuses raises DeviceError here, at start, and `allocator_for` falls back to IPC.
    """

    kind = "cuda-vmm"
    sharing = "vmm-read-only"

    def __init__(self, device: GpuDevice, runtime=None, driver=None):
        super().__init__(device, runtime)
        if driver is None:
            from ..cuda import cuda_driver
            driver = cuda_driver()
        self._drv = driver
        for attribute, what in ((CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
                                (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                 "POSIX file descriptor handles")):
            if not driver.attribute(attribute, device.index):
                raise DeviceError(f"GPU {device.index} ({device.uuid}) does not support {what} "
                                  f"(cuDeviceGetAttribute({attribute}) = 0)")
        self.granularity = driver.granularity(device.index)
        self._nonce = os.urandom(16)
        self._lock = threading.Lock()
        self._next = 1
        self._handles: dict[int, int] = {}   # daemon address -> the allocation's handle (cuMemRelease at free)
        handle = driver.create(self.granularity, device.index)   # the probe: can this driver export at all?
        try:
            os.close(driver.export_fd(handle))
        finally:
            driver.release(handle)

    def rounded(self, nbytes: int) -> int:
        return -(-max(nbytes, 1) // self.granularity) * self.granularity

    def alloc(self, nbytes: int) -> Allocation:
        nbytes = self.rounded(nbytes)
        drv, index = self._drv, self.device.index
        self._use_device()       # the runtime's context: copy_in follows on this thread
        try:
            handle = drv.create(nbytes, index)
        except DeviceError as e:
            if getattr(e, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION:
                raise DeviceMemoryError(f"device {self.device.uuid}: cuMemCreate of {nbytes >> 20} MiB failed: "
                                        f"{e}") from e
            raise
        try:
            va = drv.map(handle, nbytes, index, read_only=False)
            try:
                fd = drv.export_fd(handle)
            except BaseException:
                drv.unmap(va, nbytes)
                raise
        except BaseException:
            drv.release(handle)
            raise
        with self._lock:
            number, self._next = self._next, self._next + 1
            self._handles[va] = handle
        return Allocation(va, nbytes, vmm_token(self._nonce, number, nbytes), fd)

    def free(self, allocation: Allocation) -> None:
        """Close the exported descriptor, unmap and release. Errors are logged, not raised (see CudaAllocator.free)."""
        with self._lock:
            handle = self._handles.pop(allocation.ptr, None)
        try:
            os.close(allocation.fd)
        except OSError as e:
            log.error("device %s: closing an exported allocation's descriptor failed: %s", self.device.uuid, e)
        try:
            self._drv.unmap(allocation.ptr, allocation.nbytes)
            if handle is not None:
                self._drv.release(handle)
        except Exception as e:   # DeviceError
            log.error("device %s: freeing %d MiB of VMM memory failed, it is lost until the daemon restarts: %s",
                      self.device.uuid, allocation.nbytes >> 20, e)
