"""The client's side of device-resident weights: map the daemon's exported allocations and hand ORT OrtValues over them.

Two kinds of export arrive in an open reply. ``"cuda"``: 64-byte ``cudaIpcMemHandle_t``s, opened with
the CUDA runtime that onnxruntime itself loaded (through ctypes: importing cupy costs 0.1-0.6 s).
``"fake"``: a simulated device for machines without a GPU, where each "allocation" is a shared-memory
file mapped read-only and values are CPU OrtValues; it exercises the same handle cache, DLPack and
``add_initializer`` path so that everything but the CUDA calls is tested everywhere.

Lifetimes (GPU.md, "Measured on an H100"): a handle is opened once per process and closed when its last
user releases it (`HandleCache`); ORT keeps raw pointers into the mapping, so a `DeviceWeights` must be
released only after every session built over it is gone. Each DLManagedTensor is malloc'd and its
deleter is libc ``free``: ORT owns it from ``from_dlpack`` on and frees it when the OrtValue dies, so no
Python callback ever runs at interpreter exit.

Nothing here imports numpy, onnxruntime or cupy at module import time (client startup is measured).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading

from ..errors import ModelCacheError, ProtocolError
from ..protocol import TensorPlacement

__all__ = [
    "DeviceError", "CudaRuntime", "cuda_runtime", "HandleCache", "handle_cache", "DeviceWeights",
    "attach_weights", "requested_device", "cuda_device_id", "fake_gpu_count", "normalize_uuid",
    "FAKE_GPUS_ENV",
]

FAKE_GPUS_ENV = "MODELCACHE_FAKE_GPUS"
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


def fake_gpu_count(spec: str) -> int:
    """How many fake devices a MODELCACHE_FAKE_GPUS value declares: ``"2x256M"`` or ``"2"`` -> 2."""
    m = re.match(r"^\s*(\d+)\s*(?:[xX].*)?$", spec)
    if not m:
        raise DeviceError(f"{FAKE_GPUS_ENV}={spec!r}: expected <count>x<size> (e.g. 2x256M)")
    return int(m.group(1))


def _fake_index(uuid: str) -> int:
    m = re.match(r"^fake-(\d+)$", uuid)
    if not m:
        raise DeviceError(f"not a fake device uuid: {uuid!r} (expected fake-<index>)")
    return int(m.group(1))


def cuda_device_id(providers) -> int | None:
    """The CUDA device an ORT-style providers list asks for (names or ``(name, options)`` pairs), or None."""
    for entry in providers or ():
        name, options = (entry, {}) if isinstance(entry, str) else (entry[0], entry[1] if len(entry) > 1 else {})
        if name != "CUDAExecutionProvider":
            continue
        raw = (options or {}).get("device_id", 0)
        try:
            device_id = int(raw)
        except (TypeError, ValueError):
            device_id = -1
        if device_id < 0:
            raise DeviceError(f"CUDAExecutionProvider device_id must be a non-negative integer, not {raw!r}")
        return device_id
    return None


def cuda_first(providers) -> list:
    """The providers list with its CUDA entry (options kept) moved to the front, the rest in order.

    Over weights that live on the device, every node must go to the CUDA provider first: with the CPU
    provider ahead of it, ORT would give nodes to CPU kernels that then read device pointers (unmeasured:
    at best a copy to the host per weight, at worst a crash). shared/GPU.md checks get_providers()[0]."""
    entries = list(providers or ())
    names = [e if isinstance(e, str) else e[0] for e in entries]
    if "CUDAExecutionProvider" not in names:
        return entries
    i = names.index("CUDAExecutionProvider")
    return [entries[i], *entries[:i], *entries[i + 1:]]


def requested_device(providers) -> str | None:
    """The device to ask the daemon for: ``"cuda:<uuid>"`` when CUDAExecutionProvider is listed, else None.

    The index is mapped to a UUID here, in the client, because CUDA_VISIBLE_DEVICES may number devices
    differently in the daemon. With MODELCACHE_FAKE_GPUS set, CUDA is not touched: ``"cuda:fake-<id>"``.
    """
    device_id = cuda_device_id(providers)
    if device_id is None:
        return None
    spec = os.environ.get(FAKE_GPUS_ENV)
    if spec:
        count = fake_gpu_count(spec)
        if device_id >= count:
            raise DeviceError(f"CUDA device_id {device_id} asked for, but {FAKE_GPUS_ENV}={spec!r} declares {count}")
        return f"cuda:fake-{device_id}"
    return f"cuda:{cuda_runtime().uuid_of(device_id)}"


# -- the per-process handle cache ----------------------------------------------------------------------------

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


def _map_fake(path: str) -> tuple[int, int]:
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


class _OpenHandle:
    __slots__ = ("base", "size", "device_index", "refs")

    def __init__(self, base: int, size: int | None, device_index: int):
        self.base = base
        self.size = size  # bytes mapped (fake); None for CUDA, whose size the handle does not tell us
        self.device_index = device_index
        self.refs = 0


class HandleCache:
    """Device allocations this process has opened, by ``(kind, handle)``, with reference counts.

    A handle is opened once however many sessions use it (CUDA maps an allocation once per process)
    and closed when its last user releases it. All state is under one lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, bytes], _OpenHandle] = {}

    def acquire(self, kind: str, handle: bytes, device_index: int) -> int:
        """The base address of `handle`'s allocation, opening it if no one here holds it; counts one user."""
        key = (kind, bytes(handle))
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                if kind == "cuda":
                    runtime = cuda_runtime()
                    runtime.set_device(device_index)  # IPC memory is mapped into the current device
                    entry = _OpenHandle(runtime.ipc_open(key[1]), None, device_index)
                elif kind == "fake":
                    entry = _OpenHandle(*_map_fake(key[1].decode()), device_index)
                else:
                    raise ProtocolError(f"unknown device export kind {kind!r} (expected 'cuda' or 'fake')")
                self._open[key] = entry
            entry.refs += 1
            return entry.base

    def release(self, kind: str, handle: bytes) -> None:
        """Drop one user of `handle`; the last one closes it. Only after every OrtValue over it is gone."""
        key = (kind, bytes(handle))
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                raise DeviceError(f"release of a {kind} handle this process does not hold")
            entry.refs -= 1
            if entry.refs > 0:
                return
            del self._open[key]
            if kind == "cuda":
                runtime = cuda_runtime()
                runtime.set_device(entry.device_index)
                runtime.ipc_close(entry.base)
            elif _libc.munmap(entry.base, entry.size) != 0:
                raise DeviceError(f"munmap of fake device allocation failed: {os.strerror(ctypes.get_errno())}")

    def refs(self, kind: str, handle: bytes) -> int:
        """Users of `handle` in this process (0: not open)."""
        with self._lock:
            entry = self._open.get((kind, bytes(handle)))
            return entry.refs if entry else 0

    def size_of(self, kind: str, handle: bytes) -> int | None:
        with self._lock:
            entry = self._open.get((kind, bytes(handle)))
            return entry.size if entry else None


_cache = HandleCache()


def handle_cache() -> HandleCache:
    """The process-wide `HandleCache`."""
    return _cache


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


_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
# numpy dtype name -> (DLPack type code, bits)
_DLPACK_DTYPES = {
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


def _dlpack_value(ptr: int, dtype: str, shape: list, device_type: int, device_id: int):
    """An OrtValue over `ptr` (no copy). The DLManagedTensor and its shape live in one malloc'd block
    whose deleter is libc free: ORT takes it over in from_dlpack and frees it when the OrtValue dies."""
    make, legacy_bool = _ort_from_dlpack()
    code, bits = _DLPACK_DTYPES[dtype]
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


# -- attach -----------------------------------------------------------------------------------------------

class DeviceWeights:
    """What keeps device-resident initializers valid: the OrtValues and this process's handle references.

    Release only after every ORT session built with these values is gone: ORT holds raw pointers.
    If it is never released, the allocations stay mapped until the process exits (the safe failure).
    """

    def __init__(self, kind: str, device_uuid: str, device_index: int):
        self.kind = kind
        self.device_uuid = device_uuid
        self.device_index = device_index
        self.values: dict = {}  # initializer name -> OrtValue
        self._handles: list[bytes] = []  # one reference held on each

    def __repr__(self) -> str:
        return (f"DeviceWeights({self.kind}:{self.device_uuid}, device {self.device_index}, "
                f"{len(self.values)} values, {len(self._handles)} handles)")

    @property
    def provider_options(self):
        """The ORT provider entry that runs on this device."""
        if self.kind == "cuda":
            return ("CUDAExecutionProvider", {"device_id": self.device_index})
        return "CPUExecutionProvider"

    def release(self) -> None:
        """Drop the OrtValues (ORT frees their descriptors), then this object's handle references. Idempotent.
        Every handle is released even when one fails (after a sticky CUDA error every call fails); the
        first error is raised after."""
        self.values = {}
        handles, self._handles = self._handles, []
        first = None
        for handle in handles:
            try:
                _cache.release(self.kind, handle)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


def _check_tensor(row, n_handles: int) -> tuple:
    """A placement as the protocol checks it (an OpenReply's rows come checked), and mappable from a device."""
    if not isinstance(row, TensorPlacement):
        row = TensorPlacement.from_wire(row, n_handles)
    if row.dtype not in _DLPACK_DTYPES:
        raise ProtocolError(f"tensor {row.name!r}: dtype {row.dtype!r} cannot be mapped from a device "
                            f"(supported: {', '.join(_DLPACK_DTYPES)})")
    return row


def attach_weights(so, kind: str, device_uuid: str, handles: list, tensors: list) -> DeviceWeights:
    """Map the daemon's device export and give each tensor to `so` with ``add_initializer``, with no copy.

    `tensors` rows are ``[name, dtype, shape, handle index, offset, nbytes]``. On error everything taken
    here is released again and `so` must be discarded (it may hold pointers to dropped values).
    """
    if kind == "cuda":
        device_index = cuda_runtime().index_of(device_uuid)
        device_type, device_id = _KDL_CUDA, device_index
    elif kind == "fake":
        device_index = _fake_index(device_uuid)
        device_type, device_id = _KDL_CPU, 0  # fake devices live in host memory
    else:
        raise ProtocolError(f"unknown device export kind {kind!r} (expected 'cuda' or 'fake')")
    rows = [_check_tensor(row, len(handles)) for row in tensors]  # all checked before anything is opened

    weights = DeviceWeights(kind, device_uuid, device_index)
    try:
        bases, sizes = [], []
        for handle in handles:
            bases.append(_cache.acquire(kind, handle, device_index))
            weights._handles.append(bytes(handle))
            sizes.append(_cache.size_of(kind, handle))
        for name, dtype, shape, index, offset, nbytes in rows:
            size = sizes[index]
            if size is not None and offset + nbytes > size:
                raise ProtocolError(f"tensor {name!r}: bytes {offset}..{offset + nbytes} lie beyond the "
                                    f"{size}-byte allocation")
            ptr = bases[index] + offset
            value = _dlpack_value(ptr, dtype, shape, device_type, device_id)
            if nbytes and value.data_ptr() != ptr:
                raise DeviceError(f"onnxruntime copied tensor {name!r} instead of using the mapped memory")
            weights.values[name] = value
        for name, value in weights.values.items():
            so.add_initializer(name, value)
    except BaseException:
        weights.release()
        raise
    return weights
