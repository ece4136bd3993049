"""The daemon's caches built by hand, in process, over a real host tier and a simulated GPU (the fake
allocator), stepped with a fake clock: what tests/test_lifecycle.py and tests/test_tier_contract.py use."""

from __future__ import annotations

from modelcache import zoo
from modelcache.config import Settings
from modelcache.daemon.cache import HostCache, policy_for
from modelcache.daemon.devices import DeviceCache
from modelcache.daemon.identity import Admins
from modelcache.daemon.loaders import Loaders
from modelcache.daemon.registry import Registry
from modelcache.daemon.sessions import Sessions
from modelcache.histogram import Histogram
from modelcache.packing import pack
from modelcache.tiers.disk import Repository
from modelcache.tiers.host import HostTier

from fake_clock import FakeClock

MiB = 1 << 20


class Parts:
    """The host cache and the GPU cache as the daemon wires them, over `tmp_path`."""

    def __init__(self, tmp_path, policy: str = "lru", host_capacity: str = "256M", fake_gpus: str = "1x64M",
                 **settings):
        self.settings = Settings(socket=f"ipc://{tmp_path}/d.sock", repository=str(tmp_path / "repo"),
                                 shm_dir=str(tmp_path / "shm"), host_capacity=host_capacity, fake_gpus=fake_gpus,
                                 eviction_policy=policy, workers="1", gpus="auto", **settings)
        (tmp_path / "shm").mkdir(parents=True, exist_ok=True)
        self.clock = FakeClock()
        self.wall = lambda: self.clock() + 1e9     # wall time runs with the fake clock
        self.registry = Registry()
        self.repository = Repository(self.settings.repository_path)
        self.host = HostTier(self.settings.shm_dir, self.settings.host_capacity_bytes(), owner=self.settings.socket)
        self.loaders = Loaders(1)
        self.counters = {k: 0 for k in ("promotions", "evictions", "gpu_promotions", "gpu_evictions",
                                        "corrupt_detected", "fetched", "refetched", "adds", "unloads", "prewarms",
                                        "gpu_unloads", "gpu_prewarms", "opens", "hits", "misses", "closes")}
        self.replies: list = []
        self.cache = HostCache(registry=self.registry, host=self.host, policy=policy_for(self.settings, self.clock),
                               repository=self.repository, remote=None, loaders=self.loaders, settings=self.settings,
                               admins=Admins(""), counters=self.counters, jobs={}, clock=self.clock,
                               reply=lambda ident, msg: self.replies.append(msg), redispatch=None, wall=self.wall)
        self.gpu = self.cache.gpu = DeviceCache(registry=self.registry, cache=self.cache, loaders=self.loaders,
                                                settings=self.settings, counters=self.counters, jobs={},
                                                clock=self.clock)
        # Opens and closes as the daemon takes them (a client here is the registry's, with no credentials).
        self.sessions = Sessions(registry=self.registry, cache=self.cache, gpu=self.gpu, settings=self.settings,
                                 counters=self.counters, clock=self.clock, wall=self.wall,
                                 reply=lambda ident, msg: self.replies.append(msg), open_latency=Histogram())
        self.host.start()
        self.gpu.start()
        self.tier = next(iter(self.gpu.tiers.values()))
        self.uuid = self.tier.device.uuid

    def add(self, tmp_path, zoo_name: str, name: str, seed: int = 0):
        src = tmp_path / f"{name}.onnx"
        zoo.save(zoo.build(zoo_name, seed), str(src))
        manifest = pack(str(src), self.repository.root, name, 1)
        return self.registry.add_model(self.repository.model_dir(name, 1), manifest)

    def stop(self):
        self.loaders.shutdown()
        self.gpu.stop()
        self.host.stop()


def resident(parts: Parts, model) -> None:
    answers = []
    parts.cache.when_resident(model, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert answers == [None]


def on_device(parts: Parts, model) -> None:
    answers = []
    parts.gpu.when_on_device(model, parts.tier, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert answers == [None]


def counting(obj, method: str) -> list:
    """Record each call of obj.method (and still make it)."""
    calls, real = [], getattr(obj, method)

    def wrapper(*args, **kw):
        calls.append(args)
        return real(*args, **kw)
    setattr(obj, method, wrapper)
    return calls
