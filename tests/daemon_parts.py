"""The daemon's parts built by hand, in process, over a real host tier and a simulated GPU (the fake
allocator), stepped with a fake clock: what tests/test_lifecycle.py, test_tier_contract.py and
test_keepalive.py use. One residency manager per tier (daemon/residency/): `residency` the host
tier's, `device` the GPU's; `tiers` both, the host's first, as the owner loop runs them."""

from __future__ import annotations

import collections

from modelcache import zoo
from modelcache.config import Settings
from modelcache.daemon.disk_opens import DiskOpens
from modelcache.daemon.fetch import Fetcher
from modelcache.daemon.gpus import GpuTiers
from modelcache.daemon.identity import Admins
from modelcache.daemon.loaders import Loaders
from modelcache.daemon.models import Models
from modelcache.daemon.registry import Registry
from modelcache.daemon.residency import Residency
from modelcache.daemon.server import policy_for
from modelcache.daemon.sessions import Sessions
from modelcache.histogram import Histogram
from modelcache.store.packing import pack
from modelcache.tiers.disk import Repository
from modelcache.tiers.host import HostTier
from modelcache.wire import protocol as P

from fake_clock import FakeClock

MiB = 1 << 20
IDENT = object()    # who asks for an open: replies go to Parts.replies whatever it is


class Parts:
    """The residency managers, models, sessions as the daemon wires them, over `tmp_path`."""

    def __init__(self, tmp_path, policy: str = "lru", host_capacity: str = "256M", fake_gpus: str = "1x64M",
                 memory=None, **settings):
        """memory: a daemon.memory.MemoryGuard for the host tier (its headroom measured as the test says)."""
        self.settings = Settings(socket=f"ipc://{tmp_path}/d.sock", repository=str(tmp_path / "repo"),
                                 shm_dir=str(tmp_path / "shm"), host_capacity=host_capacity, fake_gpus=fake_gpus,
                                 eviction_policy=policy, workers="1", gpus="auto", **settings)
        (tmp_path / "shm").mkdir(parents=True, exist_ok=True)
        self.clock = FakeClock()
        self.wall = lambda: self.clock() + 1e9     # wall time runs with the fake clock
        self.registry = Registry()
        self.repository = Repository(self.settings.repository_path)
        self.host = HostTier(self.settings.shm_dir, self.settings.host_capacity_bytes(), owner=self.settings.socket,
                             source=self.repository)
        self.loaders = Loaders(1)
        self.counters = collections.Counter()
        self.replies: list = []
        reply = lambda ident, msg: self.replies.append(msg)   # noqa: E731
        self.fetcher = Fetcher(registry=self.registry, repository=self.repository, remote=None, loaders=self.loaders,
                               counters=self.counters, jobs={}, reply=reply, redispatch=None)
        parts = dict(registry=self.registry, loaders=self.loaders, counters=self.counters, jobs={}, clock=self.clock)
        self.residency = Residency(tier=self.host, policy=policy_for(self.settings, self.clock),
                                   settings=self.settings, source=self.fetcher, memory=memory, **parts)
        if memory is not None:
            memory.host = self.residency
        self.gpus = GpuTiers(host=self.residency, settings=self.settings, make_policy=policy_for, **parts)
        self.models = Models(registry=self.registry, host=self.residency, gpus=self.gpus, fetcher=self.fetcher,
                             repository=self.repository, loaders=self.loaders, settings=self.settings,
                             admins=Admins(""), counters=self.counters, jobs={}, clock=self.clock, wall=self.wall,
                             reply=reply)
        # Opens and closes as the daemon takes them (a client here is the registry's, with no credentials).
        self.disk = DiskOpens(loaders=self.loaders, counters=self.counters)
        self.sessions = Sessions(registry=self.registry, host=self.residency, gpus=self.gpus, fetcher=self.fetcher,
                                 disk=self.disk, settings=self.settings, counters=self.counters, clock=self.clock,
                                 wall=self.wall, reply=reply, open_latency=Histogram())
        self.host.start()
        self.gpus.start()
        self.device = next(iter(self.gpus))
        self.tier = self.device.tier
        self.uuid = self.tier.id
        self.tiers = [self.residency, self.device]

    def add(self, tmp_path, zoo_name: str, name: str, seed: int = 0):
        src = tmp_path / f"{name}.onnx"
        zoo.save(zoo.build(zoo_name, seed), str(src))
        manifest = pack(str(src), self.repository.root, name, 1)
        return self.registry.add_model(self.repository.model_dir(name, 1), manifest)

    def lease(self, client, model, residency=None):
        """A lease as an open grants it, on the copy in `residency`'s tier (default: the host's)."""
        return (residency or self.residency).grant(client, model, self.clock())

    def open(self, client, name: str, deadline_ms: float | None = None, device: str = "cpu"):
        """An open as the daemon takes it, its loads landed: its reply, or None while it waits."""
        before = len(self.replies)
        self.sessions.on_Open(IDENT, P.Open(req_id=1, client_id=client.client_id, name=name, device=device,
                                            deadline_ms=deadline_ms))
        self.loaders.settle()
        return self.replies[before] if len(self.replies) > before else None

    def release(self, lease) -> None:
        """A close of `lease`, as the daemon takes it."""
        self.residency.close(lease.lease_id)

    def next_timer(self):
        """When the owner loop next wakes for a tier's timer (any tier)."""
        return min((t for r in self.tiers if (t := r.next_timer()) is not None), default=None)

    def on_timer(self, now: float) -> None:
        for r in self.tiers:
            r.on_timer(now)

    def stop_waiting(self) -> None:
        """The daemon is stopping: every tier answers what waits for room there."""
        for r in self.tiers:
            r.stop_waiting()

    def stop(self):
        self.loaders.shutdown()
        self.gpus.stop()
        self.host.stop()


def resident(parts: Parts, model, residency=None) -> None:
    """Bring `model` into `residency`'s tier (default: the host's), its loads landed."""
    answers = []
    (residency or parts.residency).when_resident(model, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert answers == [None]


def on_device(parts: Parts, model) -> None:
    resident(parts, model, parts.device)


def counting(obj, method: str) -> list:
    """Record each call of obj.method (and still make it)."""
    calls, real = [], getattr(obj, method)

    def wrapper(*args, **kw):
        calls.append(args)
        return real(*args, **kw)
    setattr(obj, method, wrapper)
    return calls
