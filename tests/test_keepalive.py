"""The daemon's timers and its room queue, in process (issue 29): the keep-alive and pre-warm deadlines of
the timed policies (`keepalive`, `hybrid`, eviction/timed.py) as the owner loop runs them
(Residency.next_timer / on_timer, each tier's), and requests that wait for room in a full tier instead of failing.

The daemon's parts are built by hand over a real host tier, a simulated GPU and real packed models
(tests/daemon_parts.py); opens and closes go through Sessions as the daemon takes them; the clock is
stepped by hand. The real daemon's side is in test_daemon.py (test_keepalive_unloads_an_idle_model...).
"""

from __future__ import annotations

import pytest

from modelcache.daemon.residency import ModelState
from modelcache.errors import CapacityError
from modelcache.wire import protocol as P

from daemon_parts import IDENT, Parts, on_device, resident

def call(parts: Parts, client, name: str, deadline_ms: float | None = None, device: str = "cpu"):
    return parts.open(client, name, deadline_ms, device)


def close(parts: Parts, client, reply: P.OpenReply) -> None:
    parts.sessions.on_Close(IDENT, P.Close(req_id=2, client_id=client.client_id, lease_id=reply.lease_id))


def tick(parts: Parts, seconds: float) -> None:
    """Time passes; the owner loop runs what is due, and the loads that starts land."""
    parts.clock.now += seconds
    parts.on_timer(parts.clock())
    parts.loaders.settle()


def one_model_bytes(tmp_path) -> int:
    probe = Parts(tmp_path / "probe")
    try:
        model = probe.add(tmp_path / "probe", "tiny-cnn", "x")
        resident(probe, model)
        return probe.host.model_bytes(model.key)
    finally:
        probe.stop()


@pytest.fixture
def make(tmp_path):
    made = []

    def build(**kw):
        # The room queue, seen through opens that wait for it (open_when_full = wait; serve requests always do).
        # With the default an open the tier cannot take maps the repository's files: test_disk_opens.py.
        parts = Parts(tmp_path, **{"open_when_full": "wait", **kw})
        made.append(parts)
        return parts
    yield build
    for parts in made:
        parts.stop()


# -- keep-alive -----------------------------------------------------------------------------------

def test_keepalive_unloads_an_idle_model_when_its_window_ends_and_never_while_in_use(make, tmp_path):
    parts = make(policy="keepalive", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = call(parts, client, "m")
    assert isinstance(lease, P.OpenReply) and model.state is ModelState.RESIDENT
    tick(parts, 600)                                  # long past the window, but in use
    assert model.state is ModelState.RESIDENT and parts.models.describe(model)["why"] == "in use"
    close(parts, client, lease)                       # its window ended while it was in use: it goes now
    assert parts.next_timer() <= parts.clock()
    tick(parts, 0)
    assert model.state is ModelState.ON_DISK and parts.counters["unloads"] == 1 and parts.host.used_bytes == 0

    lease = call(parts, client, "m")
    opened_at = parts.clock()
    close(parts, client, lease)
    view = parts.models.describe(model)
    assert view["why"] == "kept alive" and view["keep_alive_until"] == parts.wall() + 60
    assert parts.next_timer() == opened_at + 60
    tick(parts, 59.9)
    assert model.state is ModelState.RESIDENT
    tick(parts, 0.1)
    assert model.state is ModelState.ON_DISK and parts.counters["unloads"] == 2
    assert parts.models.describe(model)["why"] == "" and parts.next_timer() is None


def test_a_call_cancels_the_pending_unload(make, tmp_path):
    parts = make(policy="keepalive", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    close(parts, client, call(parts, client, "m"))
    tick(parts, 50)
    close(parts, client, call(parts, client, "m"))    # a call 50 s in: kept until 60 s after it
    tick(parts, 11)                                   # the first window's end has passed
    assert model.state is ModelState.RESIDENT
    tick(parts, 49)
    assert model.state is ModelState.ON_DISK


def test_a_serve_request_counts_as_a_call(make, tmp_path):
    """Serving.on_Infer tells the policies of a request as Sessions does of an open (here: what it calls)."""
    parts = make(policy="keepalive", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model)          # created without a call: the fallback keep-alive, from its load
    assert parts.models.describe(model)["keep_alive_until"] == parts.wall() + 60
    tick(parts, 30)
    request = parts.residency.hold_request(model)
    parts.residency.accessed(model)
    parts.residency.end(request)
    tick(parts, 59)
    assert model.state is ModelState.RESIDENT
    tick(parts, 1)
    assert model.state is ModelState.ON_DISK


def test_a_pinned_model_is_never_unloaded(make, tmp_path):
    parts = make(policy="keepalive", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    close(parts, client, call(parts, client, "m"))
    model.pin(True)
    tick(parts, 3600)
    assert model.state is ModelState.RESIDENT and parts.counters["unloads"] == 0
    assert parts.models.describe(model)["why"] == "pinned"


def test_a_gpu_copy_is_demoted_when_its_window_ends(make, tmp_path):
    parts = make(policy="keepalive", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = call(parts, client, "m", device="cuda")
    assert isinstance(lease, P.OpenReply) and model.tier == "gpu"
    tick(parts, 120)
    assert model.tier == "gpu"                        # leased: kept
    close(parts, client, lease)
    tick(parts, 0)
    assert model.devices == {} and model.state is ModelState.ON_DISK and parts.tier.used_bytes == 0


# -- hybrid: pre-warm before a periodic call, unload after the tail ------------------------------------

def test_hybrid_prewarms_before_a_periodic_call_and_unloads_after_the_tail(make, tmp_path):
    parts = make(policy="hybrid", keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    for _ in range(6):             # five idle times of 10 minutes: a representative histogram
        close(parts, client, call(parts, client, "m"))
        tick(parts, 600)
    # Learned: head 600 s (pre-warm at 540 s, 10 % early), tail 660 s (kept until 726 s). Between calls the
    # model goes as soon as the call is over.
    lease = call(parts, client, "m")
    assert lease.hit is False and parts.residency.policy.windows(model.key) == (600.0, 660.0)
    called_at = parts.clock()
    close(parts, client, lease)
    tick(parts, 0)
    assert model.state is ModelState.ON_DISK
    view = parts.models.describe(model)
    assert view["next_call"] == parts.wall() + 600 and view["keep_alive_until"] is None
    tick(parts, 539)
    assert model.state is ModelState.ON_DISK
    tick(parts, 1)                                    # 540 s: pre-warmed, disk -> host
    assert model.state is ModelState.RESIDENT and parts.counters["prewarms"] == 1
    assert parts.models.describe(model)["why"] == "pre-warmed, kept alive"
    tick(parts, 60)
    lease = call(parts, client, "m")                  # the call finds it warm
    assert lease.hit is True and parts.clock() == called_at + 600
    assert parts.models.describe(model)["why"] == "in use"
    close(parts, client, lease)
    tick(parts, 0)
    tick(parts, 540)                                  # pre-warmed again; this time no call comes
    assert model.state is ModelState.RESIDENT
    tick(parts, 185.9)
    assert model.state is ModelState.RESIDENT
    tick(parts, 0.2)                                  # 726 s: past the tail (+10 %), unloaded
    assert model.state is ModelState.ON_DISK and parts.counters["unloads"] >= 1


@pytest.mark.parametrize("policy, kept", [("hybrid", True), ("hybrid-sized", False)])
def test_hybrid_sized_lets_a_thin_tail_go_that_hybrid_keeps(make, tmp_path, policy, kept):
    """Bursts of three calls 90 s apart, 30 minutes between bursts; keep_alive_s = 60 prices a cold start at
    a minute of holding the model (the tier's only one: the mean size). hybrid keeps it to its tail (31
    minutes); for hybrid-sized a 30-minute wait for one call in three is not worth a minute: it goes."""
    parts = make(policy=policy, keep_alive_s=60)
    model = parts.add(tmp_path, "tiny-cnn", "m")
    client = parts.registry.new_client(1, "c", parts.clock())
    for burst in range(4):
        for i in range(3):
            close(parts, client, call(parts, client, "m"))
            tick(parts, 90 if i < 2 else 30 * 60)
    close(parts, client, call(parts, client, "m"))    # idle times: 8 of 90 s, 4 of 30 minutes
    assert parts.residency.policy.windows(model.key) == (60.0, 31 * 60.0)
    tick(parts, 0)
    tick(parts, 5 * 60)
    assert (model.state is ModelState.RESIDENT) is kept
    assert (parts.models.describe(model)["keep_alive_until"] is not None) is kept


def test_a_prewarm_never_exceeds_capacity_nor_displaces_a_model_in_use(make, tmp_path):
    size = one_model_bytes(tmp_path)
    parts = make(policy="hybrid", keep_alive_s=60, host_capacity=str(size + size // 2))   # room for one
    periodic, busy = parts.add(tmp_path, "tiny-cnn", "p"), parts.add(tmp_path, "tiny-cnn", "b", seed=1)
    client = parts.registry.new_client(1, "c", parts.clock())
    for _ in range(7):
        close(parts, client, call(parts, client, "p"))
        tick(parts, 0)
        if _ < 6:
            tick(parts, 600)
    prewarms = parts.counters["prewarms"]             # (between its calls p was pre-warmed: the tier was free)
    holder = call(parts, client, "b")                 # the only slot, in use when p's pre-warm comes due
    assert busy.state is ModelState.RESIDENT and periodic.state is ModelState.ON_DISK
    tick(parts, 540)
    assert periodic.state is ModelState.ON_DISK and busy.state is ModelState.RESIDENT   # dropped
    assert parts.counters["prewarms"] == prewarms and parts.host.used_bytes <= parts.host.capacity_bytes
    close(parts, client, holder)


# -- oversubscription: waiting for room ------------------------------------------------------------------

def test_requests_for_a_full_tier_wait_and_are_served_in_arrival_order(make, tmp_path):
    size = one_model_bytes(tmp_path)
    parts = make(host_capacity=str(size + size // 2))                   # room for one
    a, b, c = (parts.add(tmp_path, "tiny-cnn", n, seed) for seed, n in enumerate("abc"))
    first, second, third = (parts.registry.new_client(i, n, parts.clock()) for i, n in enumerate("xyz"))
    lease_a = call(parts, first, "a")
    assert call(parts, second, "b") is None and call(parts, third, "c") is None       # both wait
    assert (b.state, c.state) == (ModelState.WAITING, ModelState.WAITING)
    assert parts.models.describe(b)["why"] == "waiting for room (1 request)"
    close(parts, first, lease_a)                      # room: the first to come goes first
    parts.loaders.settle()
    assert a.state is ModelState.ON_DISK and b.state is ModelState.RESIDENT and c.state is ModelState.WAITING
    lease_b = parts.replies[-1]
    assert isinstance(lease_b, P.OpenReply) and lease_b.name == "b"
    close(parts, second, lease_b)
    parts.loaders.settle()
    assert isinstance(parts.replies[-1], P.OpenReply) and parts.replies[-1].name == "c"
    assert c.state is ModelState.RESIDENT and parts.host.used_bytes <= parts.host.capacity_bytes


def test_a_waiter_whose_deadline_passes_is_told_what_held_the_tier(make, tmp_path):
    size = one_model_bytes(tmp_path)
    parts = make(host_capacity=str(size + size // 2))
    parts.add(tmp_path, "tiny-cnn", "a")
    b = parts.add(tmp_path, "tiny-cnn", "b", seed=1)
    holder, waiter = parts.registry.new_client(1, "x", parts.clock()), parts.registry.new_client(2, "y", parts.clock())
    call(parts, holder, "a")
    assert call(parts, waiter, "b", deadline_ms=2000) is None
    assert parts.next_timer() == parts.clock() + 2
    tick(parts, 1.9)
    assert b.state is ModelState.WAITING
    tick(parts, 0.1)
    refusal = parts.replies[-1]
    assert isinstance(refusal, P.ErrorReply) and refusal.code == "capacity"
    assert refusal.message.startswith("waited 2.0 s for room, until the request's deadline: b@1 needs ")
    assert "a@1 (in use by 1 session); close sessions, or raise host_capacity" in refusal.message
    assert b.state is ModelState.ON_DISK and b.host.waiters == [] and not parts.residency.room


def test_a_model_loaded_for_no_request_makes_room_for_one_waiting_as_it_lands(make, tmp_path):
    """`load a` is copying a into the one slot when b's open comes: b waits (a model being copied is no
    victim); once a lands with no session on it, b takes its room then, not when its deadline passes."""
    size = one_model_bytes(tmp_path)
    parts = make(host_capacity=str(size + size // 2))                   # room for one
    a = parts.add(tmp_path, "tiny-cnn", "a")
    b = parts.add(tmp_path, "tiny-cnn", "b", seed=1)
    loaded = []
    parts.residency.when_resident(a, lambda error, hit: loaded.append(error))   # as `modelcache load a` asks
    assert a.state is ModelState.LOADING
    client = parts.registry.new_client(1, "x", parts.clock())
    parts.sessions.on_Open(IDENT, P.Open(req_id=1, client_id=client.client_id, name="b", deadline_ms=60_000))
    assert b.state is ModelState.WAITING
    parts.loaders.settle()                            # a lands, answering the load; b then evicts it
    assert loaded == [None]
    assert isinstance(parts.replies[-1], P.OpenReply) and parts.replies[-1].name == "b"
    assert (a.state, b.state) == (ModelState.ON_DISK, ModelState.RESIDENT) and not parts.residency.room


def test_a_model_larger_than_the_tier_is_refused_at_once_even_behind_a_queue(make, tmp_path):
    size = one_model_bytes(tmp_path)
    parts = make(host_capacity=str(size + size // 2))
    parts.add(tmp_path, "tiny-cnn", "a")
    parts.add(tmp_path, "tiny-cnn", "b", seed=1)
    big = parts.add(tmp_path, "tiny-vit", "big")     # 15x tiny-cnn's weights
    client = parts.registry.new_client(1, "x", parts.clock())
    with pytest.raises(CapacityError, match="the model alone does not fit; raise host_capacity"):
        call(parts, client, "big")                    # nothing waits: planned, and refused
    call(parts, client, "a")
    assert call(parts, client, "b") is None           # b waits for room
    with pytest.raises(CapacityError, match="the model alone does not fit; raise host_capacity"):
        call(parts, client, "big")                    # behind b: still refused at once, not queued
    assert big.state is ModelState.ON_DISK and big.host.waiters == [] and list(parts.residency.room.models) == [
        parts.registry.by_key("b@1").host]


# -- the real daemon ---------------------------------------------------------------------------------------

def test_a_real_daemon_unloads_an_idle_model_and_makes_an_open_wait_for_room(tmp_path):
    """eviction_policy=keepalive with a short keep_alive_s: `ls` says why a model is there, then it is gone;
    with the host tier's one slot held by a client, another client's open waits, and succeeds when it closes."""
    import os
    import subprocess
    import sys
    import threading

    from modelcache import zoo
    from conftest import DaemonProcess, stop_cleanly, wait_until

    for name, seed in (("a", 0), ("b", 1)):   # ~4.7 MiB each, nothing shared: one fits in 6M, two do not
        zoo.save(zoo.build("squeezenet1_1", seed), str(tmp_path / f"{name}.onnx"))
    d = DaemonProcess(tmp_path, {"MODELCACHE_EVICTION_POLICY": "keepalive", "MODELCACHE_KEEP_ALIVE_S": "6",
                                 "MODELCACHE_HOST_CAPACITY": "6M", "MODELCACHE_OPEN_WHEN_FULL": "wait"}).start()
    try:
        def ls(command: str = "ls") -> str:
            return subprocess.run([sys.executable, "-m", "modelcache.cli", command], env={**os.environ,
                                  "MODELCACHE_SOCKET": d.socket, "MODELCACHE_CONFIG": ""}, capture_output=True,
                                  text=True, timeout=60, check=True).stdout

        def state(c, name) -> str:
            return next(m["state"] for m in c.listing().models if m["name"] == name)

        with d.client() as holder, d.client() as waiter:
            holder.add(str(tmp_path / "a.onnx"), "a")
            holder.add(str(tmp_path / "b.onnx"), "b")
            holder.release(holder.open("a").lease_id)
            # `ls` is a fresh process: on a loaded machine its start took longer than a 1.5 s keep-alive
            row = next(line for line in ls().splitlines() if line.startswith("a "))
            assert " resident " in row and row.endswith(" left)") and "kept alive (" in row, row
            wait_until(lambda: state(holder, "a") == "on_disk", 30, "a unloaded after its keep-alive")
            assert "WHY" in ls().splitlines()[0]

            lease = holder.open("a")                          # the only slot, held
            got = []
            t = threading.Thread(target=lambda: got.append(waiter.open("b")))
            t.start()
            wait_until(lambda: state(holder, "b") == "waiting", 30, "b's open waiting for room")
            assert got == [] and "waiting for room (1 request)" in ls()
            host_line = next(line for line in ls("status").splitlines() if line.startswith("host "))
            assert host_line.endswith("; 1 request waiting for room (1 model)"), host_line
            holder.release(lease.lease_id)                    # room: b's open goes on
            t.join(30)
            assert len(got) == 1 and got[0].name == "b" and got[0].hit is False
            assert state(holder, "a") == "on_disk"
            waiter.release(got[0].lease_id)
        stop_cleanly(d)
    finally:
        d.kill()


def test_a_prewarm_never_jumps_a_request_waiting_for_room(make, tmp_path):
    size = one_model_bytes(tmp_path)
    parts = make(policy="hybrid", keep_alive_s=60, host_capacity=str(size + size // 2))   # room for one
    parts.add(tmp_path, "tiny-cnn", "p")
    parts.add(tmp_path, "tiny-cnn", "h", seed=1)
    w = parts.add(tmp_path, "tiny-cnn", "w", seed=2)
    client = parts.registry.new_client(1, "c", parts.clock())
    for i in range(7):                                # p learns a 10-minute period
        close(parts, client, call(parts, client, "p"))
        tick(parts, 0 if i == 6 else 600)
    holder = call(parts, client, "h")
    assert call(parts, client, "w", deadline_ms=3.6e6) is None and w.state is ModelState.WAITING   # an hour
    prewarms = parts.counters["prewarms"]
    tick(parts, 540)                                  # p's pre-warm is due while w waits: it does not go first
    assert parts.counters["prewarms"] == prewarms and parts.registry.by_key("p@1").state is ModelState.ON_DISK
    close(parts, client, holder)                      # room: the waiting request's model, not the pre-warm
    parts.loaders.settle()
    assert w.state is ModelState.RESIDENT and parts.replies[-1].name == "w"


def b_waits_behind_a(make, tmp_path):
    """A tier with room for one model: a is in use, b's open waits for room. Returns (parts, b, one model's size)."""
    size = one_model_bytes(tmp_path)
    parts = make(host_capacity=str(size + size // 2))
    parts.add(tmp_path, "tiny-cnn", "a")
    b = parts.add(tmp_path, "tiny-cnn", "b", seed=1)
    client = parts.registry.new_client(1, "c", parts.clock())
    call(parts, client, "a")
    assert call(parts, client, "b") is None
    return parts, b, size


def test_more_capacity_serves_the_requests_waiting_for_room(make, tmp_path):
    """A reload that raises host_capacity calls admit() (server.py), as here."""
    parts, b, size = b_waits_behind_a(make, tmp_path)
    parts.host.capacity_bytes = 3 * size
    parts.residency.admit()
    parts.loaders.settle()
    assert b.state is ModelState.RESIDENT and parts.replies[-1].name == "b"


def test_a_stopping_daemon_answers_the_requests_waiting_for_room(make, tmp_path):
    parts, b, _ = b_waits_behind_a(make, tmp_path)
    parts.stop_waiting()
    said = parts.replies[-1]
    assert isinstance(said, P.ErrorReply) and said.code == "daemon_unavailable" and "b@1 waited for room" in said.message
    assert b.state is ModelState.ON_DISK and not parts.residency.room


# -- oversubscription on a GPU: waiting for room on the device ------------------------------------------

def gpu_room_for_one(make, tmp_path, names: str = "abc"):
    """A GPU tier with room for one tiny-cnn copy (the host tier has room for all), the first model opened on
    it by a client. Returns (parts, the models, that client, its lease)."""
    parts = make()
    models = [parts.add(tmp_path, "tiny-cnn", n, seed) for seed, n in enumerate(names)]
    holder = parts.registry.new_client(1, "holder", parts.clock())
    lease = call(parts, holder, names[0], device="cuda")
    assert isinstance(lease, P.OpenReply) and models[0].tier == "gpu"
    parts.tier.capacity_bytes = parts.tier.used_bytes + parts.tier.used_bytes // 2
    return parts, models, holder, lease


def test_gpu_opens_for_a_full_device_wait_and_are_served_in_arrival_order(make, tmp_path):
    parts, (a, b, c), holder, lease_a = gpu_room_for_one(make, tmp_path)
    second, third = (parts.registry.new_client(i, n, parts.clock()) for i, n in ((2, "y"), (3, "z")))
    assert call(parts, second, "b", device="cuda") is None and call(parts, third, "c", device="cuda") is None
    assert [m.devices[parts.uuid].state for m in (b, c)] == [ModelState.WAITING, ModelState.WAITING]
    assert list(parts.device.room.models) == [b.devices[parts.uuid], c.devices[parts.uuid]]
    assert parts.models.describe(b)["why"].endswith("waiting for room on GPU 0 (1 request)")
    assert b.state is ModelState.RESIDENT and not b.host.evictable       # its host copy stays for the promotion
    close(parts, holder, lease_a)                     # room: the first to come goes first, a is demoted
    parts.loaders.settle()
    assert a.devices == {} and b.tier == "gpu" and c.devices[parts.uuid].state is ModelState.WAITING
    lease_b = parts.replies[-1]
    assert isinstance(lease_b, P.OpenReply) and lease_b.name == "b" and lease_b.device_uuid == parts.uuid
    close(parts, second, lease_b)
    parts.loaders.settle()
    assert isinstance(parts.replies[-1], P.OpenReply) and parts.replies[-1].name == "c"
    assert c.tier == "gpu" and b.devices == {} and parts.tier.used_bytes <= parts.tier.capacity_bytes
    assert not parts.device.room and parts.counters["gpu_promotions"] == 3


def test_a_gpu_waiter_whose_deadline_passes_is_told_what_held_the_device(make, tmp_path):
    parts, (a, b), holder, _ = gpu_room_for_one(make, tmp_path, "ab")
    waiter = parts.registry.new_client(2, "y", parts.clock())
    assert call(parts, waiter, "b", deadline_ms=2000, device="cuda") is None
    assert parts.next_timer() == parts.clock() + 2
    tick(parts, 1.9)
    assert b.devices[parts.uuid].state is ModelState.WAITING
    tick(parts, 0.1)
    refusal = parts.replies[-1]
    assert isinstance(refusal, P.ErrorReply) and refusal.code == "capacity"
    assert refusal.message.startswith("waited 2.0 s for room, until the request's deadline: b@1 needs ")
    assert "in the GPU tier of GPU 0" in refusal.message
    assert "a@1 (in use by 1 GPU session); close sessions, or raise gpu_capacity" in refusal.message
    assert b.devices == {} and b.host.evictable and not parts.device.room and parts.next_timer() is None
    # A serve request does not wait for a GPU (the CPU serves it): refused at once, nothing queued.
    answers = []
    parts.device.when_resident(b, lambda error, hit: answers.append(error), wait=False)
    assert len(answers) == 1 and "a@1 (in use by 1 GPU session)" in str(answers[0]) and b.devices == {}


def test_a_model_larger_than_the_device_is_refused_at_once_even_behind_a_queue(make, tmp_path):
    parts, (a, b), holder, _ = gpu_room_for_one(make, tmp_path, "ab")
    big = parts.add(tmp_path, "tiny-vit", "big")     # 15x tiny-cnn's weights
    client = parts.registry.new_client(2, "y", parts.clock())
    refused = call(parts, client, "big", device="cuda")   # nothing waits: planned, and refused
    assert isinstance(refused, P.ErrorReply) and refused.message.endswith(
        "the model alone does not fit; raise gpu_capacity")
    assert call(parts, client, "b", device="cuda") is None          # b waits for room
    refused = call(parts, client, "big", device="cuda")             # behind b: still refused at once
    assert isinstance(refused, P.ErrorReply) and refused.message.endswith(
        "the model alone does not fit; raise gpu_capacity")
    assert big.devices == {} and list(parts.device.room.models) == [b.devices[parts.uuid]]


def test_a_stopping_daemon_answers_the_requests_waiting_for_room_on_a_gpu(make, tmp_path):
    parts, (a, b), holder, _ = gpu_room_for_one(make, tmp_path, "ab")
    assert call(parts, parts.registry.new_client(2, "y", parts.clock()), "b", device="cuda") is None
    parts.stop_waiting()
    said = parts.replies[-1]
    assert isinstance(said, P.ErrorReply) and said.code == "daemon_unavailable"
    assert "b@1 waited for room in the GPU tier of GPU 0" in said.message
    assert b.devices == {} and not parts.device.room


def test_a_gpu_prewarm_never_jumps_a_request_waiting_for_room(make, tmp_path):
    """a is held on the device and b, as large, waits for room there; p (much smaller) would fit in what is
    left: its pre-warm does not take that while b waits, and does once b is served."""
    parts = make()
    parts.add(tmp_path, "squeezenet1_1", "a")        # (~4.7 MiB each, no tensor shared: b never fits beside a)
    b, p = parts.add(tmp_path, "squeezenet1_1", "b", seed=1), parts.add(tmp_path, "tiny-cnn", "p")
    on_device(parts, p)
    small = parts.tier.used_bytes
    parts.device.evict(p)        # (its host copy stays)
    holder, waiter = parts.registry.new_client(1, "x", parts.clock()), parts.registry.new_client(2, "y", parts.clock())
    lease_a = call(parts, holder, "a", device="cuda")
    parts.tier.capacity_bytes = parts.tier.used_bytes + small + small // 2   # room for a and p, not a and b
    assert call(parts, waiter, "b", device="cuda") is None
    parts.device._prewarm(p)                 # as its policy's timer would
    assert p.devices == {} and parts.counters["gpu_prewarms"] == 0
    close(parts, holder, lease_a)
    parts.loaders.settle()
    assert b.tier == "gpu" and parts.replies[-1].name == "b"
    parts.device._prewarm(p)                 # nothing waits now: it goes, in the room left beside b
    parts.loaders.settle()
    assert p.tier == "gpu" and parts.counters["gpu_prewarms"] == 1


def test_status_and_metrics_show_the_keep_alive_window_and_the_next_call():
    import io
    import time

    from modelcache.cli import print_keep_alive, print_models
    from modelcache.daemon.metrics import render
    from modelcache.histogram import Histogram

    now = time.time()
    models = [{"name": "m", "version": 1, "bytes": 1 << 20, "host_bytes": 1 << 20, "gpu_bytes": 0, "tier": "host",
               "state": "resident", "refcount": 0, "hits": 3, "pinned": False, "last_use": now, "gpu": [],
               "why": "kept alive", "keep_alive_until": now + 300, "next_call": now + 900}]
    out = io.StringIO()
    print_models(models, out)
    print_keep_alive(models, out)
    text = out.getvalue()
    assert text.splitlines()[0].endswith(" WHY") and text.splitlines()[1].endswith("kept alive (5m left)")
    assert "m@1: host: kept until " in text and "(in 5m); next call expected " in text and "(in 15m)" in text
    tiers = [{"tier": "host", "used_bytes": 1 << 20, "capacity_bytes": 2 << 20, "waiting": {"models": 2, "requests": 3}},
             {"tier": "gpu", "device": "GPU-1", "used_bytes": 0, "capacity_bytes": 0, "waiting": {"models": 0, "requests": 0}},
             {"tier": "disk", "used_bytes": 0, "capacity_bytes": 0}]
    metrics = render({}, tiers, models, 0, 1.0, Histogram(), ["resident"])
    assert 'modelcache_tier_waiting_requests{tier="host"} 3' in metrics
    assert 'modelcache_tier_waiting_requests{tier="gpu",device="GPU-1"} 0' in metrics
    assert 'modelcache_tier_waiting_requests{tier="disk"}' not in metrics
    assert f'modelcache_model_keep_alive_until_timestamp_seconds{{model="m",version="1"}} {now + 300:.3f}' in metrics
    assert f'modelcache_model_next_call_timestamp_seconds{{model="m",version="1"}} {now + 900:.3f}' in metrics
