"""The daemon's GPU tier: a model's copy on each device, promoted from the host tier, lent by IPC handle.

A mixin of `Daemon` (daemon/server.py), like cache.py: its methods run on the owner loop and
use `self.devices` (device UUID -> tiers.gpu.DeviceTier), `self.device_policies`, `self.host`
and `_run_on_loader` for the copies.

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
from .registry import DeviceResidency, ModelRecord, ModelState

log = logging.getLogger("modelcache.daemon")


class DeviceOps:
    # -- lifecycle -----------------------------------------------------------------------
    def _start_devices(self) -> None:
        """One DeviceTier per GPU this daemon may use (`gpus`), or per simulated one (`fake_gpus`)."""
        from ..config import parse_size
        from ..eviction import make_policy
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
            self.devices[device.uuid] = gpu.DeviceTier(allocator(device), capacity)
            self.device_policies[device.uuid] = make_policy(self.settings.eviction_policy)
            log.info("GPU tier on device %d (%s, %s): %d MiB", device.index, device.name, device.uuid,
                     self.devices[device.uuid].capacity_bytes >> 20)

    def _stop_devices(self) -> None:
        for tier in self.devices.values():
            try:
                tier.stop()
            except Exception as e:  # a broken device must not keep the host tier from being cleaned
                log.error("GPU tier %s did not stop cleanly: %s", tier.device.uuid, e)

    # -- naming --------------------------------------------------------------------------
    def _device_tier(self, spec: str):
        """The tier a request names: 'cuda' or 'gpu' (the first device), or 'cuda:<UUID or index>'."""
        kind, _, which = spec.partition(":")
        if kind not in ("cuda", "gpu"):
            raise ModelCacheError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:<UUID or index>'")
        if not self.devices:
            raise ModelCacheError(
                "this daemon has no GPU tier: no CUDA device was found (it needs a GPU and the [gpu] extra: "
                "onnxruntime-gpu and cupy), or the setting gpus is 'none'")
        tiers = sorted(self.devices.values(), key=lambda t: t.device.index)
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

    def _host_variants(self, model: ModelRecord) -> tuple:
        """What a host promotion copies: the CPU weights, and the GPU ones when there is a GPU tier."""
        return ("cpu", "gpu") if self.devices and model.manifest.gpu_tensors else ("cpu",)

    # -- promotion -----------------------------------------------------------------------
    def _when_on_device(self, model: ModelRecord, tier, then) -> bool:
        """Call then(error, hit) once `model` is on `tier`'s device: now on a hit (returns True), else
        after the one promotion (host first, when it is only on disk)."""
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
                    res = self._start_device_promotion(model, tier)
                except ModelCacheError as e:
                    then(e, False)
                    return
            if res.state is ModelState.RESIDENT:
                then(None, False)
            else:
                res.waiters.append(lambda err: then(err, False))

        self._when_resident(model, on_host)
        return False

    def _start_device_promotion(self, model: ModelRecord, tier) -> DeviceResidency:
        """Plan the model's place on the device, make room if needed, and copy it on a loader thread."""
        uuid = tier.device.uuid
        if not self.host.has_variant(model.key, "gpu"):
            raise ModelCacheError(f"{model.key}: its GPU weights are not in the host tier")
        plan = tier.plan(model.key, model.manifest.gpu_tensors, self.host.file_locations(model.key, "gpu"))
        over = tier.used_bytes - tier.capacity_bytes
        if over > 0 and not self._make_room_on_device(tier, over, loading=model.key):
            tier.abort(plan)
            raise CapacityError(
                f"{model.key} needs {plan.arena_bytes >> 20} MiB on GPU {tier.device.index} "
                f"({tier.capacity_bytes >> 20} MiB, {(tier.used_bytes - plan.arena_bytes) >> 20} MiB used) "
                f"and no model without GPU sessions can make room; close GPU sessions, unpin, "
                f"or raise gpu_capacity")
        res = model.devices[uuid] = DeviceResidency(uuid, ModelState.LOADING)
        job_key = f"gpu-load:{model.key}:{uuid}"
        self.jobs[job_key] = {"kind": "gpu-load", "model": model.key, "device": uuid,
                              "bytes_total": plan.arena_bytes}

        def done(seconds, error):
            self.jobs.pop(job_key, None)
            waiters, res.waiters = res.waiters, []
            if error is not None:
                tier.abort(plan)
                model.devices.pop(uuid, None)
                log.error("promotion of %s to GPU %s failed: %s", model.key, uuid, error)
            else:
                tier.commit(plan)
                res.state = ModelState.RESIDENT
                self.device_policies[uuid].created(model.key, plan.arena_bytes, self.clock())
                self.counters["gpu_promotions"] += 1
                rate = plan.arena_bytes / seconds / 1e9 if seconds else 0.0
                log.info("model promoted: %s host -> GPU %d, %.1f MiB in %.3f s (%.1f GB/s)", model.key,
                         tier.device.index, plan.arena_bytes / 2**20, seconds, rate)
            for wake in waiters:
                wake(error)

        self._run_on_loader(lambda: tier.write(plan), done)
        return res

    # -- eviction ------------------------------------------------------------------------
    def evict_from_device(self, model: ModelRecord, uuid: str) -> None:
        """Demote: free the model's copy on one GPU (it has no leases); the host copy stays."""
        res = model.devices[uuid]
        assert res.state is ModelState.RESIDENT and res.leases == 0
        freed = self.devices[uuid].free_model(model.key)
        self.serve_device_specs.pop((model.key, uuid), None)   # its addresses are gone
        self.device_policies[uuid].removed(model.key)
        del model.devices[uuid]
        self.counters["gpu_evictions"] += 1
        log.info("model demoted: %s from GPU %s to host, %.1f MiB freed", model.key, uuid, freed / 2**20)

    def _make_room_on_device(self, tier, bytes_over: int, loading: str) -> bool:
        """Demote unleased, unpinned models from this device, as its policy chooses, until `bytes_over` is free."""
        uuid = tier.device.uuid
        by_key = {m.key: m for m in self.registry.models.values()
                  if (r := m.devices.get(uuid)) is not None and r.state is ModelState.RESIDENT and r.leases == 0
                  and not m.pinned and m.key != loading}
        victims = self._choose_victims(self.device_policies[uuid], by_key, tier.bytes_freed_by, bytes_over)
        if victims is None:
            return False
        for key in victims:
            self.evict_from_device(by_key[key], uuid)
        return True

    def _evict_devices(self, model: ModelRecord, spec: str | None) -> None:
        """`evict --tier gpu[:X]`: demote from the named GPU, or from all of them."""
        uuids = list(model.devices) if spec in (None, "gpu", "cuda") else [self._device_tier(spec).device.uuid]
        for uuid in uuids:
            res = model.devices.get(uuid)
            if res is None:
                continue
            if res.state is ModelState.LOADING:
                raise CapacityError(f"{model.key} is being copied to GPU {uuid}; evict it once it is there")
            if res.leases:
                serving = sum(1 for _, key in self.engine.device_holds if key == model.key)
                why = (f" ({serving} of them serve-mode GPU workers', which let go once the model had no request "
                       f"for serve_idle_s = {self.settings.serve_idle_s:g} s)") if serving else ""
                raise CapacityError(f"{model.key} is in use by {res.leases} GPU sessions on {uuid}{why}; "
                                    f"it cannot be evicted from that GPU")
            self.evict_from_device(model, uuid)

    def _after_device_release(self, model: ModelRecord, uuid: str) -> None:
        res = model.devices.get(uuid)
        if res is not None and res.leases == 0 and res.state is ModelState.RESIDENT:
            policy = self.device_policies[uuid]
            policy.released(model.key, self.clock())
            if policy.evict_on_release and not model.pinned:
                self.evict_from_device(model, uuid)

    # -- what clients and operators see ----------------------------------------------------
    def _device_open_fields(self, model: ModelRecord, tier) -> dict:
        """The OpenReply fields of a GPU lease: the GPU skeleton, the IPC handles, each tensor's place."""
        handles, tensors = tier.export(model.key)
        return {"skeleton_path": str(self.host.skeleton_path(model.key, "gpu")), "segments": [],
                "tensors": tensors, "device_uuid": tier.device.uuid, "ipc_kind": tier.allocator.kind,
                "ipc_handles": handles}

    def _describe_devices(self) -> list[dict]:
        out = []
        for uuid, tier in sorted(self.devices.items(), key=lambda kv: kv[1].device.index):
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
