"""The CUDA binding both the client and the daemon use: the CUDA runtime and driver through ctypes, device
names, DLPack OrtValues over raw device (or host) pointers, and the mappings of simulated ("fake") devices.

The CUDA runtime is the one onnxruntime itself loaded (through ctypes: importing cupy costs 0.1-0.6 s).
The driver (libcuda) serves the virtual memory API of read-only sharing (`gpu_sharing = "vmm-read-only"`):
through ctypes too, not NVIDIA's cuda-bindings: importing its driver module cost an attach client 201 ms
(median of 21 fresh processes on a loaded 2-core VM; 110 ms in a quieter pilot), this binding 0.7 ms
(benchmarks/binding/driver_import.txt), against a GPU attach ready in ~540 ms in all (shared/GPU.md).
A fake device, for machines without a GPU, is shared-memory files standing in for allocations, with CPU
OrtValues over them: the same DLPack and ``add_initializer`` path runs everywhere but the CUDA calls.

DLPack lifetimes: each DLManagedTensor is malloc'd and its deleter is libc ``free``: ORT owns it from
``from_dlpack`` on and frees it when the OrtValue dies, so no Python callback ever runs at interpreter exit.

Nothing here imports numpy, onnxruntime or cupy at module import time (client startup is measured).
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import threading

from .errors import ModelCacheError

__all__ = [
    "DeviceError", "CudaRuntime", "cuda_runtime", "CudaDriver", "cuda_driver", "normalize_uuid", "fake_uuid",
    "fake_index", "map_fake", "map_fake_fd", "unmap_fake", "vmm_token", "vmm_token_size", "VMM_KINDS", "KDL_CPU",
    "KDL_CUDA", "DLPACK_DTYPES", "dlpack_value",
]

_GPU_HINT = "install onnxruntime-gpu (the [gpu] extra: pip install 'modelcache[gpu]')"


class DeviceError(ModelCacheError):
    """A GPU device, the CUDA runtime or a device export could not be used by this process."""

    code = "device"


# -- CUDA runtime through ctypes ------------------------------------------------------------------------

_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_CUDART_MAPPED = re.compile(r"/libcudart\.so(\.\d+)*$")
_CUDA_ERROR_NO_DEVICE = 100
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_PROPS_BUFFER_BYTES = 8192        # sizeof(cudaDeviceProp) is ~1 KiB and grows with CUDA versions
_PROPS_UUID_OFFSET = 256          # cudaDeviceProp: char name[256]; cudaUUID_t uuid (16 bytes); ...


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # cudaIpcMemHandle_t, passed by value


def _mapped_cudart_paths(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of the libcudart already mapped into this process (the one ORT's preload_dlls loaded)."""
    paths: list[str] = []
    try:
        with open(maps_path) as f:
            for line in f:
                parts = line.split(None, 5)  # address perms offset dev inode [path]
                path = parts[5].strip() if len(parts) == 6 else ""
                if _CUDART_MAPPED.search(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _load_cudart(names=_CUDART_NAMES) -> ctypes.CDLL:
    """The CUDA runtime ORT uses when it is already loaded here, else the first of `names` the loader finds."""
    for path in _mapped_cudart_paths():
        try:
            return ctypes.CDLL(path)  # already loaded: dlopen hands back the same instance
        except OSError:
            continue
    tried = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
    raise DeviceError("no CUDA runtime (libcudart) could be loaded in this process, so GPU weights cannot be "
                      f"mapped; {_GPU_HINT}, or put the CUDA 12/13 runtime on LD_LIBRARY_PATH. Tried: "
                      + "; ".join(tried))


class CudaRuntime:
    """The few CUDA runtime calls a client needs (device lookup by UUID, IPC open/close), every return code checked.

    Create it through `cuda_runtime()`: it imports onnxruntime and runs ``preload_dlls()`` first so that
    the libcudart found is the one ORT's CUDA provider uses.
    """

    def __init__(self, names=_CUDART_NAMES):
        self._lib = _load_cudart(names)
        self._lock = threading.Lock()
        self._initialized: set[int] = set()
        self._uuids: dict[int, str] = {}
        self._declare()

    def _declare(self) -> None:
        lib = self._lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        # CUDA 12 exports the current layout as _v2 (the plain symbol is the old one); CUDA 13 only the plain one.
        try:
            self._get_props = lib.cudaGetDeviceProperties_v2
            self._get_props_name = "cudaGetDeviceProperties_v2"
        except AttributeError:
            self._get_props = lib.cudaGetDeviceProperties
            self._get_props_name = "cudaGetDeviceProperties"
        self._get_props.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        for fn in (lib.cudaGetDeviceCount, self._get_props, lib.cudaSetDevice, lib.cudaFree,
                   lib.cudaIpcOpenMemHandle, lib.cudaIpcCloseMemHandle):
            fn.restype = ctypes.c_int

    def _check(self, rc: int, call: str, hint: str = "") -> None:
        if rc != 0:
            name = (self._lib.cudaGetErrorName(rc) or b"?").decode(errors="replace")
            text = (self._lib.cudaGetErrorString(rc) or b"?").decode(errors="replace")
            raise DeviceError(f"{call} failed: {name} ({rc}): {text}" + (f"; {hint}" if hint else ""))

    def device_count(self) -> int:
        """CUDA devices visible to this process (after CUDA_VISIBLE_DEVICES); 0 when there is none."""
        n = ctypes.c_int(0)
        rc = self._lib.cudaGetDeviceCount(ctypes.byref(n))
        if rc == _CUDA_ERROR_NO_DEVICE:
            return 0
        self._check(rc, "cudaGetDeviceCount", "is an NVIDIA driver installed and a GPU visible to this process?")
        return n.value

    def uuid_of(self, index: int) -> str:
        """The UUID of local device `index` as 32 lowercase hex digits (the daemon's name for it)."""
        with self._lock:
            if index not in self._uuids:
                count = self.device_count()
                if not 0 <= index < count:
                    raise DeviceError(f"CUDA device {index} does not exist here: this process sees {count} "
                                      f"device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
                props = ctypes.create_string_buffer(_PROPS_BUFFER_BYTES)
                self._check(self._get_props(props, index), f"{self._get_props_name}({index})")
                self._uuids[index] = props.raw[_PROPS_UUID_OFFSET:_PROPS_UUID_OFFSET + 16].hex()
            return self._uuids[index]

    def index_of(self, uuid: str) -> int:
        """The local index of the device named `uuid` (our hex form, or nvidia-smi's ``GPU-xxxxxxxx-...``)."""
        wanted = normalize_uuid(uuid)
        count = self.device_count()
        for index in range(count):
            if self.uuid_of(index) == wanted:
                return index
        raise DeviceError(f"GPU {uuid} is not visible to this process ({count} CUDA device(s) visible, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the daemon "
                          "exported weights on it, so this client must be able to see that device")

    def set_device(self, index: int) -> None:
        """Make `index` this thread's current device; the first time, create its context (``cudaFree(0)``)."""
        self._check(self._lib.cudaSetDevice(index), f"cudaSetDevice({index})")
        with self._lock:
            if index in self._initialized:
                return
            self._check(self._lib.cudaFree(None), f"cudaFree(0) on device {index}")
            self._initialized.add(index)

    def ipc_open(self, handle: bytes) -> int:
        """Map an allocation another process exported into the current device's address space; its base pointer."""
        if len(handle) != 64:
            raise DeviceError(f"a cudaIpcMemHandle_t is 64 bytes, got {len(handle)}")
        ptr = ctypes.c_void_p()
        rc = self._lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcMemHandle.from_buffer_copy(handle),
                                            _IPC_LAZY_ENABLE_PEER_ACCESS)
        self._check(rc, "cudaIpcOpenMemHandle",
                    "the exporting daemon must be alive, on this machine and in the same IPC namespace, and "
                    "a process cannot open a handle it exported itself")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    """The process's `CudaRuntime`, created on first use after ``import onnxruntime; onnxruntime.preload_dlls()``."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            import onnxruntime

            preload = getattr(onnxruntime, "preload_dlls", None)
            if preload is not None:
                preload()  # loads the CUDA/cuDNN libraries ORT's CUDA provider will use (a no-op on CPU builds)
            _runtime = CudaRuntime()
        return _runtime


# -- CUDA driver through ctypes: the virtual memory API ------------------------------------------------------

# Values of cuda.h (CUDA 12 and 13 alike) that the VMM calls take.
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CUDA_ERROR_NOT_INITIALIZED = 3
_CUDA_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so")


class _CUmemLocation(ctypes.Structure):
    # CUDA 13 makes `id` a union with `localized` (two bytes): 8 bytes either way (tests compare with cuda-bindings).
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _CUmemAllocFlags)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


def _device_prop(index: int) -> _CUmemAllocationProp:
    """A pinned allocation on device `index` that may be exported as a POSIX file descriptor."""
    prop = _CUmemAllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, index)
    return prop


class CudaDriver:
    """The driver calls of read-only sharing (cuMem*), every return code checked; `cuda_driver()` makes one.

    Device arguments are ordinals as the driver counts them (CUDA_VISIBLE_DEVICES applied), the same as the
    runtime's. An exporter: `create` -> `map` (read-write, to copy in) -> `export_fd`; an importer:
    `import_fd` -> `map` (read-only) -> close the fd; either: `unmap` then `release` of what it holds."""

    def __init__(self, names=_CUDA_DRIVER_NAMES):
        tried = []
        for name in names:
            try:
                self._lib = ctypes.CDLL(name)
                break
            except OSError as e:
                tried.append(f"{name}: {e}")
        else:
            raise DeviceError("no CUDA driver (libcuda) could be loaded in this process, so GPU memory cannot be "
                              "shared read-only; is an NVIDIA driver installed? Tried: " + "; ".join(tried))
        self._lock = threading.Lock()
        self._granularity: dict[int, int] = {}
        self._declare()
        self._check(self._lib.cuInit(0), "cuInit", "is an NVIDIA driver installed and a GPU visible to this process?")

    def _declare(self) -> None:
        lib, u64, size_t, vp = self._lib, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size_t), ctypes.POINTER(_CUmemAllocationProp),
                                                      ctypes.c_int]
        lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size_t, ctypes.POINTER(_CUmemAllocationProp), u64]
        lib.cuMemRelease.argtypes = [u64]
        lib.cuMemExportToShareableHandle.argtypes = [vp, u64, ctypes.c_int, u64]
        lib.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_int]
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size_t, size_t, u64, u64]
        lib.cuMemAddressFree.argtypes = [u64, size_t]
        lib.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
        lib.cuMemUnmap.argtypes = [u64, size_t]
        lib.cuMemSetAccess.argtypes = [u64, size_t, ctypes.POINTER(_CUmemAccessDesc), size_t]
        for fn in (lib.cuGetErrorName, lib.cuGetErrorString, lib.cuInit, lib.cuDeviceGet, lib.cuDeviceGetAttribute,
                   lib.cuMemGetAllocationGranularity, lib.cuMemCreate, lib.cuMemRelease,
                   lib.cuMemExportToShareableHandle, lib.cuMemImportFromShareableHandle, lib.cuMemAddressReserve,
                   lib.cuMemAddressFree, lib.cuMemMap, lib.cuMemUnmap, lib.cuMemSetAccess):
            fn.restype = ctypes.c_int

    def _check(self, rc: int, call: str, hint: str = "") -> None:
        if rc != 0:
            name, text = ctypes.c_char_p(), ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            self._lib.cuGetErrorString(rc, ctypes.byref(text))
            error = DeviceError(f"{call} failed: {(name.value or b'?').decode(errors='replace')} ({rc}): "
                                f"{(text.value or b'?').decode(errors='replace')}" + (f"; {hint}" if hint else ""))
            error.status = rc   # CUDA_ERROR_OUT_OF_MEMORY (2) is the caller's to tell apart
            raise error

    def attribute(self, attribute: int, index: int) -> int:
        device, value = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), index), f"cuDeviceGet({index})")
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
                    f"cuDeviceGetAttribute({attribute}, device {index})")
        return value.value

    def granularity(self, index: int) -> int:
        """The size every allocation on device `index` (and every mapping of one) is a multiple of."""
        with self._lock:
            if index not in self._granularity:
                out, prop = ctypes.c_size_t(), _device_prop(index)
                self._check(self._lib.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop),
                                                                    _CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                            f"cuMemGetAllocationGranularity(device {index})")
                self._granularity[index] = out.value
            return self._granularity[index]

    def create(self, nbytes: int, index: int) -> int:
        """Physical memory on device `index` (nbytes: a multiple of `granularity`), exportable as an fd; its handle."""
        handle = ctypes.c_ulonglong()
        self._check(self._lib.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(_device_prop(index)), 0),
                    f"cuMemCreate({nbytes >> 20} MiB on device {index})")
        return handle.value

    def release(self, handle: int) -> None:
        """Drop this process's handle: the memory goes once no mapping of it is left, in any process."""
        self._check(self._lib.cuMemRelease(handle), "cuMemRelease")

    def export_fd(self, handle: int) -> int:
        """A new file descriptor for the allocation, to pass to another process (SCM_RIGHTS); the caller closes it."""
        fd = ctypes.c_int(-1)
        self._check(self._lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle,
                                                           _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    "cuMemExportToShareableHandle")
        return fd.value

    def import_fd(self, fd: int) -> int:
        """This process's handle of the allocation another exported as `fd` (the fd stays the caller's to close)."""
        handle = ctypes.c_ulonglong()
        self._check(self._lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                             _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    "cuMemImportFromShareableHandle", "the descriptor must come from cuMemExportToShareableHandle")
        return handle.value

    def map(self, handle: int, nbytes: int, index: int, read_only: bool) -> int:
        """Reserve addresses, map the whole allocation there and let device `index` read (and, unless read_only,
        write) it; the base address. Undone by `unmap`, also when a step here fails."""
        va = ctypes.c_ulonglong()
        self._check(self._lib.cuMemAddressReserve(ctypes.byref(va), nbytes, self.granularity(index), 0, 0),
                    f"cuMemAddressReserve({nbytes >> 20} MiB)")
        mapped = False
        try:
            self._check(self._lib.cuMemMap(va.value, nbytes, 0, handle, 0), "cuMemMap")
            mapped = True
            flags = CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access = _CUmemAccessDesc(_CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, index), flags)
            self._check(self._lib.cuMemSetAccess(va.value, nbytes, ctypes.byref(access), 1),
                        f"cuMemSetAccess({'read-only' if read_only else 'read-write'}, device {index})")
        except BaseException:
            if mapped:
                self._lib.cuMemUnmap(va.value, nbytes)
            self._lib.cuMemAddressFree(va.value, nbytes)
            raise
        return va.value

    def unmap(self, va: int, nbytes: int) -> None:
        """Undo `map`: unmap, then give the addresses back (both tried; the first error raised)."""
        rc_unmap = self._lib.cuMemUnmap(va, nbytes)
        rc_free = self._lib.cuMemAddressFree(va, nbytes)
        self._check(rc_unmap, "cuMemUnmap")
        self._check(rc_free, "cuMemAddressFree")


_driver: CudaDriver | None = None


def cuda_driver() -> CudaDriver:
    """The process's `CudaDriver` (libcuda loaded and initialized once)."""
    global _driver
    with _runtime_lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver


# -- read-only shared allocations: what a client is told of each --------------------------------------------

# Export kinds whose allocations travel as file descriptors (SCM_RIGHTS on the lane), one per handle; the
# handle is then a `vmm_token`: which allocation, not how to open it.
VMM_KINDS = ("cuda-vmm", "fake-vmm")
_TOKEN = struct.Struct("<16sQQ")   # the daemon's random nonce, the allocation's number, its size in bytes


def vmm_token(nonce: bytes, number: int, nbytes: int) -> bytes:
    """An fd-shared allocation's name: unique across daemons (the nonce), so that a process maps it once however
    many leases name it, and never takes a restarted daemon's allocation for one it already maps."""
    return _TOKEN.pack(nonce, number, nbytes)


def vmm_token_size(token: bytes) -> int:
    """The mapped size an allocation's token declares (a multiple of the device's granularity)."""
    if len(token) != _TOKEN.size:
        raise DeviceError(f"an fd-shared allocation's token is {_TOKEN.size} bytes, got {len(token)}")
    return _TOKEN.unpack(token)[2]


# -- device names -------------------------------------------------------------------------------------------

_HEX_UUID = re.compile(r"^[0-9a-f]{32}$")


def normalize_uuid(uuid: str) -> str:
    """Our wire form of a CUDA device UUID (32 lowercase hex digits) from it or nvidia-smi's ``GPU-8-4-4-4-12`` form."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.replace("-", "")
    if not _HEX_UUID.match(text):
        raise DeviceError(f"not a CUDA device UUID: {uuid!r} (expected 32 hex digits or GPU-xxxxxxxx-xxxx-...)")
    return text


def fake_uuid(index: int) -> str:
    """The name of simulated device `index` (the `fake_gpus` setting), where a real one has its UUID."""
    return f"fake-{index}"


def fake_index(uuid: str) -> int:
    """The index in a fake device's name (`fake_uuid`)."""
    m = re.match(r"^fake-(\d+)$", uuid)
    if not m:
        raise DeviceError(f"not a fake device uuid: {uuid!r} (expected fake-<index>)")
    return int(m.group(1))


# -- fake device allocations: shared-memory files mapped read-only ------------------------------------------

# libc: mmap/munmap for the fake allocations, malloc/free for the DLPack descriptors below.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_LIBC_FREE = ctypes.cast(_libc.free, ctypes.c_void_p).value
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fake(path: str) -> tuple[int, int]:
    """A fake device allocation: the whole shared-memory file mapped read-only; (address, size).

    Mapped with libc rather than the mmap module: ORT needs the raw address, which Python's mmap only
    gives for writable mappings, and an explicit munmap cannot be refused by a lingering buffer export.
    """
    import mmap

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise DeviceError(f"fake device allocation {path} is empty")
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise DeviceError(f"mmap of fake device allocation {path} failed: {os.strerror(err)}")
        return addr, size
    finally:
        os.close(fd)  # the mapping keeps the pages


def map_fake_fd(fd: int, size: int) -> int:
    """A fake device allocation passed as a descriptor (fake-vmm): `size` bytes of it mapped read-only; the address.
    The caller closes `fd` (the mapping keeps the memory)."""
    import mmap

    if os.fstat(fd).st_size < size:
        raise DeviceError(f"the fake device allocation passed is smaller than the {size} bytes its token declares")
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise DeviceError(f"mmap of a fake device allocation failed: {os.strerror(ctypes.get_errno())}")
    return addr


def unmap_fake(addr: int, size: int) -> None:
    """Undo `map_fake`: only after every OrtValue over the mapping is gone."""
    if _libc.munmap(addr, size) != 0:
        raise DeviceError(f"munmap of fake device allocation failed: {os.strerror(ctypes.get_errno())}")


# -- DLPack over raw device pointers -------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


KDL_CPU, KDL_CUDA = 1, 2
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
# numpy dtype name -> (DLPack type code, bits)
DLPACK_DTYPES = {
    "float16": (_KDL_FLOAT, 16), "float32": (_KDL_FLOAT, 32), "float64": (_KDL_FLOAT, 64),
    "bfloat16": (_KDL_BFLOAT, 16),
    "int8": (_KDL_INT, 8), "int16": (_KDL_INT, 16), "int32": (_KDL_INT, 32), "int64": (_KDL_INT, 64),
    "uint8": (_KDL_UINT, 8), "uint16": (_KDL_UINT, 16), "uint32": (_KDL_UINT, 32), "uint64": (_KDL_UINT, 64),
    "bool": (_KDL_BOOL, 8),
}
_DLTENSOR_NAME = b"dltensor"  # module constant: the capsule keeps a pointer to it
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]

_from_dlpack = None  # (make(capsule, is_bool) -> OrtValue, legacy_bool) once ORT's signature is known


def _ort_from_dlpack():
    """ORT's DLPack import, adapted to its version: 1.32 takes ``(data)`` and understands kDLBool; 1.31
    takes ``(data, is_bool_tensor)`` and reads bool only as uint8 + that flag."""
    global _from_dlpack
    if _from_dlpack is None:
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state as C

        if not hasattr(C.OrtValue, "from_dlpack"):
            raise DeviceError(f"onnxruntime {ort.__version__} has no OrtValue.from_dlpack; upgrade onnxruntime")
        legacy = "is_bool_tensor" in (C.OrtValue.from_dlpack.__doc__ or "")
        if legacy:
            def make(capsule, is_bool):
                return ort.OrtValue(C.OrtValue.from_dlpack(capsule, is_bool))
        else:
            def make(capsule, is_bool):
                return ort.OrtValue.from_dlpack(capsule)
        _from_dlpack = (make, legacy)
    return _from_dlpack


def dlpack_value(ptr: int, dtype: str, shape: list, device_type: int, device_id: int):
    """An OrtValue over `ptr` (no copy). The DLManagedTensor and its shape live in one malloc'd block
    whose deleter is libc free: ORT takes it over in from_dlpack and frees it when the OrtValue dies."""
    make, legacy_bool = _ort_from_dlpack()
    code, bits = DLPACK_DTYPES[dtype]
    is_bool = dtype == "bool"
    if is_bool and legacy_bool:
        code = _KDL_UINT  # ORT <= 1.31: bool travels as uint8 plus is_bool_tensor
    ndim = len(shape)
    head = ctypes.sizeof(_DLManagedTensor)  # a multiple of 8, so the int64 shape after it is aligned
    block = _libc.malloc(head + 8 * max(ndim, 1))
    if not block:
        raise MemoryError("malloc of a DLManagedTensor failed")
    managed = _DLManagedTensor.from_address(block)
    (ctypes.c_int64 * max(ndim, 1)).from_address(block + head)[:ndim] = shape
    t = managed.dl_tensor
    t.data = ptr
    t.device = _DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = _DLDataType(code, bits, 1)
    t.shape = block + head
    t.strides = None  # compact row-major
    t.byte_offset = 0  # older ORT ignores byte_offset: the offset is already in `data`
    managed.manager_ctx = None
    managed.deleter = _LIBC_FREE
    capsule = _capsule_new(block, _DLTENSOR_NAME, None)
    try:
        return make(capsule, is_bool)
    except Exception as e:
        if _capsule_is_valid(capsule, _DLTENSOR_NAME):
            _libc.free(block)  # not consumed: ORT renames the capsule when it takes ownership
        raise DeviceError(f"onnxruntime refused a {dtype}{list(shape)} tensor over DLPack: {e}") from e
