"""The memory limit's rules, in process (daemon/memory.py, memlimit.py): the limit found from /proc and the
cgroup files, a capacity above it refused, promotions that give idle models back or fail with OutOfMemoryError,
pressure relieved in the policy's order and never through a leased copy. The headroom is measured as each test
says (the tier's bytes plus a neighbour's), so every step is deterministic; tests/test_memory_limit.py runs the
real daemon in a real cgroup."""

from __future__ import annotations

import logging

import pytest

from daemon_parts import IDENT, Parts, resident
from modelcache import memlimit
from modelcache.config import ConfigError, Settings
from modelcache.daemon.memory import MemoryGuard, check_capacity
from modelcache.errors import OutOfMemoryError
from modelcache.memlimit import MemoryLimit
from modelcache.wire import protocol as P

MiB = 1 << 20
KiB = 1 << 10


class Machine:
    """A memory limit whose working set is the host tier's bytes plus a neighbour's, set by the test."""

    def __init__(self, limit_bytes: int, reserve_bytes: int):
        self.limit = MemoryLimit(limit_bytes, "a test's limit")
        self.neighbour = 0
        self.parts = None
        self.guard = MemoryGuard(self.limit, reserve_bytes, measure=self.headroom)

    def headroom(self) -> int:
        """What the kernel would count: segments written (a plan's reservation is not memory yet)."""
        host = self.parts.host if self.parts is not None else None
        used = sum(s.resident_bytes() for s in host.segments.values() if s.users & set(host.models)) if host else 0
        return self.limit.limit_bytes - used - self.neighbour


def make_machine(tmp_path, **settings) -> Machine:
    """Four tiny models (tiny-cnn, ~100 KiB each) under a 1 MiB limit with a 200 KiB reserve."""
    m = Machine(1 * MiB, 200 * KiB)
    m.parts = Parts(tmp_path, memory=m.guard, **settings)
    m.guard.counters = m.parts.counters
    m.models = [m.parts.add(tmp_path, "tiny-cnn", f"m{i}", seed=i) for i in range(4)]
    return m


@pytest.fixture
def machine(tmp_path):
    m = make_machine(tmp_path)
    yield m
    m.parts.stop()


def held_to_the_reserve(machine: Machine):
    """The first three models resident and leased, and the neighbour grown until no more fits: the client."""
    parts = machine.parts
    client = parts.registry.new_client(1, "c", parts.clock())
    for model in machine.models[:3]:
        resident(parts, model)
        parts.lease(client, model)
    machine.neighbour = machine.headroom() - machine.guard.reserve
    return client


def host_keys(parts: Parts) -> set:
    return set(parts.residency.resident)


def test_a_promotion_that_would_eat_the_reserve_gives_idle_models_back_first(machine):
    parts, (a, b, c, d) = machine.parts, machine.models
    for model in (a, b, c):
        resident(parts, model)
    size = parts.host.model_bytes(a.key)
    # The neighbour grows until a fourth model would leave less than the reserve free.
    machine.neighbour = machine.headroom() - machine.guard.reserve - size // 2
    client = parts.registry.new_client(1, "c", parts.clock())
    parts.lease(client, b)                       # in use: never given back
    resident(parts, d)
    assert host_keys(parts) == {b.key, c.key, d.key}     # a, least recently used and idle, went for it
    assert parts.counters["pressure_evictions"] == 1 and machine.headroom() >= machine.guard.reserve


def test_a_promotion_the_memory_cannot_take_fails_typed_and_reserves_nothing(machine):
    parts, (a, b, c, d) = machine.parts, machine.models
    held_to_the_reserve(machine)
    used = parts.host.used_bytes
    answers = []
    with pytest.raises(OutOfMemoryError) as refused:
        parts.residency.when_resident(d, lambda error, hit: answers.append(error))
    message = str(refused.value)
    assert f"{d.key} needs" in message and "memory_reserve 200 KiB is kept free" in message, message
    assert all(f"{m.key} (in use by 1 session)" in message for m in (a, b, c)), message
    assert parts.host.used_bytes == used and d.key not in parts.residency.resident
    assert machine.guard.in_flight == 0
    # The refusal crosses the wire as itself: a CapacityError too, with its own code.
    assert OutOfMemoryError.code == "out_of_memory" and isinstance(refused.value, Exception)


@pytest.mark.parametrize("when_full", ["disk", "wait"])
def test_an_open_the_memory_cannot_take_maps_the_repositorys_files_or_fails_at_once(tmp_path, when_full):
    """open_when_full = disk: the open's lease is over the version's packed files, and nothing is reserved;
    wait: refused at once (a lease may be held for hours: no memory it waits for is sure to come back)."""
    machine = make_machine(tmp_path, open_when_full=when_full)
    parts, d = machine.parts, machine.models[3]
    try:
        client = held_to_the_reserve(machine)
        used = parts.host.used_bytes
        if when_full == "wait":
            with pytest.raises(OutOfMemoryError):      # (the owner loop sends it as the open's error reply)
                parts.open(client, d.name)
        else:
            reply = parts.open(client, d.name)
        assert parts.host.used_bytes == used and d.key not in parts.residency.resident
        assert machine.guard.in_flight == 0
        if when_full == "wait":
            return
        assert isinstance(reply, P.OpenReply) and reply.hit is False, reply
        assert reply.skeleton_path == str(d.disk_dir / "model.onnx")
        assert reply.segments == [str(d.disk_dir / "weights.bin")]
        assert [t[4] for t in reply.tensors] == [t.offset for t in d.manifest.tensors]
        assert parts.counters["opens_from_disk"] == 1 and parts.residency.leases_over_files(d) == 1
        parts.sessions.on_Close(IDENT, P.Close(req_id=2, client_id=client.client_id, lease_id=reply.lease_id))
        assert parts.residency.leases_over_files(d) == 0 and len(parts.residency.leases) == 3
    finally:
        parts.stop()


def test_a_serve_request_waits_for_memory_that_requests_in_flight_hold(machine):
    """What an open is refused at once (leases may be held for hours) a serve request waits for, as for room:
    the holds on the other models end in milliseconds; at its deadline it is refused saying it waited."""
    parts, (a, b, c, d) = machine.parts, machine.models
    requests = {}
    for model in (a, b, c):
        resident(parts, model)
        requests[model.key] = parts.residency.hold_request(model)   # requests in flight on each
    machine.neighbour = machine.headroom() - machine.guard.reserve
    answers = []
    parts.residency.when_resident(d, lambda error, hit: answers.append(error), memory_wait=True)
    parts.loaders.settle()
    assert answers == [] and d.key not in parts.residency.resident   # waiting, nothing reserved
    parts.residency.end(requests[a.key])         # a's request answered: a is idle, given back for d
    parts.loaders.settle()
    assert answers == [None] and host_keys(parts) == {b.key, c.key, d.key}
    # Nothing to give back before the deadline: refused, saying how long it waited for memory.
    parts.residency.evict(d)
    machine.neighbour += machine.headroom() - machine.guard.reserve
    parts.residency.when_resident(d, lambda error, hit: answers.append(error), deadline=parts.clock() + 5,
                                  memory_wait=True)
    parts.clock.now += 6
    parts.residency.on_timer(parts.clock())
    assert isinstance(answers[-1], OutOfMemoryError), answers
    assert str(answers[-1]).startswith("waited 6.0 s for memory, until the request's deadline: m3@1 needs")
    assert machine.guard.in_flight == 0 and parts.residency.short_of_memory == {}


def test_a_serve_request_that_waited_for_room_then_waits_for_memory_too(machine):
    """A serve request queued for room (every model in the tier in use) is admitted when one request ends; if the
    memory is still short while other requests hold their models, it waits on for them, as it would have had it
    found room at once. (It was refused at admission: 2 of 270 calls of benchmarks/systems' Azure replay.)"""
    parts, (a, b, c, d) = machine.parts, machine.models
    requests = {}
    for model in (a, b, c):
        resident(parts, model)
        requests[model.key] = parts.residency.hold_request(model)
    size = parts.host.model_bytes(a.key)
    parts.residency.set_capacity(parts.host.used_bytes)   # no room for d until a model is let go
    # ...and the memory short by half a model even once one is given back for d's room.
    machine.neighbour = machine.headroom() - machine.guard.reserve + size // 2
    answers = []
    parts.residency.when_resident(d, lambda error, hit: answers.append(error), memory_wait=True)
    assert answers == [] and parts.residency.room.waiting() == {"models": 1, "requests": 1}
    parts.residency.end(requests[a.key])         # room: a goes for it, but the memory is still short
    parts.loaders.settle()
    assert answers == [] and d.key in parts.residency.short_of_memory   # waiting for memory, not refused
    parts.residency.end(requests[b.key])         # b is idle now: given back, and d fits the memory
    parts.loaders.settle()
    assert answers == [None] and host_keys(parts) == {c.key, d.key}
    assert machine.guard.in_flight == 0 and parts.residency.short_of_memory == {}


def test_a_serve_request_waits_for_the_memory_of_sessions_being_dropped(machine):
    """A model given back for a serve request stays charged while the workers' sessions over it map it (they drop
    them after the run in progress): the request waits for the drop, as daemon/serving.py reports it, rather than
    be refused with nothing held (4 of 270 calls of benchmarks/systems' Azure replay at 0.75 GiB)."""
    parts, (a, b, c, d) = machine.parts, machine.models
    for model in (a, b, c):
        resident(parts, model)
        parts.clock.now += 1
    size = parts.host.model_bytes(a.key)
    machine.neighbour = machine.headroom() - machine.guard.reserve - size // 2   # d fits once a is gone
    dropping = []

    def sessions_over(key, tier):   # as Serving.forget_model: the copy is freed, its sessions not yet dropped
        machine.neighbour += size
        machine.guard.dropping += 1
        dropping.append(key)

    parts.residency.forget.append(sessions_over)
    answers = []
    parts.residency.when_resident(d, lambda error, hit: answers.append(error), memory_wait=True)
    parts.loaders.settle()
    assert answers == [] and dropping == [a.key]        # a given back (least recently used), d waits for it
    assert host_keys(parts) == {b.key, c.key}          # nothing more given back for memory that is coming
    machine.neighbour -= size                           # the workers dropped a's sessions
    machine.guard.dropping -= 1
    parts.residency.admit()
    parts.loaders.settle()
    assert answers == [None] and host_keys(parts) == {b.key, c.key, d.key}


def test_a_serve_request_waits_for_memory_that_a_promotion_under_way_reserved(machine):
    """Two serve requests' promotions at once, the memory enough for one: the second waits for the first's
    (whose request then lets go), where it was refused at once with nothing resident held."""
    parts, (a, b, c, d) = machine.parts, machine.models
    machine.neighbour += machine.headroom() - machine.guard.reserve - int(1.5 * a.manifest.weights_bytes)
    answers, requests = [], {}
    for model in (a, b):
        requests[model.key] = parts.residency.hold_request(model)   # each request holds its model, as serving.py does
        parts.residency.when_resident(model, lambda error, hit, m=model: answers.append((m.key, error)),
                                      memory_wait=True)
    assert answers == [] and parts.residency.short_of_memory.keys() == {b.key}
    parts.loaders.settle()
    assert answers == [(a.key, None)]
    parts.residency.end(requests[a.key])         # a's request answered: a is idle, given back for b
    parts.loaders.settle()
    assert answers == [(a.key, None), (b.key, None)] and host_keys(parts) == {b.key}


def test_pressure_gives_idle_models_back_in_the_policys_order_until_the_reserve_is_free(machine, caplog):
    parts, (a, b, c, d) = machine.parts, machine.models
    for model in (a, b, c, d):
        resident(parts, model)
        parts.clock.now += 1
    client = parts.registry.new_client(1, "c", parts.clock())
    parts.lease(client, a)                       # the oldest, but in use
    guard = machine.guard
    machine.neighbour = 0
    assert guard.relieve() == 0 and parts.counters["pressure_evictions"] == 0   # nothing to do above the reserve
    size = parts.host.model_bytes(b.key)
    machine.neighbour = machine.headroom() - guard.reserve + size // 4   # a quarter of a model short
    with caplog.at_level(logging.WARNING, logger="modelcache.daemon"):
        freed = guard.relieve()
    assert host_keys(parts) == {a.key, c.key, d.key} and freed == size   # b: the least recent idle one
    assert machine.headroom() >= guard.reserve and guard.short is False
    assert parts.counters["pressure_evictions"] == 1 and parts.counters["pressure_reliefs"] == 1
    assert "memory pressure:" in caplog.text and "gave back 1 idle model" in caplog.text
    # Growing past everything idle: all but the leased copy go, and it says so once.
    machine.neighbour = machine.limit.limit_bytes
    guard.relieve()
    assert host_keys(parts) == {a.key} and guard.short is True
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="modelcache.daemon"):
        guard.relieve()
    assert "no idle model" not in caplog.text       # (said at the episode's start, not at every reading)


def test_a_capacity_above_the_limit_less_the_reserve_is_refused_or_warned():
    limit = MemoryLimit(1536 * MiB, "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/x")
    settings = Settings(host_capacity="8G")
    reserve = settings.memory_reserve_bytes(limit.limit_bytes)
    assert reserve == 256 * MiB                                  # auto: max(256M, 10 %), at most 25 %
    assert Settings().memory_reserve_bytes(24 << 30) == (24 << 30) // 10
    assert Settings().memory_reserve_bytes(512 * MiB) == 128 * MiB
    assert Settings(memory_reserve="5%").memory_reserve_bytes(1000 * MiB) == 50 * MiB
    assert Settings().host_capacity_bytes(limit.limit_bytes) == 768 * MiB    # 50 % of the limit
    check_capacity(1280 * MiB, limit, reserve, settings)        # up to the limit less the reserve: fine
    with pytest.raises(ConfigError) as refused:
        check_capacity(8 << 30, limit, reserve, settings)
    assert str(refused.value) == (
        "host_capacity 8G (8192 MiB) is more than the memory limit allows: cgroup v1 memory.limit_in_bytes of "
        "/sys/fs/cgroup/memory/x is 1536 MiB, less memory_reserve 256 MiB kept free for the daemon, its fronts and "
        "clients, leaves 1280 MiB; lower host_capacity, raise the limit, or set capacity_over_limit = \"warn\"")
    check_capacity(8 << 30, limit, reserve, Settings(host_capacity="8G", capacity_over_limit="warn"))
    with pytest.raises(ConfigError, match="memory_reserve 2G .2048 MiB. leaves no room under the memory limit"):
        check_capacity(64 * MiB, limit, 2 << 30, Settings(memory_reserve="2G"))


def fake_proc(tmp_path, cgroup_lines: str, mount_lines: str):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup_lines)
    (proc / "mountinfo").write_text(mount_lines)
    return proc


def test_the_limit_that_binds_is_the_smallest_along_the_cgroups_ancestors_v1(tmp_path):
    mount = tmp_path / "memory"
    leaf = mount / "system.slice" / "modelcache.service"
    leaf.mkdir(parents=True)
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # the root: no limit
    (mount / "system.slice" / "memory.limit_in_bytes").write_text(f"{1536 * MiB}\n")
    (leaf / "memory.limit_in_bytes").write_text(f"{4096 * MiB}\n")
    proc = fake_proc(tmp_path, "4:memory:/system.slice/modelcache.service\n3:cpu:/\n",
                     f"30 25 0:27 / {mount} rw - cgroup cgroup rw,memory\n"
                     f"31 25 0:28 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu\n")
    found = memlimit.read_limit(proc)
    assert found.limit_bytes == 1536 * MiB and found.cgroup == mount / "system.slice" and found.version == 1
    assert "memory.limit_in_bytes" in found.source


def test_the_limit_that_binds_v2_memory_high_counts_and_a_namespaced_view(tmp_path):
    mount = tmp_path / "unified"
    leaf = mount / "pod"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text(f"{3 << 30}\n")
    (leaf / "memory.high").write_text(f"{2 << 30}\n")
    (leaf / "memory.current").write_text(f"{1 << 30}\n")
    (leaf / "memory.stat").write_text(f"anon 1\nactive_file {100 * MiB}\ninactive_file {156 * MiB}\nshmem 5\n")
    proc = fake_proc(tmp_path, "0::/pod\n", f"40 25 0:30 / {mount} rw - cgroup2 cgroup2 rw\n")
    found = memlimit.read_limit(proc)
    assert (found.limit_bytes, found.cgroup, found.version) == (2 << 30, leaf, 2) and "memory.high" in found.source
    assert memlimit.working_set_bytes(found) == (1 << 30) - 256 * MiB     # the page cache is reclaimable
    # In a container the cgroup namespace shows its own cgroup as "/" at the mount's root.
    (mount / "memory.max").write_text(f"{1 << 30}\n")
    proc2 = tmp_path / "p2"
    proc2.mkdir()
    (proc2 / "cgroup").write_text("0::/\n")
    (proc2 / "mountinfo").write_text(f"40 25 0:30 / {mount} rw - cgroup2 cgroup2 rw\n")
    assert memlimit.read_limit(proc2).limit_bytes == 1 << 30
    # Nothing readable: RAM.
    assert memlimit.read_limit(tmp_path / "nowhere").source == "RAM"


def test_pressure_drops_cached_answers_before_any_model(machine, caplog):
    """The response cache's answers can be computed again: under pressure they go first, and models only when
    dropping them did not free enough."""
    import numpy as np
    from modelcache.executor.response_cache import ResponseCache
    parts, guard = machine.parts, machine.guard
    for model in machine.models:
        resident(parts, model)
    cache = ResponseCache(1 * MiB)
    cache.put(b"k", "m0", {"y": np.zeros(64 * KiB // 4, np.float32)})

    def drop() -> int:   # as Serving.drop_answers: the answers were the daemon's heap, the neighbour's here
        freed = cache.clear()
        machine.neighbour -= freed
        return freed

    guard.caches.append(drop)
    machine.neighbour = machine.headroom() - guard.reserve + 16 * KiB   # short by less than the cache holds
    kept = cache.bytes
    with caplog.at_level(logging.WARNING, logger="modelcache.daemon"):
        assert guard.relieve() == kept
    assert not cache.entries and host_keys(parts) == {m.key for m in machine.models}
    assert parts.counters["pressure_evictions"] == 0 and guard.short is False
    assert "dropped 64 KiB of caches (cached answers" in caplog.text
    machine.neighbour += 16 * KiB + parts.host.model_bytes(machine.models[0].key)   # short again, nothing cached
    guard.relieve()
    assert parts.counters["pressure_evictions"] >= 1 and machine.headroom() >= guard.reserve
