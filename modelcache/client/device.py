"""The client's side of device-resident weights: map the daemon's exported allocations and hand ORT OrtValues over them.

Two kinds of export arrive in an open reply. ``"cuda"``: 64-byte ``cudaIpcMemHandle_t``s, opened with
the CUDA runtime binding (modelcache/cuda.py). ``"fake"``: a simulated device for machines without a
GPU, where each "allocation" is a shared-memory file mapped read-only and values are CPU OrtValues; it
exercises the same handle cache, DLPack and ``add_initializer`` path so that everything but the CUDA
calls is tested everywhere.

Lifetimes (GPU.md, "Measured on an H100"): a handle is opened once per process and closed when its last
user releases it (`HandleCache`); ORT keeps raw pointers into the mapping, so a `DeviceWeights` must be
released only after every session built over it is gone.

Nothing here imports numpy, onnxruntime or cupy at module import time (client startup is measured).
"""

from __future__ import annotations

import os
import threading

from ..cuda import (DLPACK_DTYPES, KDL_CPU, KDL_CUDA, DeviceError, cuda_runtime, dlpack_value, fake_index, map_fake,
                    unmap_fake)
from ..errors import ProtocolError
from ..protocol import TensorPlacement

__all__ = [
    "HandleCache", "handle_cache", "DeviceWeights", "attach_weights", "requested_device", "cuda_device_id",
    "cuda_first", "fake_gpu_count", "FAKE_GPUS_ENV",
]

# The daemon's `fake_gpus` setting as the environment gives it: clients read it too, to name a fake device.
FAKE_GPUS_ENV = "MODELCACHE_FAKE_GPUS"


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
                    entry = _OpenHandle(*map_fake(key[1].decode()), device_index)
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
    if row.dtype not in DLPACK_DTYPES:
        raise ProtocolError(f"tensor {row.name!r}: dtype {row.dtype!r} cannot be mapped from a device "
                            f"(supported: {', '.join(DLPACK_DTYPES)})")
    return row


def attach_weights(so, kind: str, device_uuid: str, handles: list, tensors: list) -> DeviceWeights:
    """Map the daemon's device export and give each tensor to `so` with ``add_initializer``, with no copy.

    `tensors` rows are ``[name, dtype, shape, handle index, offset, nbytes]``. On error everything taken
    here is released again and `so` must be discarded (it may hold pointers to dropped values).
    """
    if kind == "cuda":
        device_index = cuda_runtime().index_of(device_uuid)
        device_type, device_id = KDL_CUDA, device_index
    elif kind == "fake":
        device_index = fake_index(device_uuid)
        device_type, device_id = KDL_CPU, 0  # fake devices live in host memory
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
            value = dlpack_value(ptr, dtype, shape, device_type, device_id)
            if nbytes and value.data_ptr() != ptr:
                raise DeviceError(f"onnxruntime copied tensor {name!r} instead of using the mapped memory")
            weights.values[name] = value
        for name, value in weights.values.items():
            so.add_initializer(name, value)
    except BaseException:
        weights.release()
        raise
    return weights
