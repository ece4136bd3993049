"""Triton's system shared-memory extension: a client registers a POSIX shared-memory object (a file under
/dev/shm) as a named region, then names the region instead of sending a tensor's bytes, for inputs and for
the outputs it wants written there. The request carries a few hundred bytes of JSON or protobuf whatever the
tensors' size; the tensors cross no socket between the client and this front.

Registered per front (the HTTP and the gRPC front each keep their own, as each keeps its unloaded models), as
Triton's endpoints say them: register (name, key, offset, byte_size), unregister one or all, status.

A region is read with pread and written with pwrite on a descriptor held from register to unregister, never
mapped: the client owns the object, and a mapping whose file the client truncates is a SIGBUS in the front
(wire/tensors.py's I/O files are read the same way for the same reason). A truncated region is an error
naming it. The object is opened with this front's own rights, O_NOFOLLOW, and must be a regular file in
/dev/shm named by one path component: a client cannot have the front read or write a file it names by a
symlink, nor modelcache's own segments (names starting "modelcache").

Off unless the operator sets `client_shared_memory`: any client of the front may name any object the front's
user can open, which is how 2025's reports reached Triton's internal segments; Triton has shipped with client
shared memory off since 2.69 (`--allow-client-shm`).
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np

from ..errors import InputError, ModelNotFound, PermissionDenied
from .types import array_of_raw

SHM_DIR = "/dev/shm"
OWN_PREFIX = "modelcache"   # the daemon's tier directories and I/O files (wire/tensors.IO_PREFIX)
CUDA_REFUSED = ("CUDA shared memory is not served by modelcache: send tensors in the request, or in system shared "
                "memory (systemsharedmemory)")
PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class RegionRef:
    """Where a request puts one tensor: a registered region's name, the bytes it may use, from an offset into
    the region. Parsed by the codecs from a tensor's parameters (no I/O); read or written by Regions."""

    __slots__ = ("region", "byte_size", "offset")

    def __init__(self, region: str, byte_size: int, offset: int):
        self.region, self.byte_size, self.offset = region, byte_size, offset

    @classmethod
    def of(cls, params, what: str) -> "RegionRef | None":
        """The reference a tensor's parameters make (`params`: name -> plain value), None when they name no
        region; InputError for a half-given or malformed one."""
        region = params.get("shared_memory_region")
        if region is None:
            if any(k in params for k in PARAMETERS[1:]):
                raise InputError(f"{what}: shared_memory_byte_size and shared_memory_offset need a "
                                 "shared_memory_region")
            return None
        if not isinstance(region, str) or not region:
            raise InputError(f"{what}: shared_memory_region must be a region's name")
        size, offset = params.get("shared_memory_byte_size"), params.get("shared_memory_offset", 0)
        if size is None:
            raise InputError(f"{what}: a shared_memory_region needs its shared_memory_byte_size")
        for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"{what}: {key} {value!r} must be a number of bytes >= 0")
        return cls(region, size, offset)


class RegionInput:
    """An input the request left in a region: what the codec knew of it, until the front reads it."""

    __slots__ = ("name", "ref", "datatype", "dtype", "shape")

    def __init__(self, name: str, ref: RegionRef, datatype: str, dtype: np.dtype, shape: list):
        self.name, self.ref, self.datatype, self.dtype, self.shape = name, ref, datatype, dtype, shape


class _Region:
    __slots__ = ("name", "key", "offset", "byte_size", "fd")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int):
        self.name, self.key, self.offset, self.byte_size, self.fd = name, key, offset, byte_size, fd

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class Regions:
    """One front's registered system shared-memory regions."""

    def __init__(self, shm_dir: str = SHM_DIR, allowed: bool = True):
        self.shm_dir = shm_dir
        self.allowed = allowed
        self._regions: dict[str, _Region] = {}

    def register(self, name: str, key, offset, byte_size) -> None:
        """Hold `key`'s object open as region `name`: `byte_size` bytes from `offset`. InputError for a name
        taken, a key that is no such object or may not be opened, or a span past the object's end;
        PermissionDenied (403, PERMISSION_DENIED) while the operator has not allowed client shared memory."""
        if not self.allowed:
            raise PermissionDenied("client shared memory is off on this server: its operator may turn it on with "
                                   "client_shared_memory = true (MODELCACHE_CLIENT_SHARED_MEMORY=1); until then, "
                                   "send tensors in the request")
        if not isinstance(name, str) or not name:
            raise InputError("a shared-memory region needs a name")
        if name in self._regions:
            raise InputError(f"shared memory region '{name}' already in manager: unregister it first")
        if not isinstance(key, str) or not key:
            raise InputError(f"region '{name}': \"key\" must be the shared-memory object's name")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"region '{name}': {field} {value!r} must be a number of bytes >= 0")
        file = key.lstrip("/")   # (as shm_open: "/k" and "k" name the same object)
        if not file or "/" in file or file in (".", ".."):
            raise InputError(f"region '{name}': key {key!r} must name one shared-memory object, as shm_open "
                             "takes it (\"/name\", no other slash)")
        if file.startswith(OWN_PREFIX):
            raise InputError(f"region '{name}': key {key!r} names one of modelcache's own segments")
        try:
            fd = os.open(os.path.join(self.shm_dir, file), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InputError(f"Unable to open shared memory region '{name}': no object {key!r} "
                             f"in {self.shm_dir}") from None
        except OSError as e:
            raise InputError(f"Unable to open shared memory region '{name}' (key {key!r}): {e.strerror}"
                             + (": the server opens it with its own rights; let its user read and write it"
                                if isinstance(e, PermissionError) else "")) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InputError(f"region '{name}': key {key!r} is not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise InputError(f"region '{name}': offset {offset} + byte_size {byte_size} runs past the end of "
                                 f"{key!r} ({st.st_size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = _Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str | None = None) -> None:
        """Let one region go, or every one (`name` None or ""); a name not registered is no error (Triton's)."""
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.pop(n, None)
            if region is not None:
                os.close(region.fd)

    def status(self, name: str | None = None) -> list[dict]:
        """Every region, or one: ModelNotFound (404, NOT_FOUND) for a name not registered."""
        if not name:
            return [r.status() for r in self._regions.values()]
        return [self._get(name).status()]

    def close(self) -> None:
        self.unregister()

    def _get(self, name: str) -> _Region:
        region = self._regions.get(name)
        if region is None:
            raise ModelNotFound(f"Unable to find system shared memory region: '{name}'")
        return region

    def _span(self, ref: RegionRef, what: str) -> tuple[_Region, int]:
        """The region and the object's file offset a reference starts at; InputError past the region's end."""
        try:
            region = self._get(ref.region)
        except ModelNotFound as e:
            raise InputError(f"{what}: {e}") from None
        if ref.offset + ref.byte_size > region.byte_size:
            raise InputError(f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                             f"{ref.byte_size} runs past region '{region.name}' ({region.byte_size} bytes)")
        return region, region.offset + ref.offset

    def read_inputs(self, feeds: dict) -> dict:
        """`feeds` with every RegionInput replaced by its array, read from its region (a copy: the client may
        write the region again once answered)."""
        return {name: self._read(value) if isinstance(value, RegionInput) else value for name, value in feeds.items()}

    def _read(self, item: RegionInput) -> np.ndarray:
        what = f"input {item.name!r}"
        region, start = self._span(item.ref, what)
        count = math.prod(item.shape)
        if item.dtype.kind != "O" and item.ref.byte_size != count * item.dtype.itemsize:
            raise InputError(f"{what}: shared_memory_byte_size {item.ref.byte_size} for {count} {item.datatype} "
                             f"elements ({count * item.dtype.itemsize} bytes)")
        buf = bytearray(item.ref.byte_size)
        got = os.preadv(region.fd, [buf], start) if buf else 0
        if got != len(buf):
            raise InputError(f"{what}: region '{region.name}' ends {len(buf) - got} bytes short: its object "
                             f"{region.key!r} was truncated after it was registered")
        return array_of_raw(buf, item.dtype, item.shape, item.name, "shared memory")

    def write_output(self, name: str, ref: RegionRef, raw) -> None:
        """Write an output's bytes where the request asked. InputError when they do not fit the bytes the request
        gave it (Triton's words), or the object was truncated."""
        what = f"output {name!r}"
        region, start = self._span(ref, what)
        if len(raw) > ref.byte_size:
            raise InputError(f"shared memory size specified with the request for output '{name}' "
                             f"({ref.byte_size} bytes) should be at least {len(raw)} bytes to hold the results")
        # Never past the object's end: pwrite there would grow the client's object instead of failing.
        if os.fstat(region.fd).st_size < start + len(raw):
            raise InputError(f"{what}: region '{region.name}''s object {region.key!r} was truncated after it "
                             "was registered")
        if raw and os.pwrite(region.fd, raw, start) != len(raw):
            raise InputError(f"{what}: region '{region.name}' took only part of the output")
