"""Device memory played by files and sealed memfds: the daemon's GPU logic without a GPU, the same calls in CI as
on a device."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

from ...cuda import vmm_token
from ..files import copy_range
from .devices import GpuDevice
from .memory import (F_SEAL_FUTURE_WRITE, Allocation, DeviceMemoryError, _check_range, _copy_from_host, _mmap,
                     mmap_read_only, munmap, _pread_into)


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
            munmap(local, allocation.nbytes)
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
                    addr = self._local[allocation.ptr] = mmap_read_only(fd, allocation.nbytes, 0)
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
                munmap(addr, nbytes)
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
            munmap(addr, allocation.nbytes)
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
