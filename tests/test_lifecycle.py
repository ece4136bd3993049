"""A model's lifecycle, in process: the daemon's parts built by hand over a real host tier, a simulated
GPU (the fake allocator) and real packed models, stepped with a fake clock; no subprocess, no socket.

The rules, each run against every tier (the host tier's residency manager and the GPU's: one type,
daemon/residency/): one promotion however many ask (`TierCopy.start_load` / `finish_load`); memory a
lease maps is never freed (`TierCopy.check_freeable`, asked in `Residency.evict`, the one method that
frees); the policy chooses, the manager frees; refusals say what holds the tier. Then what only the
chain of tiers has: a GPU copy holds the host copy it came from, and goes first when that is freed.
"""

from __future__ import annotations

import os
import re

import pytest

from modelcache.daemon.residency import REQUEST, WORKER, Hold, ModelState
from modelcache.daemon.wording import size_text
from modelcache.errors import CapacityError, IntegrityError, LeaseError
from modelcache.store.format import WEIGHTS_FILE

from daemon_parts import Parts, counting, on_device, resident

TIERS = ["host", "gpu"]


@pytest.fixture
def parts(tmp_path):
    p = Parts(tmp_path)
    yield p
    p.stop()


def tier_of(parts: Parts, which: str):
    return parts.residency if which == "host" else parts.device


def one_model_bytes(tmp_path, which: str) -> int:
    probe = Parts(tmp_path / "probe")
    try:
        residency = tier_of(probe, which)
        one = probe.add(tmp_path / "probe", "tiny-cnn", "x")
        resident(probe, one, residency)
        return residency.tier.model_bytes(one.key)
    finally:
        probe.stop()


# -- one promotion however many ask ------------------------------------------------------------------

@pytest.mark.parametrize("which", TIERS)
def test_many_requests_for_a_cold_model_share_one_promotion(parts, tmp_path, which):
    residency = tier_of(parts, which)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    writes = {r.id: counting(r.tier, "write") for r in parts.tiers}
    answers = []
    hits = [residency.when_resident(model, lambda error, hit, i=i: answers.append((i, error, hit)))
            for i in range(3)]
    assert hits == [False, False, False]
    parts.loaders.settle()
    assert {k: len(v) for k, v in writes.items()} == {r.id: 1 if r is residency or r is residency.below else 0
                                                       for r in parts.tiers}   # (a GPU copy: the host's first)
    assert sorted(answers) == [(0, None, False), (1, None, False), (2, None, False)]
    copy = model.tier_copies[residency.id]
    assert copy.state is ModelState.RESIDENT and copy.waiters == [] and model.tier == which
    assert residency.when_resident(model, lambda error, hit: answers.append((3, error, hit))) is True
    assert answers[-1] == (3, None, True) and len(writes[residency.id]) == 1


def test_a_damaged_weights_file_fails_every_waiter_and_marks_the_version(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    blob = model.disk_dir / WEIGHTS_FILE
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    answers = []
    for _ in range(2):
        parts.residency.when_resident(model, lambda error, hit: answers.append(error))
    parts.loaders.settle()
    assert len(answers) == 2 and all(isinstance(e, IntegrityError) for e in answers)
    assert model.state is ModelState.ON_DISK and model.damage and parts.host.used_bytes == 0
    assert parts.counters["corrupt_detected"] == 1


# -- never free what a lease maps -----------------------------------------------------------------------

@pytest.mark.parametrize("which", TIERS)
def test_a_leased_copy_is_never_freed(parts, tmp_path, which):
    residency = tier_of(parts, which)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model, residency)
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = parts.lease(client, model, residency)
    frees = {r.id: counting(r.tier, "free_model") for r in parts.tiers}
    session = "session" if which == "host" else "GPU session"
    for r in parts.tiers:   # (a GPU lease holds the host copy too)
        if r.is_resident(model):
            with pytest.raises(CapacityError, match=f"in use by 1 {session if r is residency else 'session'}"):
                r.evict(model)
            assert not r._make_room(1, loading="")        # no candidate: the one copy is leased
    assert all(f == [] for f in frees.values()) and model.tier_copies[residency.id].holds == 1
    parts.release(lease)
    residency.evict(model)
    assert len(frees[residency.id]) == 1 and residency.tier.used_bytes == 0


@pytest.mark.parametrize("which", TIERS)
def test_letting_go_without_holding_is_a_bug_caught_at_once(parts, tmp_path, which):
    """A copy is let go only by a holder that holds it; a hold ended twice lets go once."""
    residency = tier_of(parts, which)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model, residency)
    copy = model.tier_copies[residency.id]
    with pytest.raises(AssertionError, match="does not hold it"):
        copy.let_go(Hold(REQUEST, model))
    hold = residency.hold_request(model)
    other = residency.hold_request(model)
    residency.end(hold)
    residency.end(hold)
    assert copy.holds == 1 and list(copy.holders) == [other]
    residency.end(other)
    assert copy.holds == 0 and model.host.holds == 0


# -- the policy chooses, the manager frees (with the clock injected) ----------------------------------------

def test_every_hold_names_its_holder_and_a_refusal_says_each_kind(parts, tmp_path):
    """Leases, requests in flight and serve-mode GPU workers hold copies alike; what a refusal says (and what it
    advises) comes from the holders themselves, and re-partitioning minds all but the GPU workers."""
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = parts.lease(client, model)
    request = parts.residency.hold_request(model)
    with pytest.raises(CapacityError, match=r"in use by 1 session and 1 request in flight; .*requests in flight"):
        parts.residency.demote(model)
    parts.release(lease)
    parts.residency.end(request)
    parts.device.hold_for_worker(model, worker_id=7)
    parts.device.hold_for_worker(model, worker_id=7)          # (once per worker, however often asked)
    assert model.tier_copies[parts.uuid].holds == 1 and model.host.holds == 1
    with pytest.raises(CapacityError, match=r"in use by 1 serve-mode GPU worker on .*serve_idle_s"):
        parts.device.demote(model)
    parts.residency.check_unheld(model, "partition", ignoring=WORKER)   # its sessions go with the old stages
    with pytest.raises(CapacityError, match="1 serve-mode GPU worker hold it"):
        parts.residency.check_unheld(model, "partition")
    end = parts.device.worker_done(model.key, worker_id=7)
    assert parts.device.worker_done(model.key, worker_id=7) is None   # (detached at once: a new hold is its own)
    end()
    assert model.tier_copies[parts.uuid].holds == 0 and model.host.holds == 0
    assert parts.device.demote(model) > 0 and parts.residency.demote(model) > 0


def test_a_clients_leases_end_in_every_tier_when_it_leaves(parts, tmp_path):
    """One lease table for every tier: a close names a lease of the caller's own, and a client that leaves
    ends each lease it held, on the host and on a GPU."""
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    client = parts.registry.new_client(1, "c", parts.clock())
    other = parts.registry.new_client(2, "d", parts.clock())
    host_lease, gpu_lease = parts.lease(client, model), parts.lease(client, model, parts.device)
    theirs = parts.lease(other, model)
    assert (model.host.holds, model.tier_copies[parts.uuid].holds) == (3, 1)
    with pytest.raises(LeaseError):
        parts.residency.close(theirs.lease_id, client.client_id)    # another client's lease
    with pytest.raises(LeaseError):
        parts.residency.close("l0-none", client.client_id)
    assert {lease.lease_id for lease in parts.residency.drop_client(client.client_id)} == \
        {host_lease.lease_id, gpu_lease.lease_id}
    assert (model.host.holds, model.tier_copies[parts.uuid].holds) == (1, 0)
    assert len(parts.residency.leases) == 1 and parts.device.leases is parts.residency.leases
    parts.residency.close(theirs.lease_id, other.client_id)
    assert model.host.holds == 0 and len(parts.residency.leases) == 0


@pytest.mark.parametrize("which", TIERS)
def test_room_is_made_from_the_least_recently_used_unheld_copy_and_a_full_tier_says_what_holds_it(tmp_path, which):
    size = one_model_bytes(tmp_path, which)
    parts = Parts(tmp_path)
    try:
        residency = tier_of(parts, which)
        residency.tier.capacity_bytes = 2 * size + size // 2        # room for two of three
        a, b, c = (parts.add(tmp_path, "tiny-cnn", n, seed) for seed, n in enumerate("abc"))  # nothing shared
        for model in (a, b):
            resident(parts, model, residency)
            parts.clock.now += 10
        residency.accessed(a)                  # a used after b: b is the least recent
        parts.clock.now += 10
        resident(parts, c, residency)
        assert [residency.is_resident(m) for m in (a, b, c)] == [True, False, True]
        a.pin(True)
        client = parts.registry.new_client(1, "c", parts.clock())
        parts.lease(client, c, residency)      # nothing left to evict: pinned, or held
        answers = []
        used = residency.tier.used_bytes
        # No room: the request waits for it (tests/test_keepalive.py), here until its deadline passes.
        residency.when_resident(b, lambda error, hit: answers.append(error), deadline=parts.clock() + 5)
        parts.loaders.settle()
        assert b.tier_copies[residency.id].state is ModelState.WAITING and answers == []
        assert parts.next_timer() == parts.clock() + 5
        parts.clock.now += 5
        parts.on_timer(parts.clock())
        assert b.tier_copies[residency.id].state is ModelState.ON_DISK and len(answers) == 1
        tier, session = residency.tier, "session" if which == "host" else "GPU session"
        # The tier's own figures, who holds it and why, what to do.
        assert str(answers[0]) == (
            f"waited 5.0 s for room, until the request's deadline: "
            f"b@1 needs {size_text(size)} in {tier.where} ({size_text(tier.capacity_bytes)}, "
            f"{size_text(used)} used), and the models there cannot be evicted now: a@1 (pinned), "
            f"c@1 (in use by 1 {session}); unpin, close sessions, or raise {tier.capacity_setting}")
        assert isinstance(answers[0], CapacityError) and tier.used_bytes == used
    finally:
        parts.stop()


@pytest.mark.parametrize("which", TIERS)
def test_the_eager_policy_frees_a_copy_on_its_last_release(tmp_path, which):
    parts = Parts(tmp_path, policy="eager")
    try:
        residency = tier_of(parts, which)
        model = parts.add(tmp_path, "tiny-cnn", "m")
        resident(parts, model, residency)
        client = parts.registry.new_client(1, "c", parts.clock())
        first, second = parts.lease(client, model, residency), parts.lease(client, model, residency)
        parts.release(first)
        assert residency.is_resident(model)
        parts.release(second)
        assert not residency.is_resident(model) and residency.tier.used_bytes == 0
    finally:
        parts.stop()


# -- what a refusal says: computed from what happened -------------------------------------------------

@pytest.mark.parametrize("which", TIERS)
def test_a_model_larger_than_the_whole_tier_is_told_to_raise_the_setting_alone(parts, tmp_path, which):
    residency = tier_of(parts, which)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    residency.tier.capacity_bytes = 4096
    answers = []
    try:     # (the first tier missing the model raises; a tier above hears of it once the one below has it)
        residency.when_resident(model, lambda error, hit: answers.append(error))
        parts.loaders.settle()
    except CapacityError as e:
        answers.append(e)
    (said,) = map(str, answers)
    setting = residency.tier.capacity_setting
    assert re.fullmatch(rf"m@1 needs [\d.]+ KiB in {residency.tier.where}, more than the whole tier \({setting} = "
                        rf"4 KiB\): the model alone does not fit; raise {setting}", said), said


# -- the chain of tiers: a GPU copy holds the host copy it came from ------------------------------------------

def test_a_host_copy_under_a_request_or_a_gpu_load_is_not_freed(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model)
    request = parts.residency.hold_request(model)   # a serve request in flight
    with pytest.raises(CapacityError, match="in use by 1 request in flight"):
        parts.residency.evict(model)
    assert not parts.residency._make_room(1, loading="")
    parts.residency.end(request)
    gpu_copy = model.copy_in(parts.uuid)
    gpu_copy.start_load()                     # a GPU copy reads the host copy meanwhile
    assert not model.host.evictable
    with pytest.raises(CapacityError, match="loading"):
        parts.residency.evict(model)
    gpu_copy.finish_load(ok=False)
    assert model.host.evictable
    parts.residency.evict(model)
    assert model.state is ModelState.ON_DISK and parts.host.used_bytes == 0


def test_evicting_from_host_demotes_the_gpu_copies_first(parts, tmp_path):
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    parts.residency.evict(model)
    assert model.devices == {} and model.state is ModelState.ON_DISK
    assert parts.tier.used_bytes == 0 and parts.host.used_bytes == 0
    assert (parts.counters["gpu_evictions"], parts.counters["evictions"]) == (1, 1)


def test_an_evict_reply_says_which_version_and_where_it_was_and_is(parts, tmp_path):
    from modelcache.daemon.identity import Peer
    from modelcache.wire import protocol as P
    model = parts.add(tmp_path, "tiny-cnn", "m")
    on_device(parts, model)
    me = Peer(b"me", (os.getuid(), os.getgid(), 1))

    def evict(tier):
        return parts.models.on_Evict(me, P.Evict(req_id=7, name="m", tier=tier, outcome=True))

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
    assert parts.models.on_Evict(me, P.Evict(req_id=8, name="m")) == P.Ack(req_id=8)
