"""Device memory as the tier sees it: an Allocation, the DeviceAllocator interface every allocator
meets, its errors and constants, and the helpers the allocators share (host reads, libc mmap)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Protocol

from ...config import GPU_SHARING
from ...errors import CapacityError
from .devices import GpuDevice

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


def mmap_read_only(fd: int, length: int, offset: int) -> int:
    # Through libc, not Python's mmap: cudaHostRegister needs the address, and a
    # read-only Python mmap gives none without a writable buffer.
    return _mmap(fd, length, offset, mmap.PROT_READ)


def _mmap(fd: int, length: int, offset: int, prot: int) -> int:
    addr = _libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return addr


def munmap(addr: int, length: int) -> None:
    if _libc.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")
