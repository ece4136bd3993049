"""The daemon's GPU tiers: one residency manager per device (daemon/residency/) over a tiers.gpu.DeviceTier,
above the host tier's; which devices get one, how a request names one, what a lease on one needs of
its transport and its client, their capacity on reload, and their stop."""

from __future__ import annotations

import logging

from ..cuda import VMM_KINDS, DeviceError, normalize_uuid
from ..errors import ModelCacheError
from .identity import check_may_read
from .residency import Residency

log = logging.getLogger("modelcache.daemon")


class GpuTiers:
    def __init__(self, *, host: Residency, settings, make_policy, **residency_parts):
        self.host = host                  # the host tier's residency: every GPU copy is promoted from it
        self.settings = settings
        self.make_policy = make_policy    # (settings, clock) -> a device's eviction policy
        self.parts = residency_parts      # registry, loaders, counters, jobs, clock: what each Residency is given
        self.by_uuid: dict[str, Residency] = {}

    def __iter__(self):
        return iter(sorted(self.by_uuid.values(), key=lambda r: r.tier.device.index))

    def __bool__(self) -> bool:
        return bool(self.by_uuid)

    def start(self) -> None:
        """One tier per GPU this daemon may use (`gpus`), or per simulated one (`fake_gpus`); the host tier then
        copies each model's GPU variant too."""
        from ..config import parse_size
        from ..tiers import gpu

        if self.settings.fake_gpus:
            devices = gpu.fake_devices(self.settings.fake_gpus)
        else:
            devices = select_tier_devices(self.settings.gpus, gpu.probe())
        for device in devices:
            capacity = parse_size(self.settings.gpu_capacity, total=device.total_bytes)
            allocator = gpu.allocator_for(device, self.host.tier.root / f"fake-gpu-{device.index}",
                                          self.settings.gpu_sharing)
            tier = gpu.DeviceTier(allocator, capacity, source=self.host.tier)
            residency = self.by_uuid[device.uuid] = Residency(
                tier=tier, policy=self.make_policy(self.settings, self.parts["clock"]), settings=self.settings,
                below=self.host, **self.parts)
            residency.forget = self.host.forget   # (one list: each callback is told which tier's copy went)
            log.info("GPU tier on device %d (%s, %s): %d MiB, shared %s", device.index, device.name, device.uuid,
                     tier.capacity_bytes >> 20,
                     "read-only (VMM)" if allocator.sharing == "vmm-read-only" else "read-write (legacy CUDA IPC)")
        self.host.tier.gpu_variant = bool(devices)

    def set_capacity(self, spec: str) -> None:
        """A reload changed gpu_capacity: each device's tier takes it (at most the device's memory); the reload
        then admits the requests waiting for room. Lowered below what a tier holds, nothing is freed now: the
        next promotion there evicts, as ever."""
        from ..config import parse_size
        for residency in self:
            tier = residency.tier
            residency.set_capacity(min(parse_size(spec, total=tier.device.total_bytes), tier.device.total_bytes))
            log.info("GPU tier on device %d: %d MiB", tier.device.index, tier.capacity_bytes >> 20)

    def stop(self) -> None:
        for residency in self:
            try:
                residency.tier.stop()
            except Exception as e:  # a broken device must not keep the host tier from being cleaned
                log.error("GPU tier %s did not stop cleanly: %s", residency.id, e)

    def named(self, spec: str) -> Residency:
        """The tier a request names: 'cuda' or 'gpu' (the first device), or 'cuda:<UUID or index>'."""
        kind, _, which = spec.partition(":")
        if kind not in ("cuda", "gpu"):
            raise ModelCacheError(f"unknown device {spec!r}: use 'cpu', 'cuda' or 'cuda:<UUID or index>'")
        if not self.by_uuid:
            raise ModelCacheError(
                "this daemon has no GPU tier: no CUDA device was found (it needs a GPU and the [gpu] extra: "
                "onnxruntime-gpu and cupy), or the setting gpus is 'none'")
        tiers = list(self)
        if not which:
            return tiers[0]
        try:
            uuid = normalize_uuid(which)
        except DeviceError:
            uuid = which.strip().lower()   # a fake device's name, or an index: matched as they are
        for residency in tiers:
            device = residency.tier.device
            if device.uuid == uuid or (which.isdigit() and device.index == int(which)):
                return residency
        known = ", ".join(f"{r.tier.device.index} ({r.id})" for r in tiers)
        raise ModelCacheError(f"no GPU {which!r} in this daemon's GPU tier; it has {known}")


    def check_transport(self, ident, residency: Residency) -> None:
        """Under read-only sharing a GPU lease is descriptors, which only the lane carries (not ZeroMQ, not tcp)."""
        tier = residency.tier
        if tier.allocator.kind in VMM_KINDS and not ident.carries_fds:
            raise ModelCacheError(f"GPU {tier.device.index} shares its weights read-only (gpu_sharing = "
                                  "vmm-read-only), as file descriptors that only the daemon's lane (the ipc:// "
                                  "socket's .lane) carries; open GPU sessions over it (modelcache.InferenceSession "
                                  "and connect() do, where the daemon has one)")

    def check_may_map(self, ident, model, residency: Residency) -> None:
        """Before a GPU lease is granted: under read-only sharing, the descriptors go only over the lane, to a peer
        the kernel names, that may read the model's GPU skeleton with its own rights (the client opens it next):
        a descriptor must not give what the host tier's file permissions do not."""
        if residency.tier.allocator.kind in VMM_KINDS:
            self.check_transport(ident, residency)
            check_may_read(ident, str(self.host.tier.skeleton_path(model.key, "gpu")), f"{model.key}'s GPU memory")


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
