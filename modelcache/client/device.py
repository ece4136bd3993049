"""The client's side of device-resident weights: map the daemon's exported allocations and hand ORT OrtValues over them.

Four kinds of export arrive in an open reply. ``"cuda"``: 64-byte ``cudaIpcMemHandle_t``s, opened with
the CUDA runtime binding (modelcache/cuda.py), read-write. ``"cuda-vmm"`` (gpu_sharing = "vmm-read-only"):
each allocation a file descriptor that came with the reply (SCM_RIGHTS), imported with the driver's
virtual memory API and mapped read-only (cuMemSetAccess PROT_READ); the handle is a token naming it.
``"fake"`` and ``"fake-vmm"``: a simulated device for machines without a GPU, each "allocation" a
shared-memory file by path, or a sealed memfd by descriptor, mapped read-only, with CPU OrtValues over
it; they exercise the same handle cache, DLPack and ``add_initializer`` path so that everything but the
CUDA calls is tested everywhere.

Lifetimes (GPU.md, "Measured on an H100"): a handle is opened once per process and closed when its last
user releases it (`HandleCache`); ORT keeps raw pointers into the mapping, so a `DeviceWeights` must be
released only after every session built over it is gone. A descriptor is closed as soon as its allocation
is mapped (or found mapped already): the mapping holds the memory, the daemon's allocation owns it.

Nothing here imports numpy, onnxruntime or cupy at module import time (client startup is measured).
"""

from __future__ import annotations

import os
import threading

from ..cuda import (DLPACK_DTYPES, KDL_CPU, KDL_CUDA, VMM_KINDS, DeviceError, cuda_driver, cuda_runtime, dlpack_value,
                    fake_index, map_fake, map_fake_fd, unmap_fake, vmm_token_size)
from ..errors import ProtocolError
from ..wire.protocol import TensorPlacement

__all__ = [
    "HandleCache", "handle_cache", "DeviceWeights", "attach_weights", "requested_device", "cuda_device_id",
    "cuda_first", "fake_gpu_count", "is_cuda_kind", "FAKE_GPUS_ENV", "KINDS",
]

# The daemon's `fake_gpus` setting as the environment gives it: clients read it too, to name a fake device.
FAKE_GPUS_ENV = "MODELCACHE_FAKE_GPUS"
KINDS = ("cuda", "cuda-vmm", "fake", "fake-vmm")   # the export kinds an open reply may name (ipc_kind)


def is_cuda_kind(kind: str) -> bool:
    """Whether an export kind is memory on a real GPU (else a simulated device's, in host memory)."""
    return kind in ("cuda", "cuda-vmm")


# -- device names -------------------------------------------------------------------------------------------

def fake_gpu_count(spec: str) -> int:
    """How many fake devices a MODELCACHE_FAKE_GPUS value declares, read as the daemon reads its `fake_gpus`
    setting: ``"2x256M"`` -> 2, ``"1G"`` -> 1."""
    from ..config import ConfigError, parse_fake_gpus   # here: only fake-GPU clients pay for importing config

    try:
        return parse_fake_gpus(spec)[0]
    except ConfigError as e:
        raise DeviceError(f"{FAKE_GPUS_ENV}={spec!r}: {e}") from None


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

class _OpenHandle:
    __slots__ = ("base", "size", "device_index", "refs")

    def __init__(self, base: int, size: int | None, device_index: int):
        self.base = base
        self.size = size  # bytes mapped; None for legacy CUDA IPC, whose size the handle does not tell us
        self.device_index = device_index
        self.refs = 0


def _unknown_kind(kind: str) -> ProtocolError:
    return ProtocolError(f"unknown device export kind {kind!r} (expected one of {', '.join(KINDS)})")


class HandleCache:
    """Device allocations this process has opened, by ``(kind, handle)``, with reference counts.

    A handle is opened once however many sessions use it (CUDA maps an allocation once per process)
    and closed when its last user releases it. All state is under one lock.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, bytes], _OpenHandle] = {}

    def acquire(self, kind: str, handle: bytes, device_index: int, fd: int = -1) -> int:
        """The base address of `handle`'s allocation, opening it if no one here holds it; counts one user.
        The fd-shared kinds (cuda.VMM_KINDS) map `fd`; it is closed here in every case (mapped, already
        mapped, or failed)."""
        key = (kind, bytes(handle))
        try:
            with self._lock:
                entry = self._open.get(key)
                if entry is None:
                    entry = self._open[key] = self._map(kind, key[1], device_index, fd)
                entry.refs += 1
                return entry.base
        finally:
            if fd >= 0:
                os.close(fd)

    @staticmethod
    def _map(kind: str, handle: bytes, device_index: int, fd: int) -> _OpenHandle:
        if kind in VMM_KINDS and fd < 0:
            raise ProtocolError(f"a {kind} allocation comes as a file descriptor on the lane, and none came")
        if kind == "cuda":
            runtime = cuda_runtime()
            runtime.set_device(device_index)  # IPC memory is mapped into the current device
            return _OpenHandle(runtime.ipc_open(handle), None, device_index)
        if kind == "cuda-vmm":
            size = vmm_token_size(handle)
            cuda_runtime().set_device(device_index)   # the device's context, that ORT's session will use
            driver = cuda_driver()
            imported = driver.import_fd(fd)
            try:
                base = driver.map(imported, size, device_index, read_only=True)
            finally:
                driver.release(imported)      # the mapping holds the allocation from here on
            return _OpenHandle(base, size, device_index)
        if kind == "fake":
            return _OpenHandle(*map_fake(handle.decode()), device_index)
        if kind == "fake-vmm":
            size = vmm_token_size(handle)
            return _OpenHandle(map_fake_fd(fd, size), size, device_index)
        raise _unknown_kind(kind)

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
            elif kind == "cuda-vmm":
                cuda_driver().unmap(entry.base, entry.size)
            else:
                unmap_fake(entry.base, entry.size)

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
        if is_cuda_kind(self.kind):
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
    if row.dtype not in DLPACK_DTYPES:
        raise ProtocolError(f"tensor {row.name!r}: dtype {row.dtype!r} cannot be mapped from a device "
                            f"(supported: {', '.join(DLPACK_DTYPES)})")
    return row


def attach_weights(so, kind: str, device_uuid: str, handles: list, tensors: list, fds: list = ()) -> DeviceWeights:
    """Map the daemon's device export and give each tensor to `so` with ``add_initializer``, with no copy.

    `tensors` rows are ``[name, dtype, shape, handle index, offset, nbytes]``; `fds`: for the fd-shared kinds,
    one descriptor per handle (the reply's `received_fds`), all closed here whatever happens. On error
    everything taken here is released again and `so` must be discarded (it may hold pointers to dropped values).
    """
    fds = list(fds)
    try:
        if kind not in KINDS:
            raise _unknown_kind(kind)
        if (kind in VMM_KINDS) != bool(fds) or (fds and len(fds) != len(handles)):
            raise ProtocolError(f"a {kind} export of {len(handles)} allocations came with {len(fds)} file "
                                "descriptors" + (" (one each is expected)" if kind in VMM_KINDS else ""))
        if is_cuda_kind(kind):
            device_index = cuda_runtime().index_of(device_uuid)
            device_type, device_id = KDL_CUDA, device_index
        else:
            device_index = fake_index(device_uuid)
            device_type, device_id = KDL_CPU, 0  # fake devices live in host memory
        rows = [_check_tensor(row, len(handles)) for row in tensors]  # all checked before anything is opened
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise

    weights = DeviceWeights(kind, device_uuid, device_index)
    try:
        bases, sizes = [], []
        for i, handle in enumerate(handles):
            fd = -1
            if fds:
                fd, fds[i] = fds[i], -1       # acquire closes it, whatever happens there
            bases.append(_cache.acquire(kind, handle, device_index, fd))
            weights._handles.append(bytes(handle))
            sizes.append(_cache.size_of(kind, handle))
        for name, dtype, shape, index, offset, nbytes in rows:
            size = sizes[index]
            if size is not None and offset + nbytes > size:
                raise ProtocolError(f"tensor {name!r}: bytes {offset}..{offset + nbytes} lie beyond the "
                                    f"{size}-byte allocation")
            ptr = bases[index] + offset
            value = dlpack_value(ptr, dtype, shape, device_type, device_id)
            if nbytes and value.data_ptr() != ptr:
                raise DeviceError(f"onnxruntime copied tensor {name!r} instead of using the mapped memory")
            weights.values[name] = value
        for name, value in weights.values.items():
            so.add_initializer(name, value)
    except BaseException:
        for fd in fds:
            if fd >= 0:   # (those not handed to acquire yet)
                os.close(fd)
        weights.release()
        raise
    return weights
