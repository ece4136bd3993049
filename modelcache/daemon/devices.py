"""The daemon's GPU tier: a model's copy on each device, promoted from the host tier, lent by IPC handle.

`DeviceCache` runs on the owner loop, over `tiers` (device UUID -> tiers.gpu.DeviceTier) and one
eviction policy per device; it is handed the host cache it promotes from and the loader threads
that copy.

The tiers are inclusive: a model on a GPU is in the host tier too (promotion reads it from
there, a restarted daemon can promote it again from there, and a GPU lease holds the host
copy like any lease). Evicting from a GPU demotes: the host copy stays. A device copy that a
client maps is never freed: freeing it would reclaim nothing while the client lives (CUDA keeps
imported memory alive, shared/GPU.md), so only unleased copies are eviction candidates. When every
copy on a device is leased or pinned, an open waits for room there (one RoomQueue per device, room.py),
as it does in the host tier.
"""

from __future__ import annotations

import logging

from ..cuda import VMM_KINDS, DeviceError, normalize_uuid
from ..errors import CapacityError, DaemonUnavailable, ModelCacheError
from ..tiers.base import Tier
from .cache import HostCache, capacity_refusal, choose_victims, policy_for
from .identity import check_may_read
from .lane import LaneConnection
from .loaders import Loaders
from .registry import DeviceResidency, ModelRecord, ModelState, Registry, plural
from .room import RoomQueue

log = logging.getLogger("modelcache.daemon")


class DeviceCache:
    def __init__(self, *, registry: Registry, cache: HostCache, loaders: Loaders, settings, counters: dict,
                 jobs: dict, clock, serve_holds=lambda key: 0):
        self.registry = registry
        self.cache = cache                # the host tier's: a model reaches a GPU through it
        self.host = cache.host
        self.loaders = loaders
        self.settings = settings
        self.counters = counters
        self.jobs = jobs
        self.clock = clock
        self.tiers: dict[str, Tier] = {}  # device UUID -> tiers.gpu.DeviceTier
        self.policies: dict = {}          # device UUID -> its eviction policy
        self.rooms: dict = {}             # device UUID -> its RoomQueue: requests waiting for room there
        self.needs: dict = {}             # (key, UUID) -> bytes its last promotion that found no room would place
        # Called with (model key, device UUID) when a copy is freed: what was built over its addresses goes.
        self.forget: list = []
        # key -> how many serve-mode GPU workers hold the model (said when they keep it from being evicted)
        self.serve_holds = serve_holds

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """One DeviceTier per GPU this daemon may use (`gpus`), or per simulated one (`fake_gpus`)."""
        from ..config import parse_size
        from ..tiers import gpu

        if self.settings.fake_gpus:
            devices = gpu.fake_devices(self.settings.fake_gpus)
        else:
            devices = select_tier_devices(self.settings.gpus, gpu.probe())
        for device in devices:
            capacity = parse_size(self.settings.gpu_capacity, total=device.total_bytes)
            allocator = gpu.allocator_for(device, self.host.root / f"fake-gpu-{device.index}",
                                          self.settings.gpu_sharing)
            self.tiers[device.uuid] = gpu.DeviceTier(allocator, capacity)
            self.policies[device.uuid] = policy_for(self.settings)
            self.rooms[device.uuid] = RoomQueue()
            log.info("GPU tier on device %d (%s, %s): %d MiB, shared %s", device.index, device.name, device.uuid,
                     self.tiers[device.uuid].capacity_bytes >> 20,
                     "read-only (VMM)" if allocator.sharing == "vmm-read-only" else "read-write (legacy CUDA IPC)")

    def set_capacity(self, spec: str) -> None:
        """A reload changed gpu_capacity: each device's tier takes it (at most the device's memory); the reload then
        admits the requests waiting for room (HostCache.admit, every tier). Lowered below what a tier holds,
        nothing is freed now: the next promotion there evicts, as ever."""
        from ..config import parse_size
        for tier in self.tiers.values():
            tier.capacity_bytes = min(parse_size(spec, total=tier.device.total_bytes), tier.device.total_bytes)
            log.info("GPU tier on device %d: %d MiB", tier.device.index, tier.capacity_bytes >> 20)

    def stop(self) -> None:
        for tier in self.tiers.values():
            try:
                tier.stop()
            except Exception as e:  # a broken device must not keep the host tier from being cleaned
                log.error("GPU tier %s did not stop cleanly: %s", tier.device.uuid, e)

    # -- naming --------------------------------------------------------------------------
    def tier_named(self, spec: str):
        """The tier a request names: 'cuda' or 'gpu' (the first device), or 'cuda:<UUID or index>'."""
        kind, _, which = spec.partition(":")
        if kind not in ("cuda", "gpu"):
            raise ModelCacheError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:<UUID or index>'")
        if not self.tiers:
            raise ModelCacheError(
                "this daemon has no GPU tier: no CUDA device was found (it needs a GPU and the [gpu] extra: "
                "onnxruntime-gpu and cupy), or the setting gpus is 'none'")
        tiers = sorted(self.tiers.values(), key=lambda t: t.device.index)
        if not which:
            return tiers[0]
        try:
            uuid = normalize_uuid(which)
        except DeviceError:
            uuid = which.strip().lower()   # a fake device's name, or an index: matched as they are
        for tier in tiers:
            if tier.device.uuid == uuid or (which.isdigit() and tier.device.index == int(which)):
                return tier
        known = ", ".join(f"{t.device.index} ({t.device.uuid})" for t in tiers)
        raise ModelCacheError(f"no GPU {which!r} in this daemon's GPU tier; it has {known}")

    # -- promotion -----------------------------------------------------------------------
    def when_on_device(self, model: ModelRecord, tier, then, deadline: float | None = None, wait: bool = True) -> bool:
        """Call then(error, hit) once `model` is on `tier`'s device: now on a hit (returns True), else
        after the one promotion (host first, when it is only on disk). With a tier full of models in use,
        the request waits for room, in each tier, until `deadline` (None: request_timeout_s from now);
        `wait=False`: on the device it is refused at once instead (a serve request, which the CPU serves)."""
        uuid = tier.device.uuid
        if not model.manifest.gpu_tensors:
            raise ModelCacheError(f"{model.key} was packed without a GPU variant (by an older modelcache); "
                                  f"add it again to open it on a GPU")
        res = model.devices.get(uuid)
        if res is not None and res.state is ModelState.RESIDENT:
            then(None, True)
            return True

        def on_host(error, _hit):
            if error is not None:
                then(error, False)
                return
            res = model.devices.get(uuid)
            if res is not None and res.state is ModelState.RESIDENT:
                then(None, False)
            elif res is not None and res.state is ModelState.LOADING:
                res.waiters.append(lambda err: then(err, False))
            else:
                try:
                    self._promote_or_wait(model, tier, lambda err: then(err, False), deadline, wait)
                except ModelCacheError as e:
                    then(e, False)

        self.cache.when_resident(model, on_host, deadline)
        return False

    def _promote_or_wait(self, model: ModelRecord, tier, wake, deadline: float | None, wait: bool) -> None:
        """Start the promotion to `tier` if there is room and no request waits for room there before it; else
        queue `wake` for room on the device, in arrival order (as HostCache._promote_or_wait does)."""
        uuid, room = tier.device.uuid, self.rooms[tier.device.uuid]
        res, queued = model.devices.get(uuid), bool(room)
        if res is None:
            if not queued and (res := self._start_promotion(model, tier)) is not None:
                res.waiters.append(wake)
                return
            needs = self._needs(model, tier)
            if needs > tier.capacity_bytes or not wait:   # too large, it would wait for nothing; or told not to
                raise self._refusal(model, tier, needs)
            res = model.queue_for_device_room(uuid)
        elif not wait:
            raise self._refusal(model, tier, self._needs(model, tier))
        res.waiters.append(wake)
        now = self.clock()
        room.add(res, wake, now + self.settings.request_timeout_s if deadline is None else deadline, now)
        log.debug("%s waits for room on GPU %d (%d models queued)", model.key, tier.device.index, len(room.models))
        if queued:
            self.admit(uuid)

    def _needs(self, model: ModelRecord, tier) -> int:
        """What the model's copy would place on `tier`: as its last promotion that found no room planned it, else
        planned now (less what it shares there) and given back."""
        needs = self.needs.get((model.key, tier.device.uuid))
        if needs:
            return needs
        if not self.host.has_variant(model.key, "gpu"):
            raise ModelCacheError(f"{model.key}: its GPU weights are not in the host tier")
        plan = tier.plan(model.key, model.manifest.gpu_tensors, self.host.file_locations(model.key, "gpu"))
        tier.abort(plan)
        return plan.arena_bytes

    def _refusal(self, model: ModelRecord, tier, needs: int) -> CapacityError:
        """No room on the device for the model: what holds it, and why (or: it alone exceeds the tier)."""
        uuid = tier.device.uuid
        kept = {m.key: m.devices[uuid].why_kept(m.pinned) for m in self.registry.models.values()
                if m is not model and uuid in m.devices}
        return capacity_refusal(model.key, needs, f"the GPU tier of GPU {tier.device.index}", tier.capacity_bytes,
                                tier.used_bytes, kept, "gpu_capacity")

    def _room_refusal(self, model: ModelRecord, tier, waited_s: float) -> CapacityError:
        """A request's deadline passed while it waited for room on the device: how long, and what held it then."""
        return CapacityError(f"waited {waited_s:.1f} s for room, until the request's deadline: "
                             f"{self._refusal(model, tier, self._needs(model, tier))}")

    def admit(self, uuid: str | None = None) -> None:
        """Room may have appeared on the device `uuid` (None: any): start the promotions waiting for it there, the
        oldest first (room.py)."""
        for u in [uuid] if uuid is not None else list(self.rooms):
            tier = self.tiers[u]
            self.rooms[u].admit(lambda res: self._start_promotion(res.model, tier) is not None)

    def stop_waiting(self) -> None:
        """The daemon is stopping: answer every request still waiting for room on a GPU."""
        for uuid, room in self.rooms.items():
            index = self.tiers[uuid].device.index
            room.stop(lambda res: DaemonUnavailable(f"the modelcache daemon stopped while {res.model.key} waited for "
                                                    f"room on GPU {index}; ask again once it is back"))

    def waiting_text(self, model: ModelRecord) -> str:
        """For `ls` (WHY): the GPUs where requests wait for room for the model; "" when none does."""
        return ", ".join(f"waiting for room on GPU {self.tiers[r.device].device.index} "
                         f"({plural(len(r.waiters), 'request')})"
                         for r in model.devices.values() if r.state is ModelState.WAITING)

    def _start_promotion(self, model: ModelRecord, tier, prewarm: bool = False) -> DeviceResidency | None:
        """Plan the model's place on the device, make room if needed, and copy it on a loader thread.
        None: no room now (nothing reserved; the caller queues the request, or drops the pre-warm, whose room
        comes only from its policy's prewarm_victims); CapacityError: the model alone exceeds the tier."""
        if not self.host.has_variant(model.key, "gpu"):
            raise ModelCacheError(f"{model.key}: its GPU weights are not in the host tier")
        uuid = tier.device.uuid
        plan = tier.plan(model.key, model.manifest.gpu_tensors, self.host.file_locations(model.key, "gpu"))
        over = tier.used_bytes - tier.capacity_bytes
        if over > 0 and not self._make_room(tier, over, loading=model.key, prewarm=prewarm):
            tier.abort(plan)
            if plan.arena_bytes > tier.capacity_bytes:
                raise self._refusal(model, tier, plan.arena_bytes)
            self.needs[(model.key, uuid)] = plan.arena_bytes   # (for the refusal, should a deadline pass)
            return None
        self.needs.pop((model.key, uuid), None)
        res = model.start_device_load(uuid)
        job_key = f"gpu-load:{model.key}:{uuid}"
        self.jobs[job_key] = {"kind": "gpu-load", "model": model.key, "device": uuid,
                              "bytes_total": plan.arena_bytes}

        def done(seconds, error):
            self.jobs.pop(job_key, None)
            if error is not None:
                tier.abort(plan)
                waiters = model.finish_device_load(uuid, ok=False)
                log.error("promotion of %s to GPU %s failed: %s", model.key, uuid, error)
            else:
                tier.commit(plan)
                waiters = model.finish_device_load(uuid, ok=True)
                self.policies[uuid].created(model.key, plan.arena_bytes, self.clock())
                self.counters["gpu_promotions"] += 1
                rate = plan.arena_bytes / seconds / 1e9 if seconds else 0.0
                log.info("model promoted: %s host -> GPU %d, %.1f MiB in %.3f s (%.1f GB/s)", model.key,
                         tier.device.index, plan.arena_bytes / 2**20, seconds, rate)
            for wake in waiters:
                wake(error)
            # Room may have appeared: a failed copy's, a copy no one leased (demotable), the host copy it kept.
            self.cache.admit()

        self.loaders.run(lambda: tier.write(plan), done)
        return res

    # -- eviction ------------------------------------------------------------------------
    def evict_from_device(self, model: ModelRecord, uuid: str, counter: str = "gpu_evictions") -> int:
        """Demote: free the model's copy on one GPU (it has no leases); the host copy stays. Returns bytes freed.
        `counter`: "gpu_evictions", or "gpu_unloads" (its keep-alive on that GPU ended)."""
        model.device_evicted(uuid)      # (raises, freeing nothing, while a lease maps it)
        freed = self.tiers[uuid].free_model(model.key)
        for forget in self.forget:      # its addresses are gone
            forget(model.key, uuid)
        self.policies[uuid].removed(model.key)
        self.counters[counter] += 1
        log.info("model demoted: %s from GPU %s to host, %.1f MiB freed%s", model.key, uuid, freed / 2**20,
                 ", idle past its keep-alive" if counter == "gpu_unloads" else "")
        return freed

    def _make_room(self, tier, bytes_over: int, loading: str, prewarm: bool = False) -> bool:
        """Demote unleased, unpinned models from this device, as its policy chooses, until `bytes_over` is free
        (for a pre-warm, only those its policy's prewarm_victims offers)."""
        uuid = tier.device.uuid
        by_key = {m.key: m for m in self.registry.models.values()
                  if (r := m.devices.get(uuid)) is not None and r.freeable and not m.pinned and m.key != loading}
        victims = choose_victims(self.policies[uuid], by_key, tier.bytes_freed_by, bytes_over,
                                 prewarm_of=loading if prewarm else None)
        if victims is None:
            return False
        for key in victims:
            self.evict_from_device(by_key[key], uuid)
        return True

    def evict_named(self, model: ModelRecord, spec: str | None) -> int:
        """`evict --tier gpu[:X]`: demote from the named GPU, or from all of them; returns bytes freed.
        A daemon without a GPU tier refuses (tier_named says so) rather than report a demotion."""
        named = self.tier_named("gpu" if spec is None else spec)
        uuids = list(model.devices) if spec in (None, "gpu", "cuda") else [named.device.uuid]
        freed = 0
        for uuid in uuids:
            res = model.devices.get(uuid)
            if res is None or res.state is ModelState.WAITING:   # (no copy there yet)
                continue
            if res.leases:   # (a copy still loading: evict_from_device refuses it, as the record says)
                serving = self.serve_holds(model.key)
                why = (f" ({serving} of them serve-mode GPU workers', which let go once the model had no request "
                       f"for serve_idle_s = {self.settings.serve_idle_s:g} s)") if serving else ""
                raise CapacityError(f"{model.key} is in use by {plural(res.leases, 'GPU session')} on {uuid}{why}; "
                                    f"it cannot be evicted from that GPU")
            freed += self.evict_from_device(model, uuid)
            self.admit(uuid)
        return freed

    def after_release(self, model: ModelRecord, uuid: str) -> None:
        """A lease on the copy on `uuid` ended: tell its policy, and demote it if the policy says so now."""
        res = model.devices.get(uuid)
        if res is not None and res.freeable:
            policy = self.policies[uuid]
            policy.released(model.key, self.clock())
            if policy.evict_on_release and not model.pinned:
                self.evict_from_device(model, uuid)
        if self.rooms[uuid]:
            self.admit(uuid)    # the released copy may be demoted for a request waiting for room

    # -- timers: each GPU's policy ("unload" demotes to the host tier, "prewarm" promotes host -> GPU), and the
    # -- deadlines of requests waiting for room on a GPU
    def next_timer(self) -> float | None:
        return min((t for q in (*self.policies.values(), *self.rooms.values()) if (t := q.next_deadline()) is not None),
                   default=None)

    def on_timer(self, now: float) -> None:
        gave_up = False
        for uuid, room in self.rooms.items():
            for res, wake, waited_s in room.expired(now):
                wake(self._room_refusal(res.model, self.tiers[uuid], waited_s))
                gave_up = True
        if gave_up:
            self.cache.admit()   # a model none waits for on a GPU any more: its host copy is evictable again
        for uuid, policy in self.policies.items():
            for action in policy.due(now):
                model = self.registry.by_key(action.key)
                res = model.devices.get(uuid) if model is not None else None
                if action.kind == "unload":
                    if res is not None and res.freeable and not model.pinned:
                        self.evict_from_device(model, uuid, counter="gpu_unloads")
                        self.admit(uuid)
                elif model is not None and res is None and model.state is ModelState.RESIDENT \
                        and model.manifest.gpu_tensors:
                    self._prewarm(model, self.tiers[uuid])

    def _prewarm(self, model: ModelRecord, tier) -> None:
        """host -> GPU before the expected call, if it fits (room only from prewarm_victims) and no request waits for
        room there; else dropped."""
        if self.rooms[tier.device.uuid]:
            return
        try:
            if self._start_promotion(model, tier, prewarm=True) is not None:
                self.counters["gpu_prewarms"] += 1
                log.info("pre-warming %s host -> GPU %d: its next call is expected soon", model.key, tier.device.index)
        except ModelCacheError as e:
            log.info("pre-warm of %s to GPU %d dropped: %s", model.key, tier.device.index, e)

    # -- what clients and operators see ----------------------------------------------------
    def open_fields(self, model: ModelRecord, tier) -> dict:
        """The OpenReply fields of a GPU lease: the GPU skeleton, the IPC handles, each tensor's place."""
        handles, tensors = tier.export(model.key)
        fields = {"skeleton_path": str(self.host.skeleton_path(model.key, "gpu")), "segments": [],
                  "tensors": tensors, "device_uuid": tier.device.uuid, "ipc_kind": tier.allocator.kind,
                  "ipc_handles": handles}
        if tier.allocator.kind in VMM_KINDS:
            fields["ipc_fds"] = len(handles)
        return fields

    def passed_fds(self, model: ModelRecord, tier) -> list[int]:
        """The descriptors a GPU lease's reply carries, in handle order (the fd-shared kinds; else none). Still the
        allocator's: the lane passes copies."""
        return tier.export_fds(model.key) if tier.allocator.kind in VMM_KINDS else []

    def check_transport(self, ident, tier) -> None:
        """Under read-only sharing a GPU lease is descriptors, which only the lane carries (not ZeroMQ, not tcp)."""
        if tier.allocator.kind in VMM_KINDS and type(ident) is not LaneConnection:
            raise ModelCacheError(f"GPU {tier.device.index} shares its weights read-only (gpu_sharing = "
                                  "vmm-read-only), as file descriptors that only the daemon's lane (the ipc:// "
                                  "socket's .lane) carries; open GPU sessions over it (modelcache.InferenceSession "
                                  "and connect() do, where the daemon has one)")

    def check_may_map(self, ident, model: ModelRecord, tier) -> None:
        """Before a GPU lease is granted: under read-only sharing, the descriptors go only over the lane, to a peer
        the kernel names, that may read the model's GPU skeleton with its own rights (the client opens it next):
        a descriptor must not give what the host tier's file permissions do not."""
        if tier.allocator.kind in VMM_KINDS:
            self.check_transport(ident, tier)
            check_may_read(ident, str(self.host.skeleton_path(model.key, "gpu")), f"{model.key}'s GPU memory")

    def describe(self) -> list[dict]:
        out = []
        for uuid, tier in sorted(self.tiers.items(), key=lambda kv: kv[1].device.index):
            held = [m for m in self.registry.models.values()
                    if uuid in m.devices and m.devices[uuid].state is not ModelState.WAITING]
            out.append({"tier": "gpu", "device": uuid, "index": tier.device.index, "name": tier.device.name,
                        "kind": tier.allocator.kind, "used_bytes": tier.used_bytes,
                        "sharing": tier.allocator.sharing,            # as clients get it: ipc or vmm-read-only
                        "sharing_note": tier.allocator.sharing_note,  # why not as set ("" when it is)
                        "capacity_bytes": tier.capacity_bytes,
                        "promotion_bytes_per_s": tier.promotion_bytes_per_s,   # of the last host -> GPU copy
                        "models": [m.key for m in held],
                        "leased": {m.key: m.devices[uuid].leases for m in held if m.devices[uuid].leases},
                        "waiting": self.rooms[uuid].waiting()})
        return out


def select_tier_devices(spec: str, devices: list) -> list:
    """The devices that get a GPU tier: `gpus` = auto (all), none, or indices "0,1" (unknown ones are skipped
    here; the serve-mode workers refuse them at start with the error the setting deserves)."""
    spec = str(spec).strip().lower()
    if spec in ("none", "", "off"):
        return []
    if spec == "auto":
        return list(devices)
    wanted = {int(x) for x in spec.split(",") if x.strip().isdigit()}
    return [d for d in devices if d.index in wanted]
