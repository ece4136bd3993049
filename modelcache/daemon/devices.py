"""The daemon's GPU tier: a model's copy on each device, promoted from the host tier, lent by IPC handle.

`DeviceCache` runs on the owner loop, over `tiers` (device UUID -> tiers.gpu.DeviceTier) and one
eviction policy per device; it is handed the host cache it promotes from and the loader threads
that copy.

The tiers are inclusive: a model on a GPU is in the host tier too (promotion reads it from
there, a restarted daemon can promote it again from there, and a GPU lease holds the host
copy like any lease). Evicting from a GPU demotes: the host copy stays. A device copy that a
client maps is never freed: freeing it would reclaim nothing while the client lives (CUDA keeps
imported memory alive, shared/GPU.md), so only unleased copies are eviction candidates.
"""

from __future__ import annotations

import logging

from ..cuda import DeviceError, normalize_uuid
from ..errors import CapacityError, ModelCacheError
from ..tiers.base import Tier
from .cache import HostCache, capacity_refusal, choose_victims, policy_for
from .loaders import Loaders
from .registry import DeviceResidency, ModelRecord, ModelState, Registry, plural

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

            def allocator(device):
                return gpu.FakeAllocator(device, self.host.root / f"fake-gpu-{device.index}")
        else:
            devices = select_tier_devices(self.settings.gpus, gpu.probe())
            allocator = gpu.CudaAllocator
        for device in devices:
            capacity = parse_size(self.settings.gpu_capacity, total=device.total_bytes)
            self.tiers[device.uuid] = gpu.DeviceTier(allocator(device), capacity)
            self.policies[device.uuid] = policy_for(self.settings)
            log.info("GPU tier on device %d (%s, %s): %d MiB", device.index, device.name, device.uuid,
                     self.tiers[device.uuid].capacity_bytes >> 20)

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
    def when_on_device(self, model: ModelRecord, tier, then, deadline: float | None = None) -> bool:
        """Call then(error, hit) once `model` is on `tier`'s device: now on a hit (returns True), else
        after the one promotion (host first, when it is only on disk: waiting for room there until
        `deadline`, HostCache.when_resident)."""
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
            if res is None:
                try:
                    res = self._start_promotion(model, tier)
                except ModelCacheError as e:
                    then(e, False)
                    return
            if res.state is ModelState.RESIDENT:
                then(None, False)
            else:
                res.waiters.append(lambda err: then(err, False))

        self.cache.when_resident(model, on_host, deadline)
        return False

    def _start_promotion(self, model: ModelRecord, tier, prewarm: bool = False) -> DeviceResidency | None:
        """Plan the model's place on the device, make room if needed, and copy it on a loader thread.
        A pre-warm makes room only from what its policy's prewarm_victims offers: None when that is not enough."""
        uuid = tier.device.uuid
        if not self.host.has_variant(model.key, "gpu"):
            raise ModelCacheError(f"{model.key}: its GPU weights are not in the host tier")
        plan = tier.plan(model.key, model.manifest.gpu_tensors, self.host.file_locations(model.key, "gpu"))
        over = tier.used_bytes - tier.capacity_bytes
        if over > 0 and not self._make_room(tier, over, loading=model.key, prewarm=prewarm):
            used = tier.used_bytes - plan.arena_bytes   # (read before abort gives the reservation back)
            tier.abort(plan)
            if prewarm:
                return None
            kept = {m.key: m.devices[uuid].why_kept(m.pinned) for m in self.registry.models.values()
                    if m is not model and uuid in m.devices}
            raise capacity_refusal(model.key, plan.arena_bytes, f"the GPU tier of GPU {tier.device.index}",
                                   tier.capacity_bytes, used, kept, "gpu_capacity")
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
            if res is None:
                continue
            if res.leases:   # (a copy still loading: evict_from_device refuses it, as the record says)
                serving = self.serve_holds(model.key)
                why = (f" ({serving} of them serve-mode GPU workers', which let go once the model had no request "
                       f"for serve_idle_s = {self.settings.serve_idle_s:g} s)") if serving else ""
                raise CapacityError(f"{model.key} is in use by {plural(res.leases, 'GPU session')} on {uuid}{why}; "
                                    f"it cannot be evicted from that GPU")
            freed += self.evict_from_device(model, uuid)
        return freed

    def after_release(self, model: ModelRecord, uuid: str) -> None:
        """A lease on the copy on `uuid` ended: tell its policy, and demote it if the policy says so now."""
        res = model.devices.get(uuid)
        if res is not None and res.freeable:
            policy = self.policies[uuid]
            policy.released(model.key, self.clock())
            if policy.evict_on_release and not model.pinned:
                self.evict_from_device(model, uuid)

    # -- timers: each GPU's policy ("unload" demotes to the host tier, "prewarm" promotes host -> GPU) ----------
    def next_timer(self) -> float | None:
        return min((t for p in self.policies.values() if (t := p.next_deadline()) is not None), default=None)

    def on_timer(self, now: float) -> None:
        for uuid, policy in self.policies.items():
            for action in policy.due(now):
                model = self.registry.by_key(action.key)
                res = model.devices.get(uuid) if model is not None else None
                if action.kind == "unload":
                    if res is not None and res.freeable and not model.pinned:
                        self.evict_from_device(model, uuid, counter="gpu_unloads")
                elif model is not None and res is None and model.state is ModelState.RESIDENT \
                        and model.manifest.gpu_tensors:
                    self._prewarm(model, self.tiers[uuid])

    def _prewarm(self, model: ModelRecord, tier) -> None:
        """host -> GPU before the expected call, if it fits (room only from prewarm_victims); else dropped."""
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
        return {"skeleton_path": str(self.host.skeleton_path(model.key, "gpu")), "segments": [],
                "tensors": tensors, "device_uuid": tier.device.uuid, "ipc_kind": tier.allocator.kind,
                "ipc_handles": handles}

    def describe(self) -> list[dict]:
        out = []
        for uuid, tier in sorted(self.tiers.items(), key=lambda kv: kv[1].device.index):
            held = [m for m in self.registry.models.values() if uuid in m.devices]
            out.append({"tier": "gpu", "device": uuid, "index": tier.device.index, "name": tier.device.name,
                        "kind": tier.allocator.kind, "used_bytes": tier.used_bytes,
                        "capacity_bytes": tier.capacity_bytes,
                        "promotion_bytes_per_s": tier.promotion_bytes_per_s,   # of the last host -> GPU copy
                        "models": [m.key for m in held],
                        "leased": {m.key: m.devices[uuid].leases for m in held if m.devices[uuid].leases}})
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
