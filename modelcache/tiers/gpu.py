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
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..config import GPU_SHARING, parse_fake_gpus
from ..cuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, VMM_KINDS, DeviceError, fake_uuid,
                    vmm_token)
from ..errors import CapacityError, ModelCacheError
from .files import copy_range

log = logging.getLogger("modelcache.gpu")

# cudaMalloc returns 256-byte-aligned memory; tensors at 256-byte offsets keep every
# tensor's pointer aligned the way CUDA kernels expect (GPU.md).
DEVICE_ALIGN = 256

# Values of the CUDA runtime that cupy does not name (cuda_runtime_api.h, driver_types.h).
CUDA_HOST_REGISTER_READ_ONLY = 0x08          # cudaHostRegisterReadOnly: pin a PROT_READ mapping
CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY = 113  # cudaDevAttrHostRegisterReadOnlySupported
CUDA_ERROR_MEMORY_ALLOCATION = 2             # cudaErrorMemoryAllocation (the driver's CUDA_ERROR_OUT_OF_MEMORY too)
SHARING_MODES = GPU_SHARING                  # the gpu_sharing setting's values
# fcntl(2): no new writable mapping of a sealed memfd, while the ones already made stay writable (Linux 5.1;
# Python's fcntl does not name it).
F_SEAL_FUTURE_WRITE = 0x0010


class DeviceMemoryError(CapacityError):
    """The device refused an allocation (other processes use its memory, or the tier's capacity is too high)."""


# -- devices --------------------------------------------------------------------------------

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
        uuid = device_uuid(i, props.get("uuid", b""), _runtime_uuid)
        if uuid is None:
            log.warning("CUDA device %d: its UUID could not be read whole; it gets no GPU tier", i)
            continue
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        devices.append(GpuDevice(i, uuid, name, int(props["totalGlobalMem"])))
    return devices


def device_uuid(index: int, cupy_uuid, read_whole) -> str | None:
    """Device `index`'s UUID as 32 hex digits, the client's name for it (cuda.normalize_uuid).

    cupy's getDeviceProperties()["uuid"] is a C char[16] that Cython turned into bytes as if it were
    a string: cut at its first zero byte (about one GPU in 16 has one; fbpic#718 saw 14 bytes). So the
    whole 16 bytes are read through the CUDA runtime as the client reads them (`read_whole(index)`);
    cupy's value serves only when that fails and it has all 16 bytes. None when neither does."""
    try:
        return read_whole(index)
    except Exception as e:   # DeviceError: no libcudart found in this process, a failed call
        log.debug("CUDA device %d: reading its UUID through the runtime failed: %s", index, e)
    if isinstance(cupy_uuid, (bytes, bytearray)) and len(cupy_uuid) == 16:
        return bytes(cupy_uuid).hex()
    return None


def _runtime_uuid(index: int) -> str:
    from ..cuda import cuda_runtime
    return cuda_runtime().uuid_of(index)


def fake_devices(spec: str) -> list[GpuDevice]:
    """The devices of the `fake_gpus` setting: "2x256M" = two devices of 256 MiB, "1G" = one, "" = none."""
    count, total = parse_fake_gpus(spec)
    return [GpuDevice(i, fake_uuid(i), "fake-gpu", total) for i in range(count)]


# -- allocators -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Allocation:
    ptr: int          # device address (CUDA), or a unique id (fake)
    nbytes: int
    handle: bytes     # what a client opens: the 64-byte cudaIpcMemHandle, or the fake's file path; for the
                      # fd-shared kinds (cuda.VMM_KINDS) a cuda.vmm_token that names the allocation
    fd: int = -1      # fd-shared kinds: the exported descriptor, the allocator's until free, sent to each client


class DeviceAllocator(Protocol):
    """Device memory for one device. `copies` are (host file index, host offset, device offset, nbytes).

    alloc, copy_in and copy_out run on loader threads, free on the owner loop; each
    call is complete on return (no work left in flight). `rounded(n)`: the bytes an
    allocation of n takes (VMM allocations come in multiples of the device's granularity).
    `sharing`: "ipc" or "vmm-read-only", as clients get it; `sharing_note`: why that differs
    from the setting ("" when it does not).
    """

    kind: str
    device: GpuDevice
    sharing: str
    sharing_note: str

    def rounded(self, nbytes: int) -> int: ...
    def alloc(self, nbytes: int) -> Allocation: ...
    def free(self, allocation: Allocation) -> None: ...
    def copy_in(self, allocation: Allocation, copies: list, host_files: list[str]) -> tuple[int, float]: ...
    def copy_out(self, allocation: Allocation, offset: int, nbytes: int) -> bytes: ...
    def mem_info(self) -> tuple[int, int]: ...
    def local_address(self, allocation: Allocation) -> int: ...
    def close(self) -> None: ...


class FakeAllocator:
    """Device memory played by files (on /dev/shm): the daemon's GPU logic without a GPU.

    Each allocation is `<directory>/gpu<index>-<id>.bin`, 0640; its handle is the file's
    absolute path, which a client maps read-only. Allocations beyond the device's total
    fail as cudaMalloc would.
    """

    kind = "fake"
    sharing = "ipc"
    sharing_note = ""

    def __init__(self, device: GpuDevice, directory: str | Path | None):
        self.device = device
        self.directory = Path(directory).absolute() if directory is not None else None
        if self.directory is not None:
            self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._lock = threading.Lock()      # alloc runs on loader threads, free on the owner loop
        self._next_id = 1
        self._allocated_bytes = 0
        self._local: dict[int, int] = {}    # allocation ptr -> address of this process's read-only mapping

    def rounded(self, nbytes: int) -> int:
        return nbytes

    def path(self, allocation: Allocation) -> Path:
        return Path(allocation.handle.decode())

    def _reserve(self, nbytes: int) -> int:
        """Count `nbytes` against the device, as cudaMalloc would refuse them; the new allocation's number."""
        with self._lock:
            if self._allocated_bytes + nbytes > self.device.total_bytes:
                raise DeviceMemoryError(f"fake device {self.device.uuid}: {nbytes >> 20} MiB asked, "
                                        f"{(self.device.total_bytes - self._allocated_bytes) >> 20} MiB free")
            ptr, self._next_id = self._next_id, self._next_id + 1
            self._allocated_bytes += nbytes
            return ptr

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._allocated_bytes -= nbytes

    def alloc(self, nbytes: int) -> Allocation:
        ptr = self._reserve(nbytes)
        path = self.directory / f"gpu{self.device.index}-{ptr}.bin"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
            try:
                os.fchmod(fd, 0o640)            # whatever the umask
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        except BaseException:
            path.unlink(missing_ok=True)
            self._unreserve(nbytes)
            raise
        return Allocation(ptr, nbytes, str(path).encode())

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            local = self._local.pop(allocation.ptr, None)
        if local is not None:
            _munmap(local, allocation.nbytes)
        self.path(allocation).unlink(missing_ok=True)
        self._unreserve(allocation.nbytes)

    def local_address(self, allocation: Allocation) -> int:
        """The allocation's bytes in this (the daemon's) process: a read-only mapping of its file, made once
        and unmapped by `free`, as a CUDA allocation's device pointer serves the daemon's own GPU workers."""
        with self._lock:
            addr = self._local.get(allocation.ptr)
            if addr is None:
                fd = os.open(self.path(allocation), os.O_RDONLY)
                try:
                    addr = self._local[allocation.ptr] = _mmap_read_only(fd, allocation.nbytes, 0)
                finally:
                    os.close(fd)
            return addr

    def copy_in(self, allocation: Allocation, copies: list, host_files: list[str]) -> tuple[int, float]:
        t0 = time.perf_counter()
        dst_fd = os.open(self.path(allocation), os.O_WRONLY)
        try:
            copied = _copy_from_host(allocation, copies, host_files, lambda src_fd, src_off, dst_off, nbytes:
                                     copy_range(src_fd, dst_fd, src_off, dst_off, nbytes))
        finally:
            os.close(dst_fd)
        return copied, time.perf_counter() - t0

    def copy_out(self, allocation: Allocation, offset: int, nbytes: int) -> bytes:
        _check_range(allocation, offset, nbytes)
        with open(self.path(allocation), "rb") as f:
            return os.pread(f.fileno(), nbytes, offset)

    def mem_info(self) -> tuple[int, int]:
        with self._lock:
            return self.device.total_bytes - self._allocated_bytes, self.device.total_bytes

    def close(self) -> None:
        try:
            self.directory.rmdir()              # only when every allocation was freed
        except OSError:
            pass


class FakeVmmAllocator(FakeAllocator):
    """`fake_gpus` under gpu_sharing = "vmm-read-only": the plumbing of CUDA's VMM sharing, for real, without a GPU.

    Each allocation is a memfd, as cuMemCreate's is physical memory with no name: the daemon maps it
    writable (its copies go through that mapping, as CudaVmmAllocator's through its read-write mapping),
    then seals it against any new writable mapping (F_SEAL_FUTURE_WRITE), and its descriptor is what
    clients get, over the lane (SCM_RIGHTS), to map read-only: a client's write faults. The memory goes
    once the daemon has closed the descriptor (free) and the last mapping of it, in any process, is gone.
    Unlike CUDA's, the seal also stops a client that maps the descriptor writable on purpose (CUDA lets
    an importer ask for read-write access: there read-only guards against mistakes, not against a client).
    """

    kind = "fake-vmm"
    sharing = "vmm-read-only"

    def __init__(self, device: GpuDevice):
        super().__init__(device, None)
        self._nonce = os.urandom(16)

    def rounded(self, nbytes: int) -> int:
        """Whole pages, as a mapping takes them (CUDA's granularity plays the same part)."""
        return -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE

    def alloc(self, nbytes: int) -> Allocation:
        nbytes = self.rounded(nbytes)
        number = self._reserve(nbytes)
        fd, addr = -1, None
        try:
            fd = os.memfd_create(f"modelcache-gpu{self.device.index}-{number}",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, nbytes)
            addr = _mmap(fd, nbytes, 0, mmap.PROT_READ | mmap.PROT_WRITE)   # the daemon's, the only writable one
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
                        | fcntl.F_SEAL_SEAL)
        except BaseException:
            if addr is not None:
                _munmap(addr, nbytes)
            if fd >= 0:
                os.close(fd)
            self._unreserve(nbytes)
            raise
        with self._lock:
            self._local[number] = addr
        return Allocation(number, nbytes, vmm_token(self._nonce, number, nbytes), fd)

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            addr = self._local.pop(allocation.ptr, None)
        if addr is not None:
            _munmap(addr, allocation.nbytes)
        os.close(allocation.fd)                 # clients' mappings keep the pages until they go
        self._unreserve(allocation.nbytes)

    def local_address(self, allocation: Allocation) -> int:
        """The daemon's writable mapping, made at alloc (its own GPU workers read it)."""
        with self._lock:
            return self._local[allocation.ptr]

    def copy_in(self, allocation: Allocation, copies: list, host_files: list[str]) -> tuple[int, float]:
        t0 = time.perf_counter()
        base = self.local_address(allocation)        # through the daemon's writable mapping
        copied = _copy_from_host(allocation, copies, host_files, lambda src_fd, src_off, dst_off, nbytes:
                                 _pread_into(src_fd, base + dst_off, nbytes, src_off))
        return copied, time.perf_counter() - t0

    def copy_out(self, allocation: Allocation, offset: int, nbytes: int) -> bytes:
        _check_range(allocation, offset, nbytes)
        return ctypes.string_at(self.local_address(allocation) + offset, nbytes)

    def close(self) -> None:
        pass


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
                    _munmap(addr, length)
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
            addr = _mmap_read_only(fd, length, start)
        finally:
            os.close(fd)                                  # the mapping keeps the file alive
        try:
            self._rt.hostRegister(addr, length, CUDA_HOST_REGISTER_READ_ONLY)
        except self._rt.CUDARuntimeError as e:
            _munmap(addr, length)
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


def _copy_from_host(allocation: Allocation, copies: list, host_files: list[str], copy) -> int:
    """Each of `copies` by copy(source fd, source offset, allocation offset, nbytes), every host segment opened
    once; the bytes copied."""
    src_fds: dict[int, int] = {}
    copied = 0
    try:
        for index, src_off, dst_off, nbytes in copies:
            _check_range(allocation, dst_off, nbytes)
            if index not in src_fds:
                src_fds[index] = os.open(host_files[index], os.O_RDONLY)
            copy(src_fds[index], src_off, dst_off, nbytes)
            copied += nbytes
    finally:
        for fd in src_fds.values():
            os.close(fd)
    return copied


def _check_range(allocation: Allocation, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > allocation.nbytes:
        raise ValueError(f"range [{offset}, {offset + nbytes}) outside an allocation of {allocation.nbytes} bytes")


def _pread_into(fd: int, ptr: int, nbytes: int, offset: int) -> None:
    """Read file bytes straight into host memory at `ptr` (a pinned staging buffer)."""
    while nbytes > 0:
        n = os.preadv(fd, [(ctypes.c_char * nbytes).from_address(ptr)], offset)
        if n == 0:
            raise OSError(f"unexpected end of host segment at offset {offset}")
        ptr, nbytes, offset = ptr + n, nbytes - n, offset + n


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap_read_only(fd: int, length: int, offset: int) -> int:
    # Through libc, not Python's mmap: cudaHostRegister needs the address, and a
    # read-only Python mmap gives none without a writable buffer.
    return _mmap(fd, length, offset, mmap.PROT_READ)


def _mmap(fd: int, length: int, offset: int, prot: int) -> int:
    addr = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return addr


def _munmap(addr: int, length: int) -> None:
    if _libc.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


# -- the tier -------------------------------------------------------------------------------

@dataclass
class Arena:
    """One allocation: the tensors one model brought to the device, shared by later models that reuse them."""
    name: str
    seq: int                        # creation order: export lists handles in it
    size: int
    users: set = field(default_factory=set)   # keys of models whose tensors live here (or are loading)
    allocation: Allocation | None = None      # set at commit


@dataclass
class DevicePlan:
    """How one model becomes resident on the device: tensors it reuses and those it copies into a new arena."""
    key: str
    tensors: list                   # TensorEntry of the model's (GPU variant) tensors
    locations: dict                 # tensor name -> (arena name, offset)
    host_files: list[str]           # host segment paths the copies read
    copies: list                    # (host file index, host offset, arena offset, nbytes, sha256)
    arena: str | None               # the new arena's name, None when every tensor is already on the device
    arena_bytes: int
    # Written by `write` on the loader thread, read by commit/abort once it has returned.
    allocation: Allocation | None = None
    copied_bytes: int = 0
    copy_s: float = 0.0

    @property
    def bytes(self) -> int:
        """What the plan places on the device (reserved until commit or abort)."""
        return self.arena_bytes


class DeviceTier:
    """Model weights on one device; same contract as HostTier (plan → write → commit/abort, free_model, export).
    `source`: the host tier, which a copy here is promoted from (the GPU variant of its resident models)."""

    name = "gpu"
    capacity_setting = "gpu_capacity"

    def __init__(self, allocator: DeviceAllocator, capacity_bytes: int, source=None):
        self.source = source
        self.allocator = allocator
        self.device = allocator.device
        self.id = self.device.uuid          # its copies' key in a model's record
        self.where = f"the GPU tier of GPU {self.device.index}"
        self.capacity_bytes = min(capacity_bytes, self.device.total_bytes)
        self.arenas: dict[str, Arena] = {}
        self.index: dict[str, tuple[str, int]] = {}     # sha256 -> (arena, offset)
        self.models: dict[str, dict] = {}               # resident key -> tensor name -> (arena, offset)
        self._tensors: dict[str, list] = {}             # resident key -> its TensorEntry list (for export)
        self._in_flight: dict[str, DevicePlan] = {}     # planned, not yet committed or aborted
        self._next_arena = 0
        self.promotion_bytes_per_s = 0.0                # of the last committed copy, for stats

    # -- accounting ----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of all arenas, including those being written (reserved by their plan)."""
        return sum(a.size for a in self.arenas.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def bytes_freed_by(self, keys) -> int:
        """What evicting all of `keys` together would free: arenas no other model uses."""
        keys = set(keys)
        return sum(a.size for a in self.arenas.values() if a.users and a.users <= keys)

    def model_bytes(self, key: str) -> int:
        """Bytes of the arenas a model uses (shared ones counted in full)."""
        return sum(a.size for a in self.arenas.values() if key in a.users)

    def tensors_of(self, manifest) -> list:
        """The tensors of a model a lease here maps: its GPU variant's."""
        return manifest.gpu_tensors

    def check_model(self, key: str, manifest) -> None:
        """Raise when the model can never be on a GPU (packed without a GPU variant)."""
        if not manifest.gpu_tensors:
            raise ModelCacheError(f"{key} was packed without a GPU variant (by an older modelcache); "
                                  f"add it again to open it on a GPU")

    def describe(self) -> dict:
        return {"tier": "gpu", "device": self.device.uuid, "index": self.device.index, "name": self.device.name,
                "kind": self.allocator.kind,
                "sharing": self.allocator.sharing,            # as clients get it: ipc or vmm-read-only
                "sharing_note": self.allocator.sharing_note,  # why not as set ("" when it is)
                "promotion_bytes_per_s": self.promotion_bytes_per_s}   # of the last host -> GPU copy

    # -- promotion: plan (owner) -> write (loader) -> commit or abort (owner) -------------
    def plan(self, key: str, manifest) -> DevicePlan:
        """`plan_tensors` of the model's GPU variant, read from its copy in the host tier (`source`)."""
        if not self.source.has_variant(key, "gpu"):
            raise ModelCacheError(f"{key}: its GPU weights are not in the host tier")
        return self.plan_tensors(key, manifest.gpu_tensors, self.source.file_locations(key, "gpu"))

    def plan_tensors(self, key: str, tensors: list, host_locations: dict) -> DevicePlan:
        """Decide where each tensor will live on the device and reserve the new arena's bytes.

        `host_locations`: tensor name -> (host segment path, offset) of its resident host copy.
        """
        if key in self.models or key in self._in_flight:
            raise ValueError(f"{key} is already on device {self.device.uuid} or loading there")
        locations, copies, offset = {}, [], 0
        fresh: dict[str, int] = {}                  # sha -> offset in the new arena
        host_files: dict[str, int] = {}             # path -> index in plan.host_files
        arena = f"arena-{self._next_arena}"
        for t in tensors:
            if t.sha256 in self.index:
                locations[t.name] = self.index[t.sha256]
            elif t.sha256 in fresh:                 # the same tensor twice in one model
                locations[t.name] = (arena, fresh[t.sha256])
            else:
                if t.name not in host_locations:
                    raise ValueError(f"{key}: tensor {t.name!r} is not resident in the host tier")
                path, host_offset = host_locations[t.name]
                offset = -(-offset // DEVICE_ALIGN) * DEVICE_ALIGN
                fresh[t.sha256] = offset
                file_index = host_files.setdefault(str(path), len(host_files))
                copies.append((file_index, host_offset, offset, t.nbytes, t.sha256))
                locations[t.name] = (arena, offset)
                offset += t.nbytes
        if copies:
            offset = self.allocator.rounded(offset)   # what the allocation will take on the device
            self.arenas[arena] = Arena(arena, self._next_arena, offset, {key})   # reserved from now on
            self._next_arena += 1
        else:
            arena = None
        for arena_name, _ in locations.values():    # keep reused arenas alive while we load
            self.arenas[arena_name].users.add(key)
        plan = DevicePlan(key, list(tensors), locations, list(host_files), copies, arena, offset if copies else 0)
        self._in_flight[key] = plan
        return plan

    def write(self, plan: DevicePlan) -> float:
        """Allocate the plan's arena and copy its tensors in from the host tier. Loader thread; returns seconds.

        On failure nothing stays allocated; the owner then calls `abort`.
        """
        t0 = time.perf_counter()
        if plan.arena is not None:
            allocation = self.allocator.alloc(plan.arena_bytes)
            try:
                plan.copied_bytes, plan.copy_s = self.allocator.copy_in(
                    allocation, _coalesce([c[:4] for c in plan.copies]), plan.host_files)
            except BaseException:
                self.allocator.free(allocation)
                raise
            plan.allocation = allocation
        return time.perf_counter() - t0

    def commit(self, plan: DevicePlan) -> None:
        self._in_flight.pop(plan.key, None)
        if plan.arena is not None:
            if plan.allocation is None:
                raise RuntimeError(f"commit of {plan.key} before its write finished")
            self.arenas[plan.arena].allocation = plan.allocation
            for _, _, dst_off, _, sha in plan.copies:
                self.index.setdefault(sha, (plan.arena, dst_off))
            if plan.copy_s > 0:
                self.promotion_bytes_per_s = plan.copied_bytes / plan.copy_s
        self.models[plan.key] = plan.locations
        self._tensors[plan.key] = plan.tensors

    def abort(self, plan: DevicePlan) -> None:
        """A failed or refused load: free what write allocated and release what the plan reserved."""
        self._in_flight.pop(plan.key, None)
        if plan.allocation is not None:
            self.allocator.free(plan.allocation)
            plan.allocation = None
        self._drop_user(plan.key)

    def free_model(self, key: str) -> int:
        """Forget a resident model; free the arenas nobody else uses. Returns bytes freed.

        Only for models no live lease maps: a client's imported mapping keeps the memory
        in use on the device whatever this frees.
        """
        self.models.pop(key, None)
        self._tensors.pop(key, None)
        return self._drop_user(key)

    def _drop_user(self, key: str) -> int:
        freed = 0
        for arena in list(self.arenas.values()):
            arena.users.discard(key)
            if not arena.users:
                if arena.allocation is not None:
                    self.allocator.free(arena.allocation)
                del self.arenas[arena.name]
                self.index = {sha: loc for sha, loc in self.index.items() if loc[0] != arena.name}
                freed += arena.size
        return freed

    def stop(self) -> None:
        """Free everything. Call once no write is running (the loaders have stopped)."""
        for plan in list(self._in_flight.values()):
            self.abort(plan)
        for arena in self.arenas.values():
            if arena.allocation is not None:
                self.allocator.free(arena.allocation)
        self.arenas.clear()
        self.index.clear()
        self.models.clear()
        self._tensors.clear()
        self.allocator.close()

    # -- what clients get ------------------------------------------------------------------
    def export(self, key: str, manifest) -> dict:
        """What a lease on this copy maps, as OpenReply's fields: the GPU skeleton (in the host tier), the
        arenas' IPC handles, each tensor's place."""
        handles, tensors = self.handles(key)
        fields = {"skeleton_path": str(self.source.skeleton_path(key, "gpu")), "segments": [], "tensors": tensors,
                  "device_uuid": self.device.uuid, "ipc_kind": self.allocator.kind, "ipc_handles": handles}
        if self.allocator.kind in VMM_KINDS:
            fields["ipc_fds"] = len(handles)
        return fields

    def lease_fds(self, key: str) -> list[int]:
        """The descriptors a lease's reply carries, in handle order: the allocations', under read-only sharing
        (the fd-shared kinds); else none. Still the allocator's: the lane passes copies."""
        return self.export_fds(key) if self.allocator.kind in VMM_KINDS else []

    def handles(self, key: str) -> tuple[list[bytes], list[list]]:
        """(handles of the arenas the model uses, [name, dtype, shape, handle index, offset, nbytes] per tensor)."""
        locations = self.models[key]
        arenas = self._arenas_of(key)
        slot = {name: i for i, name in enumerate(arenas)}
        tensors = [[t.name, t.dtype, t.shape, slot[locations[t.name][0]], locations[t.name][1], t.nbytes]
                   for t in self._tensors[key]]
        return [self.arenas[name].allocation.handle for name in arenas], tensors

    def export_fds(self, key: str) -> list[int]:
        """The descriptors of the arenas the model uses, in `export`'s handle order (fd-shared kinds; -1 for others).
        Still the allocator's: a sender passes copies (SCM_RIGHTS) and closes nothing."""
        return [self.arenas[name].allocation.fd for name in self._arenas_of(key)]

    def _arenas_of(self, key: str) -> list[str]:
        return sorted({name for name, _ in self.models[key].values()}, key=lambda name: self.arenas[name].seq)

    def local_tensors(self, key: str, names=None) -> list[list]:
        """[name, dtype, shape, address, nbytes] per tensor of a resident model (those in `names`, when given),
        at addresses of this process: what the daemon's own GPU workers build stage sessions over, no copy.

        Valid while the model is resident here: the owner must hold a lease on this copy for as long as a
        session over these addresses lives (the daemon's `free_model` really frees them, in its own process)."""
        locations = self.models[key]
        out = []
        for t in self._tensors[key]:
            if names is not None and t.name not in names:
                continue
            arena, offset = locations[t.name]
            base = self.allocator.local_address(self.arenas[arena].allocation)
            out.append([t.name, t.dtype, list(t.shape), base + offset, t.nbytes])
        return out


def _coalesce(copies: list) -> list:
    """Merge copies from one host file that are contiguous on both sides: fewer, larger DMA transfers."""
    merged = []
    for index, src, dst, n in sorted(copies, key=lambda c: (c[0], c[2])):
        if merged:
            p_index, p_src, p_dst, p_n = merged[-1]
            if p_index == index and p_src + p_n == src and p_dst + p_n == dst:
                merged[-1] = (p_index, p_src, p_dst, p_n + n)
                continue
        merged.append((index, src, dst, n))
    return merged
