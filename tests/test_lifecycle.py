"""A model's lifecycle, in process: the daemon's parts built by hand over a real host tier, a simulated
GPU (the fake allocator) and real packed models, stepped with a fake clock; no subprocess, no socket.

The rules with one owner each: one promotion however many ask (`ModelRecord.start_load` /
`finish_load`), and memory is never freed while a lease maps it (`check_freeable`, which the
caches call before they free anything).
"""

from __future__ import annotations

import os
import re

import pytest

from modelcache.daemon.cache import size_text
from modelcache.daemon.registry import ModelState
from modelcache.errors import CapacityError, IntegrityError
from modelcache.format import WEIGHTS_FILE

from daemon_parts import Parts, counting, on_device, resident

@pytest.fixture
def parts(tmp_path):
    p = Parts(tmp_path)
    yield p
    p.stop()


# -- one promotion however many ask ------------------------------------------------------------------

def test_many_opens_of_a_cold_model_share_one_promotion(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    writes = counting(parts.host, "write")
    answers = []
    hits = [parts.cache.when_resident(model, lambda error, hit, i=i: answers.append((i, error, hit)))
            for i in range(3)]
    assert hits == [False, False, False] and model.state is ModelState.LOADING
    parts.loaders.settle()
    assert len(writes) == 1
    assert sorted(answers) == [(0, None, False), (1, None, False), (2, None, False)]
    assert model.state is ModelState.RESIDENT and model.waiters == []
    assert parts.cache.when_resident(model, lambda error, hit: answers.append((3, error, hit))) is True
    assert answers[-1] == (3, None, True) and len(writes) == 1


def test_many_gpu_opens_share_one_host_and_one_device_promotion(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    host_writes, device_writes = counting(parts.host, "write"), counting(parts.tier, "write")
    answers = []
    for _ in range(3):
        parts.gpu.when_on_device(model, parts.tier, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert answers == [None, None, None]
    assert (len(host_writes), len(device_writes)) == (1, 1)
    assert model.devices[parts.uuid].state is ModelState.RESIDENT and model.tier == "gpu"


def test_a_damaged_weights_file_fails_every_waiter_and_marks_the_version(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    blob = model.disk_dir / WEIGHTS_FILE
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    answers = []
    for _ in range(2):
        parts.cache.when_resident(model, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert len(answers) == 2 and all(isinstance(e, IntegrityError) for e in answers)
    assert model.state is ModelState.ON_DISK and model.damage and parts.host.used_bytes == 0
    assert parts.counters["corrupt_detected"] == 1


# -- never free what a lease maps -----------------------------------------------------------------------

def test_a_leased_gpu_copy_is_never_freed(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = parts.registry.grant(client, model, 0.0, parts.uuid)
    frees = counting(parts.tier, "free_model")
    with pytest.raises(CapacityError, match="in use by 1 GPU session on"):
        parts.gpu.evict_named(model, "gpu")
    with pytest.raises(CapacityError, match="in use by 1 session;"):
        parts.cache.evict(model)
    with pytest.raises(CapacityError):
        model.device_evicted(parts.uuid)
    assert not parts.gpu._make_room(parts.tier, 1, loading="")    # no candidate: the one copy is leased
    assert frees == [] and model.devices[parts.uuid].leases == 1
    parts.registry.release(lease.lease_id)
    parts.cache.after_release(model, parts.uuid)
    parts.gpu.evict_named(model, "gpu")
    assert len(frees) == 1 and model.tier == "host" and parts.tier.used_bytes == 0


def test_a_host_copy_under_a_lease_or_a_gpu_load_is_not_freed(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model)
    model.hold()                              # a serve request in flight
    with pytest.raises(CapacityError):
        parts.cache.evict(model)
    assert not parts.cache.make_room(1, loading="")
    model.let_go()
    model.start_device_load(parts.uuid)       # a GPU copy reads the host copy meanwhile
    assert not model.evictable
    with pytest.raises(CapacityError, match="loading"):
        parts.cache.evict(model)
    model.finish_device_load(parts.uuid, ok=False)
    assert model.evictable
    parts.cache.evict(model)
    assert model.state is ModelState.ON_DISK and parts.host.used_bytes == 0


def test_releasing_more_than_was_held_is_a_bug_caught_at_once(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model)
    with pytest.raises(AssertionError):
        model.let_go()
    assert model.refcount == 0


def test_evicting_from_host_demotes_the_gpu_copies_first(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    parts.cache.evict(model)
    assert model.devices == {} and model.state is ModelState.ON_DISK
    assert parts.tier.used_bytes == 0 and parts.host.used_bytes == 0
    assert (parts.counters["gpu_evictions"], parts.counters["evictions"]) == (1, 1)


# -- the policy chooses, the cache frees (with the clock passed in) --------------------------------------

def test_room_is_made_from_the_least_recently_used_unheld_model(tmp_path):
    probe = Parts(tmp_path / "probe")
    try:
        one = probe.add(tmp_path / "probe", "tiny-cnn", "x")
        resident(probe, one)
        size = probe.host.model_bytes(one.key)
    finally:
        probe.stop()
    parts = Parts(tmp_path, host_capacity=str(2 * size + size // 2))   # room for two of three
    try:
        a, b, c = (parts.add(tmp_path, "tiny-cnn", n, seed) for seed, n in enumerate("abc"))  # nothing shared
        for model in (a, b):
            resident(parts, model)
            parts.clock.now += 10
        parts.cache.policy.accessed(a.key)   # a used after b: b is the least recent
        parts.clock.now += 10
        resident(parts, c)
        assert (a.state, b.state, c.state) == (ModelState.RESIDENT, ModelState.ON_DISK, ModelState.RESIDENT)
        a.pinned = True
        c.hold()                               # nothing left to evict: pinned, or held
        answers = []
        used = parts.host.used_bytes
        # No room: the request waits for it (tests/test_keepalive.py), here until its deadline passes.
        parts.cache.when_resident(b, lambda error, hit: answers.append(error), deadline=parts.clock() + 5)
        assert b.state is ModelState.WAITING and answers == [] and parts.cache.next_timer() == parts.clock() + 5
        parts.clock.now += 5
        parts.cache.on_timer(parts.clock())
        assert b.state is ModelState.ON_DISK and b.waiters == [] and len(answers) == 1
        # The tier's own figures, who holds it and why, what to do.
        assert str(answers[0]) == (
            f"waited 5.0 s for room, until the request's deadline: "
            f"b@1 needs {size_text(size)} in the host tier ({size_text(parts.host.capacity_bytes)}, "
            f"{size_text(used)} used), and the models there cannot be evicted now: a@1 (pinned), "
            f"c@1 (in use by 1 session); unpin, close sessions, or raise host_capacity")
        assert isinstance(answers[0], CapacityError) and parts.host.used_bytes == used
        c.let_go()
    finally:
        parts.stop()


def test_the_eager_policy_frees_a_model_on_its_last_release(tmp_path):
    parts = Parts(tmp_path, policy="eager")
    try:
        model = parts.add(tmp_path, "tiny-cnn", "m")
        resident(parts, model)
        client = parts.registry.new_client(1, "c", parts.clock())
        first = parts.registry.grant(client, model, 0.0)
        second = parts.registry.grant(client, model, 0.0)
        parts.registry.release(first.lease_id)
        parts.cache.after_release(model)
        assert model.state is ModelState.RESIDENT
        parts.registry.release(second.lease_id)
        parts.cache.after_release(model)
        assert model.state is ModelState.ON_DISK and parts.host.used_bytes == 0
    finally:
        parts.stop()


# -- what a refusal says: computed from what happened -------------------------------------------------

def test_a_model_larger_than_the_whole_tier_is_told_to_raise_the_setting_alone(tmp_path):
    parts = Parts(tmp_path)
    try:
        model = parts.add(tmp_path, "tiny-cnn", "m")
        parts.host.capacity_bytes = 4096
        with pytest.raises(CapacityError) as refused:
            parts.cache.when_resident(model, lambda error, hit: None)
        said = str(refused.value)
        assert "more than the whole tier (host_capacity = 4 KiB): the model alone does not fit; " \
               "raise host_capacity" in said and "close sessions" not in said and "unpin" not in said
        resident_gpu = parts.add(tmp_path, "tiny-cnn", "g", seed=1)
        parts.host.capacity_bytes = 1 << 30
        parts.tier.capacity_bytes = 4096
        answers = []
        parts.gpu.when_on_device(resident_gpu, parts.tier, lambda error, hit: answers.append(str(error)))
        parts.loaders.settle()
        assert len(answers) == 1 and re.fullmatch(
            r"g@1 needs [\d.]+ KiB in the GPU tier of GPU 0, more than the whole tier \(gpu_capacity = 4 KiB\): "
            r"the model alone does not fit; raise gpu_capacity", answers[0]), answers
    finally:
        parts.stop()


def test_a_gpu_full_of_leased_copies_names_them(parts, tmp_path):
    a, b = (parts.add(tmp_path, "tiny-cnn", n, seed) for seed, n in enumerate("ab"))
    on_device(parts, a)
    parts.tier.capacity_bytes = parts.tier.used_bytes + parts.tier.used_bytes // 2    # room for one copy
    client = parts.registry.new_client(1, "c", parts.clock())
    parts.registry.grant(client, a, 0.0, parts.uuid)
    resident(parts, b)
    used = parts.tier.used_bytes
    answers = []
    # No room: the request waits for it (tests/test_keepalive.py), here until its deadline passes.
    parts.gpu.when_on_device(b, parts.tier, lambda error, hit: answers.append(error), deadline=parts.clock() + 3)
    parts.loaders.settle()
    assert answers == [] and b.devices[parts.uuid].state is ModelState.WAITING
    parts.clock.now += 3
    parts.cache.on_timer(parts.clock())
    assert len(answers) == 1 and isinstance(answers[0], CapacityError)
    assert str(answers[0]).startswith("waited 3.0 s for room, until the request's deadline: b@1 needs ")
    assert str(answers[0]).endswith(f"({size_text(parts.tier.capacity_bytes)}, {size_text(used)} used), "
                                    "and the models there cannot be evicted now: a@1 (in use by 1 GPU session); "
                                    "close sessions, or raise gpu_capacity")
    assert parts.tier.used_bytes == used and b.devices == {}


def test_an_evict_reply_says_which_version_and_where_it_was_and_is(parts, tmp_path):
    from modelcache import protocol as P
    from modelcache.daemon.identity import Peer
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    me = Peer(b"me", (os.getuid(), os.getgid(), 1))

    def evict(tier):
        return parts.cache.on_Evict(me, P.Evict(req_id=7, name="m", tier=tier, outcome=True))

    r = evict("gpu")
    assert (r.name, r.version, r.before, r.after) == ("m", 1, ["host", f"gpu:{parts.uuid}"], ["host"])
    assert r.freed_bytes > 0 and r.req_id == 7
    r = evict("gpu")                           # not on a GPU any more: nothing done, and the reply says so
    assert (r.before, r.after, r.freed_bytes) == (["host"], ["host"], 0)
    r = evict("host")
    assert (r.before, r.after) == (["host"], []) and r.freed_bytes > 0
    r = evict("host")
    assert (r.before, r.after, r.freed_bytes) == ([], [], 0)
    # A client that predates the reply (the HTTP front's unload, say) asks for no outcome and gets its Ack.
    assert parts.cache.on_Evict(me, P.Evict(req_id=8, name="m")) == P.Ack(req_id=8)
