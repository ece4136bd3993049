"""The device tier itself: content-addressed arenas of model weights on one device (see the package's docstring)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ...cuda import VMM_KINDS
from ...errors import ModelCacheError
from ..regions import RegionStore, StoredTier
from .memory import DEVICE_ALIGN, Allocation, DeviceAllocator


def arena_name(n: int) -> str:
    return f"arena-{n}"


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


class DeviceTier(StoredTier):
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
        # An arena is one allocation, freed whole with its last user (page None): until then a tensor in it
        # nobody uses stays on the device, and a later model that needs it reuses it.
        self.store = RegionStore(arena_name)
        self.models: dict[str, dict] = {}               # resident key -> tensor name -> (arena, offset)
        self._tensors: dict[str, list] = {}             # resident key -> its TensorEntry list (for export)
        self._in_flight: dict[str, DevicePlan] = {}     # planned, not yet committed or aborted
        self.promotion_bytes_per_s = 0.0                # of the last committed copy, for stats

    @property
    def arenas(self) -> dict:
        """Arena name -> its Region (tiers/regions.py): one allocation each, `allocation` set at commit."""
        return self.store.regions

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
        locations, copies = {}, []
        placing = self.store.placement(DEVICE_ALIGN)
        host_files: dict[str, int] = {}             # path -> index in plan.host_files
        for t in tensors:
            if (at := placing.find(t.sha256)) is not None:
                locations[t.name] = at
                continue
            if t.name not in host_locations:
                raise ValueError(f"{key}: tensor {t.name!r} is not resident in the host tier")
            path, host_offset = host_locations[t.name]
            locations[t.name] = (placing.region, placing.new(t.nbytes, t.sha256))
            file_index = host_files.setdefault(str(path), len(host_files))
            copies.append((file_index, host_offset, locations[t.name][1], t.nbytes, t.sha256))
        size = self.allocator.rounded(placing.end) if copies else 0   # what the allocation will take on the device
        arena = placing.reserve(key, locations.values(), size)
        plan = DevicePlan(key, list(tensors), locations, list(host_files), copies, arena, size)
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
            self.store.publish(plan.arena, ((sha, dst_off) for _, _, dst_off, _, sha in plan.copies))
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
        """`key` uses nothing here any more: the arenas no model uses are freed. Bytes freed."""
        freed = self.store.drop_user(key)
        for arena in freed.regions:
            if arena.allocation is not None:   # (None: an aborted plan's, whose write freed or never allocated)
                self.allocator.free(arena.allocation)
        return freed.bytes

    def stop(self) -> None:
        """Free everything. Call once no write is running (the loaders have stopped)."""
        for plan in list(self._in_flight.values()):
            self.abort(plan)
        for arena in self.arenas.values():
            if arena.allocation is not None:
                self.allocator.free(arena.allocation)
        self.store.clear()
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
        """The descriptors a lease's reply carries, in handle order: copies of the allocations', under read-only
        sharing (the fd-shared kinds); else none. The caller's to close (the reply's: server._reply). A host
        lease's files go as descriptors only to a client that asks: daemon/lease_files.py."""
        return [os.dup(fd) for fd in self.export_fds(key)] if self.allocator.kind in VMM_KINDS else []

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
