"""Device tier contract: promotion from a real host tier, dedup, accounting, export and cleanup.

The same suite runs against every allocator: the fake ones (shared-memory files; sealed memfds,
for gpu_sharing = "vmm-read-only"), the CUDA one over an emulated cupy runtime (both of its copy
paths: registered host mappings, and the pinned staging ring the driver may force), the CUDA VMM
one over that runtime and an emulated driver, and the CUDA ones on a real device where cupy and a
GPU exist (`-m gpu`; skipped elsewhere).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import onnx
import pytest

from modelcache import zoo
from modelcache.config import ConfigError
from modelcache.cuda import (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, DeviceError,
                             CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, vmm_token_size)
from modelcache.store.packing import pack
from modelcache.tiers import gpu
from modelcache.tiers.host import HostTier

from test_tiers import variant

FAKE_DEVICE_BYTES = 64 << 20
CAPACITY_BYTES = 32 << 20


# -- an emulated cupy.cuda.runtime ------------------------------------------------------------

class EmulatedCudaRuntime:
    """Just enough of cupy.cuda.runtime for CudaAllocator, stricter than the real one where it matters.

    Async copies run only when a stream or event is synchronized, so a staging buffer
    refilled too early, or a mapping unpinned too early, corrupts or trips what lands on
    the "device". A host → device copy must read pinned memory (registered or
    hostAlloc'd), and every call needs setDevice earlier in its own thread.
    """

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2
    hostAllocDefault = 0
    streamNonBlocking = 1
    eventDisableTiming = 2

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            super().__init__(f"emulated CUDA error {status}")
            self.status = status

    def __init__(self, total_bytes: int, device_index: int = 0, refuse_register: bool = False):
        self.total_bytes, self.device_index, self.refuse_register = total_bytes, device_index, refuse_register
        self.device_mem: dict[int, ctypes.Array] = {}   # ptr -> buffer playing device memory
        self.pinned: dict[int, int] = {}                 # ptr -> size: registered or hostAlloc'd host memory
        self._host_allocs: dict[int, ctypes.Array] = {}
        self.streams: dict[int, dict] = {}               # stream -> {"ops": [(dst, src, n)], "done": int}
        self.events: dict[int, tuple | None] = {}        # event -> (stream, ops count at record)
        self.calls: list[str] = []
        self._current = threading.local()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _call(self, name: str) -> None:
        assert getattr(self._current, "device", None) == self.device_index, f"{name} before setDevice in this thread"
        with self._lock:
            self.calls.append(name)

    def _run(self, stream: int, upto: int | None = None) -> None:
        s = self.streams[stream]
        upto = len(s["ops"]) if upto is None else upto
        while s["done"] < upto:
            dst, src, n = s["ops"][s["done"]]
            assert self._inside(self.pinned, src, n), "a queued copy reads host memory that is no longer pinned"
            ctypes.memmove(dst, src, n)
            s["done"] += 1

    def _pending(self):
        return [op for s in self.streams.values() for op in s["ops"][s["done"]:]]

    @staticmethod
    def _inside(regions: dict, ptr: int, n: int) -> bool:
        return any(base <= ptr and ptr + n <= base + size for base, size in regions.items())

    def setDevice(self, index: int) -> None:
        self._current.device = index

    def deviceGetAttribute(self, attr: int, device: int) -> int:
        self._call("deviceGetAttribute")
        assert attr == gpu.CUDA_DEV_ATTR_HOST_REGISTER_READ_ONLY and device == self.device_index
        return 1

    def malloc(self, size: int) -> int:
        self._call("malloc")
        if sum(len(b) for b in self.device_mem.values()) + size > self.total_bytes:
            raise self.CUDARuntimeError(gpu.CUDA_ERROR_MEMORY_ALLOCATION)
        buf = (ctypes.c_char * size)()
        self.device_mem[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, ptr: int) -> None:
        self._call("free")
        assert not any(self._inside({ptr: len(self.device_mem[ptr])}, dst, n) for dst, _, n in self._pending())
        del self.device_mem[ptr]

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        self._call("ipcGetMemHandle")
        assert ptr in self.device_mem, "an IPC handle is for the base of a cudaMalloc allocation"
        return ptr.to_bytes(8, "little") + bytes(56)

    def memGetInfo(self):
        self._call("memGetInfo")
        return self.total_bytes - sum(len(b) for b in self.device_mem.values()), self.total_bytes

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        self._call("hostRegister")
        assert flags & gpu.CUDA_HOST_REGISTER_READ_ONLY, "host-tier mappings are read-only"
        if self.refuse_register:
            raise self.CUDARuntimeError(801)          # cudaErrorNotSupported
        ctypes.string_at(ptr, 1), ctypes.string_at(ptr + size - 1, 1)   # the whole span is mapped
        self.pinned[ptr] = size

    def hostUnregister(self, ptr: int) -> None:
        self._call("hostUnregister")
        size = self.pinned.pop(ptr)
        assert not any(self._inside({ptr: size}, src, n) for _, src, n in self._pending()), \
            "unregistered while a copy from it was still queued"

    def hostAlloc(self, size: int, flags: int) -> int:
        self._call("hostAlloc")
        buf = (ctypes.c_char * size)()
        self._host_allocs[ctypes.addressof(buf)] = buf
        self.pinned[ctypes.addressof(buf)] = size
        return ctypes.addressof(buf)

    def freeHost(self, ptr: int) -> None:
        self._call("freeHost")
        self.hostUnregister(ptr)
        del self._host_allocs[ptr]

    def streamCreateWithFlags(self, flags: int) -> int:
        self._call("streamCreateWithFlags")
        stream = next(self._ids)
        self.streams[stream] = {"ops": [], "done": 0}
        return stream

    def streamSynchronize(self, stream: int) -> None:
        self._call("streamSynchronize")
        self._run(stream)

    def streamDestroy(self, stream: int) -> None:
        self._call("streamDestroy")
        s = self.streams.pop(stream)
        assert s["done"] == len(s["ops"]), "stream destroyed with copies queued"

    def eventCreateWithFlags(self, flags: int) -> int:
        self._call("eventCreateWithFlags")
        event = next(self._ids)
        self.events[event] = None
        return event

    def eventRecord(self, event: int, stream: int) -> None:
        self._call("eventRecord")
        self.events[event] = (stream, len(self.streams[stream]["ops"]))

    def eventSynchronize(self, event: int) -> None:
        self._call("eventSynchronize")
        if self.events[event] is not None:
            self._run(*self.events[event])

    def eventDestroy(self, event: int) -> None:
        self._call("eventDestroy")
        del self.events[event]

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._call("memcpyAsync")
        assert kind == self.memcpyHostToDevice and self._inside(self.pinned, src, size), "not a pinned host copy"
        assert self._inside({p: len(b) for p, b in self.device_mem.items()}, dst, size), "outside device memory"
        self.streams[stream]["ops"].append((dst, src, size))

    def memcpy(self, dst: int, src: int, size: int, kind: int) -> None:
        self._call("memcpy")
        assert kind == self.memcpyDeviceToHost
        ctypes.memmove(dst, src, size)


class EmulatedCudaDriver:
    """Just enough of cuda.CudaDriver for CudaVmmAllocator: physical allocations in host memory, counted against the
    runtime's device, mapped at their own address (a read-write mapping is device memory to the emulated runtime's
    copies), exported as real descriptors (memfds) so that a leaked one shows. Refuses what the real one would:
    sizes off the granularity, a second mapping of an allocation, an unmap of what is not mapped."""

    def __init__(self, runtime: EmulatedCudaRuntime, granularity: int = 4 << 10, vmm: int = 1, posix_fd: int = 1,
                 refuse_export: bool = False):
        self.rt, self.granularity_bytes, self.refuse_export = runtime, granularity, refuse_export
        self.attributes = {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: vmm,
                           CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: posix_fd}
        self.physical: dict[int, ctypes.Array] = {}    # handle -> the memory
        self.mapped: dict[int, tuple] = {}             # address -> (handle, read_only)
        self.exported: list[tuple] = []                # (descriptor, its inode) of each one handed out
        self._ids = itertools.count(1)

    @staticmethod
    def _error(status: int, call: str):
        error = DeviceError(f"{call} failed: emulated CUDA error {status}")
        error.status = status
        return error

    def attribute(self, attribute: int, index: int) -> int:
        return self.attributes[attribute]

    def granularity(self, index: int) -> int:
        return self.granularity_bytes

    def create(self, nbytes: int, index: int) -> int:
        assert nbytes > 0 and nbytes % self.granularity_bytes == 0, "cuMemCreate of a size off the granularity"
        used = sum(len(b) for b in self.physical.values()) + \
            sum(len(b) for a, b in self.rt.device_mem.items() if a not in self.mapped)
        if used + nbytes > self.rt.total_bytes:
            raise self._error(gpu.CUDA_ERROR_MEMORY_ALLOCATION, "cuMemCreate")
        handle = next(self._ids)
        self.physical[handle] = (ctypes.c_char * nbytes)()
        return handle

    def release(self, handle: int) -> None:
        assert handle in self.physical, "cuMemRelease of an unknown handle"
        assert not any(h == handle for h, _ in self.mapped.values()), "released while mapped (the test's order)"
        del self.physical[handle]

    def export_fd(self, handle: int) -> int:
        assert handle in self.physical
        if self.refuse_export:
            raise self._error(801, "cuMemExportToShareableHandle")     # CUDA_ERROR_NOT_SUPPORTED
        fd = os.memfd_create("emulated-vmm-export", os.MFD_CLOEXEC)
        self.exported.append((fd, os.fstat(fd).st_ino))
        return fd

    def map(self, handle: int, nbytes: int, index: int, read_only: bool) -> int:
        buf = self.physical[handle]
        assert nbytes == len(buf) and not read_only, "the daemon maps a whole allocation, read-write"
        address = ctypes.addressof(buf)
        assert address not in self.mapped, "mapped twice"
        self.mapped[address] = (handle, read_only)
        self.rt.device_mem[address] = buf               # the runtime's copies may land here now
        return address

    def unmap(self, va: int, nbytes: int) -> None:
        handle, _ = self.mapped.pop(va)
        assert nbytes == len(self.physical[handle])
        del self.rt.device_mem[va]

    def open_exports(self) -> list[int]:
        """Exported descriptors still open."""
        out = []
        for fd, inode in self.exported:   # (a closed one's number may be taken again, by another file)
            try:
                if os.fstat(fd).st_ino == inode:
                    out.append(fd)
            except OSError:
                pass
        return out


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed_models(tmp_path_factory):
    """name -> (packed dir, manifest): tiny-cnn, and two tiny-vit variants sharing ~87 % of their tensors."""
    root = tmp_path_factory.mktemp("gpu-zoo")
    out = {}
    for name, model in [("cnn", zoo.build("tiny-cnn")), ("a", variant(0)), ("b", variant(1, change_last=2))]:
        onnx.save(model, str(root / f"{name}.onnx"))
        out[name] = (root / "repo" / name / "1", pack(str(root / f"{name}.onnx"), root / "repo", name, 1))
    return out


def make_allocator(kind: str, host: HostTier, total_bytes: int = FAKE_DEVICE_BYTES):
    if kind == "fake":
        return gpu.FakeAllocator(gpu.fake_devices(str(total_bytes))[0], host.root / "gpu-0")
    if kind == "fake-vmm":
        return gpu.FakeVmmAllocator(gpu.fake_devices(str(total_bytes))[0])
    if kind in ("cuda", "cuda-vmm"):
        devices = gpu.probe()
        if not devices:
            pytest.skip("no CUDA device (or no cupy)")
        return gpu.CudaAllocator(devices[0]) if kind == "cuda" else gpu.CudaVmmAllocator(devices[0])
    runtime = EmulatedCudaRuntime(total_bytes, refuse_register=kind == "cuda-emulated-staging")
    device = gpu.GpuDevice(0, "emulated-0", "emulated", total_bytes)
    if kind == "cuda-vmm-emulated":
        allocator = gpu.CudaVmmAllocator(device, runtime=runtime, driver=EmulatedCudaDriver(runtime))
    else:
        allocator = gpu.CudaAllocator(device, runtime=runtime)
    allocator.STAGING_BYTES = 16 << 10      # small: tensors span several buffers and the ring wraps
    return allocator


def live_allocations(allocator) -> int | None:
    """How many allocations the allocator still holds, where this can be seen (not on a real GPU)."""
    if isinstance(allocator, gpu.FakeVmmAllocator):
        return len(allocator._local)
    if isinstance(allocator, gpu.FakeAllocator):
        return len(list(allocator.directory.glob("*"))) if allocator.directory.exists() else 0
    if isinstance(getattr(allocator, "_drv", None), EmulatedCudaDriver):
        assert len(allocator._drv.open_exports()) == len(allocator._drv.physical), "an export outlived its memory"
        return len(allocator._drv.physical)
    if isinstance(getattr(allocator, "_rt", None), EmulatedCudaRuntime):
        return len(allocator._rt.device_mem)
    return None


ALLOCATORS = ["fake", "fake-vmm", "cuda-emulated", "cuda-emulated-staging", "cuda-vmm-emulated",
              pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-vmm", marks=pytest.mark.gpu)]


@pytest.fixture(params=ALLOCATORS)
def allocator(request, host):
    return make_allocator(request.param, host)


@pytest.fixture
def tier(allocator):
    tier = gpu.DeviceTier(allocator, CAPACITY_BYTES)
    yield tier
    tier.stop()     # frees real device memory whatever the test did


@pytest.fixture
def loader():
    """The loader thread: write runs here, as in the daemon, so per-thread CUDA state is exercised."""
    with ThreadPoolExecutor(1, thread_name_prefix="loader") as pool:
        yield pool


def on_host(host: HostTier, key: str, model) -> dict:
    model_dir, manifest = model
    plan = host.plan_from(key, model_dir, manifest)
    host.write(plan)
    host.commit(plan)
    return host.file_locations(key, "cpu")


def promote_to_device(tier, loader, key, manifest, locations) -> gpu.DevicePlan:
    plan = tier.plan_tensors(key, manifest.tensors, locations)
    loader.submit(tier.write, plan).result()
    tier.commit(plan)
    return plan


def device_bytes(tier, key: str) -> dict[str, bytes]:
    """tensor name -> its bytes as they are on the device, read through what export publishes."""
    handles, tensors = tier.handles(key)
    assert all(offset % gpu.DEVICE_ALIGN == 0 for *_, offset, _ in tensors), "a tensor off the 256-byte grid"
    by_handle = {a.allocation.handle: a.allocation for a in tier.arenas.values()}
    return {name: tier.allocator.copy_out(by_handle[handles[slot]], offset, nbytes)
            for name, _, _, slot, offset, nbytes in tensors}


def disk_bytes(model) -> dict[str, bytes]:
    model_dir, manifest = model
    blob = (model_dir / "weights.bin").read_bytes()
    return {t.name: blob[t.offset:t.offset + t.nbytes] for t in manifest.tensors}


# -- the contract -------------------------------------------------------------------------------

def test_promotion_puts_the_host_bytes_on_the_device(tier, host, loader, packed_models):
    model = packed_models["a"]
    manifest = model[1]
    plan = promote_to_device(tier, loader, "a@1", manifest, on_host(host, "a@1", model))
    assert device_bytes(tier, "a@1") == disk_bytes(model)
    handles, tensors = tier.handles("a@1")
    assert len(handles) == 1 and [t[0] for t in tensors] == [t.name for t in manifest.tensors]
    spans = sorted((off, off + n) for *_, off, n in tensors)
    assert all(off % gpu.DEVICE_ALIGN == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "tensors overlap on the device"
    # 256-byte packing is tighter than the host's page alignment, never looser than the tensors; a VMM allocation
    # takes whole granules (what the tier counts).
    assert sum(t.nbytes for t in manifest.tensors) <= plan.arena_bytes
    assert tier.used_bytes == tier.model_bytes("a@1") == plan.arena_bytes == tier.allocator.rounded(spans[-1][1])
    if tier.allocator.sharing == "ipc":
        assert plan.arena_bytes < host.used_bytes
    assert tier.free_bytes == tier.capacity_bytes - plan.arena_bytes
    assert tier.promotion_bytes_per_s > 0 and plan.copied_bytes == sum(t.nbytes for t in manifest.tensors)
    assert live_allocations(tier.allocator) in (1, None)


def test_tensors_shared_with_a_resident_model_are_not_copied_again(tier, host, loader, packed_models):
    pa = promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    pb = promote_to_device(tier, loader, "b@1", packed_models["b"][1], on_host(host, "b@1", packed_models["b"]))
    assert 0 < pb.arena_bytes < 0.2 * pa.arena_bytes          # b copied only what differs (~13 %)
    assert pb.copied_bytes < 0.2 * pa.copied_bytes
    assert tier.used_bytes == pa.arena_bytes + pb.arena_bytes
    assert device_bytes(tier, "b@1") == disk_bytes(packed_models["b"])
    handles_a, _ = tier.handles("a@1")
    handles_b, tensors_b = tier.handles("b@1")
    assert len(handles_b) == 2 and handles_b[0] == handles_a[0] != handles_b[1]   # a's arena first
    assert {slot for _, _, _, slot, _, _ in tensors_b} == {0, 1}
    assert live_allocations(tier.allocator) in (2, None)


def test_bytes_freed_by_counts_shared_arenas_once_all_their_users_go(tier, host, loader, packed_models):
    pa = promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    pb = promote_to_device(tier, loader, "b@1", packed_models["b"][1], on_host(host, "b@1", packed_models["b"]))
    assert tier.bytes_freed_by(["a@1"]) == 0                 # b still uses a's arena
    assert tier.bytes_freed_by(["b@1"]) == pb.arena_bytes
    assert tier.bytes_freed_by(["a@1", "b@1"]) == tier.used_bytes == pa.arena_bytes + pb.arena_bytes
    assert tier.model_bytes("a@1") == pa.arena_bytes and tier.model_bytes("b@1") == tier.used_bytes
    # Evicting a frees nothing; b's weights stay where export said they are.
    assert tier.free_model("a@1") == 0
    assert "a@1" not in tier.models and device_bytes(tier, "b@1") == disk_bytes(packed_models["b"])
    assert tier.free_model("b@1") == pa.arena_bytes + pb.arena_bytes
    assert tier.used_bytes == 0 and tier.arenas == {} and tier.index == {}
    assert live_allocations(tier.allocator) in (0, None)


def test_the_same_tensor_twice_in_one_model_is_stored_once(tier, host, loader, packed_models):
    model = packed_models["cnn"]
    locations = on_host(host, "cnn@1", model)
    tensors = model[1].tensors
    twice = tensors + [replace(tensors[1], name="alias")]    # same sha256, another name; no host location needed
    plan = tier.plan_tensors("cnn@1", twice, locations)
    loader.submit(tier.write, plan).result()
    tier.commit(plan)
    assert plan.locations["alias"] == plan.locations[tensors[1].name]
    assert len(plan.copies) == len(tensors)
    assert tier.used_bytes == plan.arena_bytes < sum(t.nbytes for t in twice)
    assert device_bytes(tier, "cnn@1")["alias"] == disk_bytes(model)[tensors[1].name]


def test_plan_reserves_and_abort_releases(tier, host, loader, packed_models):
    locations = on_host(host, "a@1", packed_models["a"])
    plan = tier.plan_tensors("a@1", packed_models["a"][1].tensors, locations)
    assert tier.used_bytes == plan.arena_bytes > 0             # reserved before a byte is written
    assert live_allocations(tier.allocator) in (0, None)        # ... and before anything is allocated
    tier.abort(plan)
    assert tier.used_bytes == 0 and tier.arenas == {} and "a@1" not in tier.models
    # Aborted after its write (a refused load): the allocation goes too.
    plan = tier.plan_tensors("a@1", packed_models["a"][1].tensors, locations)
    loader.submit(tier.write, plan).result()
    assert live_allocations(tier.allocator) in (1, None)
    tier.abort(plan)
    assert tier.used_bytes == 0 and tier.arenas == {}
    assert live_allocations(tier.allocator) in (0, None)


def test_abort_keeps_the_arenas_other_models_use(tier, host, loader, packed_models):
    pa = promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    plan = tier.plan_tensors("b@1", packed_models["b"][1].tensors, on_host(host, "b@1", packed_models["b"]))
    assert tier.bytes_freed_by(["a@1"]) == 0                   # b's load holds a's arena
    loader.submit(tier.write, plan).result()
    tier.abort(plan)
    assert tier.used_bytes == pa.arena_bytes and tier.bytes_freed_by(["a@1"]) == pa.arena_bytes
    assert [a.users for a in tier.arenas.values()] == [{"a@1"}]
    assert device_bytes(tier, "a@1") == disk_bytes(packed_models["a"])


def test_a_failed_write_leaves_nothing_allocated(tier, host, loader, packed_models):
    locations = on_host(host, "a@1", packed_models["a"])
    gone = {name: (str(host.root / "no-such-segment.bin"), off) for name, (_, off) in locations.items()}
    plan = tier.plan_tensors("a@1", packed_models["a"][1].tensors, gone)
    with pytest.raises(FileNotFoundError):
        loader.submit(tier.write, plan).result()
    assert plan.allocation is None and live_allocations(tier.allocator) in (0, None)
    tier.abort(plan)
    assert tier.used_bytes == 0


def test_plan_refuses_a_tensor_missing_from_the_host_tier(tier, packed_models):
    with pytest.raises(ValueError, match="not resident in the host tier"):
        tier.plan_tensors("a@1", packed_models["a"][1].tensors, {})
    assert tier.used_bytes == 0 and tier.arenas == {}


def test_capacity_accounting(tier, host, loader, packed_models):
    assert gpu.DeviceTier(tier.allocator, 1 << 50).capacity_bytes == tier.device.total_bytes
    small = gpu.DeviceTier(tier.allocator, 64 << 10)            # less than tiny-vit's 300 KiB
    plan = small.plan_tensors("a@1", packed_models["a"][1].tensors, on_host(host, "a@1", packed_models["a"]))
    assert small.free_bytes == (64 << 10) - plan.arena_bytes < 0   # over: the daemon evicts or aborts
    small.abort(plan)
    assert small.free_bytes == 64 << 10


@pytest.mark.parametrize("kind", ["fake", "fake-vmm", "cuda-emulated", "cuda-vmm-emulated"])
def test_a_full_device_refuses_the_allocation(kind, host, loader, packed_models):
    allocator = make_allocator(kind, host, total_bytes=64 << 10)
    tier = gpu.DeviceTier(allocator, 1 << 30)
    plan = tier.plan_tensors("a@1", packed_models["a"][1].tensors, on_host(host, "a@1", packed_models["a"]))
    with pytest.raises(gpu.DeviceMemoryError):
        loader.submit(tier.write, plan).result()
    tier.abort(plan)
    assert tier.used_bytes == 0 and live_allocations(allocator) == 0
    assert allocator.mem_info() == (64 << 10, 64 << 10)
    tier.stop()


def test_stop_leaves_nothing_behind(tier, host, loader, packed_models):
    promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    promote_to_device(tier, loader, "b@1", packed_models["b"][1], on_host(host, "b@1", packed_models["b"]))
    in_flight = tier.plan_tensors("cnn@1", packed_models["cnn"][1].tensors, on_host(host, "cnn@1", packed_models["cnn"]))
    loader.submit(tier.write, in_flight).result()               # written, never committed
    tier.stop()
    assert tier.used_bytes == 0 and tier.models == {} and tier.arenas == {}
    assert live_allocations(tier.allocator) in (0, None)
    if isinstance(tier.allocator, gpu.FakeAllocator) and tier.allocator.directory is not None:
        assert not tier.allocator.directory.exists()
    runtime = getattr(tier.allocator, "_rt", None)
    if isinstance(runtime, EmulatedCudaRuntime):
        assert runtime.pinned == {} and runtime.streams == {} and runtime.events == {}


# -- allocator specifics ------------------------------------------------------------------------

def test_fake_handles_are_files_a_client_maps(host, loader, packed_models):
    import mmap
    tier = gpu.DeviceTier(make_allocator("fake", host), CAPACITY_BYTES)
    promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    handles, tensors = tier.handles("a@1")
    path = Path(handles[0].decode())
    assert path.is_absolute() and path.parent == host.root / "gpu-0"
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        got = {name: m[off:off + n] for name, _, _, _, off, n in tensors}
    assert got == disk_bytes(packed_models["a"])
    tier.stop()
    assert not path.exists()


def test_cuda_copies_from_registered_host_mappings(host, loader, packed_models):
    tier = gpu.DeviceTier(make_allocator("cuda-emulated", host), CAPACITY_BYTES)
    runtime = tier.allocator._rt
    plan = promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    assert runtime.calls.count("hostRegister") == runtime.calls.count("hostUnregister") == 1   # one host segment
    assert "hostAlloc" not in runtime.calls
    # Coalesced: fewer transfers than tensors (tiny-vit has runs contiguous on both sides).
    assert runtime.calls.count("memcpyAsync") == len(gpu._coalesce([c[:4] for c in plan.copies])) < len(plan.copies)
    tier.stop()


def test_cuda_falls_back_to_a_pinned_staging_ring_when_registration_is_refused(host, loader, packed_models):
    tier = gpu.DeviceTier(make_allocator("cuda-emulated-staging", host), CAPACITY_BYTES)
    runtime = tier.allocator._rt
    promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    promote_to_device(tier, loader, "cnn@1", packed_models["cnn"][1], on_host(host, "cnn@1", packed_models["cnn"]))
    assert runtime.calls.count("hostRegister") == 1            # refused once, not asked again
    assert runtime.calls.count("hostAlloc") == tier.allocator.STAGING_BUFFERS   # one ring, kept
    assert runtime.calls.count("eventSynchronize") > 0         # the ring wrapped and waited
    assert device_bytes(tier, "a@1") == disk_bytes(packed_models["a"])
    assert device_bytes(tier, "cnn@1") == disk_bytes(packed_models["cnn"])
    tier.stop()
    assert runtime.pinned == {}


def test_the_staging_ring_is_idle_when_a_copy_hands_it_on(host, packed_models):
    # Another loader thread takes the ring next, on a stream of its own: nothing of ours may still read it.
    allocator = make_allocator("cuda-emulated-staging", host)
    runtime = allocator._rt
    locations = on_host(host, "a@1", packed_models["a"])
    path = next(iter(locations.values()))[0]
    copies = [(off, i * 65536, t.nbytes) for i, t in enumerate(packed_models["a"][1].tensors)
              for _, off in [locations[t.name]]]
    allocation = allocator.alloc(len(copies) * 65536)
    stream = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
    allocator._copy_via_staging(stream, allocation, path, copies)
    assert runtime.calls.count("memcpyAsync") > allocator.STAGING_BUFFERS and runtime._pending() == []
    runtime.streamDestroy(stream)
    allocator.free(allocation)
    allocator.close()


def test_concurrent_writes_on_two_loader_threads(tier, host, packed_models):
    plans = [tier.plan_tensors(key, packed_models[name][1].tensors, on_host(host, key, packed_models[name]))
             for name, key in [("a", "a@1"), ("cnn", "cnn@1")]]
    with ThreadPoolExecutor(2) as loaders:
        for future in [loaders.submit(tier.write, plan) for plan in plans]:
            future.result()
    for plan in plans:
        tier.commit(plan)
    assert device_bytes(tier, "a@1") == disk_bytes(packed_models["a"])
    assert device_bytes(tier, "cnn@1") == disk_bytes(packed_models["cnn"])


def test_coalesce_merges_only_ranges_contiguous_on_both_sides():
    copies = [(0, 8192, 512, 256), (0, 0, 0, 512), (1, 512, 768, 100), (0, 512, 768, 100)]
    assert gpu._coalesce(copies) == [(0, 0, 0, 512), (0, 8192, 512, 256), (0, 512, 768, 100), (1, 512, 768, 100)]
    assert gpu._coalesce([(0, 0, 0, 4096), (0, 4096, 4096, 10)]) == [(0, 0, 0, 4106)]


def test_host_file_locations_point_at_the_host_tiers_segments(host, packed_models):
    locations = on_host(host, "a@1", packed_models["a"])
    _, segments, tensors = host.layout("a@1", packed_models["a"][1])
    assert locations == {name: (segments[seg], off) for name, _, _, seg, off, _ in tensors}


def test_fake_devices():
    two = gpu.fake_devices("2x256M")
    assert [(d.index, d.uuid, d.name, d.total_bytes) for d in two] == [
        (0, "fake-0", "fake-gpu", 256 << 20), (1, "fake-1", "fake-gpu", 256 << 20)]
    assert [d.total_bytes for d in gpu.fake_devices("1G")] == [1 << 30]
    assert gpu.fake_devices("") == [] and gpu.fake_devices("none") == []
    for bad in ("twox1G", "0x1G", "2xlots"):
        with pytest.raises(ConfigError):
            gpu.fake_devices(bad)


def test_allocator_for_picks_the_fake_one_for_fake_devices(tmp_path):
    allocator = gpu.allocator_for(gpu.fake_devices("1M")[0], tmp_path / "gpu-0")
    assert allocator.kind == "fake" and allocator.mem_info() == (1 << 20, 1 << 20)


def test_fake_local_address_maps_the_arena_once_and_free_unmaps_it(host, loader, packed_models):
    """What the daemon's own GPU workers read: the arena's bytes at an address of this process."""
    tier = gpu.DeviceTier(make_allocator("fake", host), CAPACITY_BYTES)
    promote_to_device(tier, loader, "cnn@1", packed_models["cnn"][1], on_host(host, "cnn@1", packed_models["cnn"]))
    rows = tier.local_tensors("cnn@1")
    assert [r[0] for r in rows] == [t.name for t in packed_models["cnn"][1].tensors]
    want = disk_bytes(packed_models["cnn"])
    for name, _, _, address, nbytes in rows:
        assert ctypes.string_at(address, nbytes) == want[name]
    assert tier.local_tensors("cnn@1", {rows[0][0]}) == rows[:1]
    [allocation] = [a.allocation for a in tier.arenas.values()]
    assert tier.allocator.local_address(allocation) == tier.allocator.local_address(allocation)   # mapped once
    tier.free_model("cnn@1")
    assert not tier.allocator._local
    tier.stop()


# -- read-only sharing (gpu_sharing = "vmm-read-only") -----------------------------------------------------

def emulated_vmm(total_bytes: int = FAKE_DEVICE_BYTES, **driver_kw):
    runtime = EmulatedCudaRuntime(total_bytes)
    driver = EmulatedCudaDriver(runtime, **driver_kw)
    return gpu.GpuDevice(0, "emulated-0", "emulated", total_bytes), runtime, driver


def test_cuda_vmm_allocations_are_whole_granules_exported_once_and_freed_whole():
    device, runtime, driver = emulated_vmm(granularity=64 << 10)
    allocator = gpu.CudaVmmAllocator(device, runtime=runtime, driver=driver)
    assert driver.physical == {} and driver.open_exports() == []      # the probe at start left nothing
    assert allocator.kind == "cuda-vmm" and allocator.sharing == "vmm-read-only" and allocator.sharing_note == ""
    assert allocator.rounded(1) == allocator.rounded(64 << 10) == 64 << 10
    assert allocator.rounded((64 << 10) + 1) == 128 << 10
    a = allocator.alloc(1000)
    assert a.nbytes == 64 << 10 and allocator.local_address(a) == a.ptr
    assert list(driver.mapped.values()) == [(1 + 1, False)]           # (handle 1 was the probe's) read-write
    assert driver.open_exports() == [a.fd] and vmm_token_size(a.handle) == a.nbytes
    b = allocator.alloc(64 << 10)
    assert a.handle != b.handle and len(a.handle) == len(b.handle) == 32
    assert runtime.memGetInfo() == (FAKE_DEVICE_BYTES - (128 << 10), FAKE_DEVICE_BYTES)
    allocator.free(a)
    allocator.free(b)
    assert driver.physical == {} and driver.mapped == {} and driver.open_exports() == []
    with pytest.raises(OSError):
        os.fstat(a.fd)


@pytest.mark.parametrize("refusal, says", [
    ({"vmm": 0}, "does not support virtual memory management"),
    ({"posix_fd": 0}, "does not support POSIX file descriptor handles"),
    ({"refuse_export": True}, "cuMemExportToShareableHandle failed"),
])
def test_where_the_driver_refuses_vmm_the_allocator_falls_back_to_ipc_and_says_why(refusal, says, tmp_path, caplog):
    device, runtime, driver = emulated_vmm(**refusal)
    allocator = gpu.allocator_for(device, tmp_path, "vmm-read-only", runtime=runtime, driver=driver)
    assert allocator.kind == "cuda" and allocator.sharing == "ipc"
    assert allocator.sharing_note.startswith("vmm-read-only refused by the driver: ") and says in allocator.sharing_note
    warnings = [r.getMessage() for r in caplog.records]
    assert any("refused by the driver, so clients map its weights read-write" in w and says in w for w in warnings)
    assert driver.physical == {} and driver.open_exports() == []      # the probe's allocation went too
    ok = gpu.allocator_for(device, tmp_path, "vmm-read-only", runtime=runtime, driver=EmulatedCudaDriver(runtime))
    assert ok.kind == "cuda-vmm"
    assert gpu.allocator_for(device, tmp_path, "ipc", runtime=runtime).kind == "cuda"
    with pytest.raises(ValueError, match="gpu_sharing must be one of ipc, vmm-read-only"):
        gpu.allocator_for(device, tmp_path, "shared")


def test_allocator_for_gives_fake_devices_memfds_under_vmm(tmp_path):
    device = gpu.fake_devices("1M")[0]
    allocator = gpu.allocator_for(device, tmp_path / "gpu-0", "vmm-read-only")
    assert allocator.kind == "fake-vmm" and allocator.sharing == "vmm-read-only" and not (tmp_path / "gpu-0").exists()
    assert allocator.mem_info() == (1 << 20, 1 << 20)


def test_fake_vmm_memory_is_writable_in_the_daemon_alone(host, loader, packed_models):
    """The memfd is sealed: the daemon's mapping (made before) writes, a mapping made from the descriptor afterwards
    can only read, and the descriptor closes with free."""
    import mmap
    tier = gpu.DeviceTier(make_allocator("fake-vmm", host), CAPACITY_BYTES)
    promote_to_device(tier, loader, "a@1", packed_models["a"][1], on_host(host, "a@1", packed_models["a"]))
    [fd] = tier.export_fds("a@1")
    [allocation] = [a.allocation for a in tier.arenas.values()]
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:modelcache-gpu0-")
    assert allocation.nbytes % mmap.PAGESIZE == 0
    with pytest.raises(PermissionError):                             # no new writable mapping: sealed
        mmap.mmap(fd, allocation.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.write(fd, b"x")
    handles, tensors = tier.handles("a@1")
    with mmap.mmap(fd, allocation.nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        assert {name: m[off:off + n] for name, _, _, _, off, n in tensors} == disk_bytes(packed_models["a"])
        name, _, _, _, off, n = tensors[0]
        daemon_view = tier.allocator.local_address(allocation)
        ctypes.memset(daemon_view + off, 0x5A, 4)                     # the daemon's own mapping writes
        assert m[off:off + 4] == b"\x5a" * 4                          # ... and a reader sees it: one memory
    tier.stop()
    with pytest.raises(OSError):
        os.fstat(fd)
