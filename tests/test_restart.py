"""Warm restart: a daemon that starts where one died re-adopts its host tier, byte-checked."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

import modelcache
from modelcache import zoo

from conftest import DaemonProcess, dead_pid


@pytest.fixture(autouse=True)
def shm_env(tmp_path, monkeypatch):
    """A private shm_dir: a daemon of another checkout starting meanwhile removes every dead tier it
    finds in /dev/shm, ours included. Daemons started here inherit it; it is checked empty after."""
    shm = Path("/dev/shm") / f"mc-restart-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    monkeypatch.setenv("MODELCACHE_SHM_DIR", str(shm))
    yield shm
    left = list(shm.iterdir())
    import shutil
    shutil.rmtree(shm, ignore_errors=True)
    assert not left, f"left behind in shm: {left}"


def _sigkill(d: DaemonProcess) -> Path:
    """Kill the daemon as a crash would (no cleanup); returns the host tier it leaves."""
    tier = d.shm_dir
    d.proc.kill()
    d.proc.wait()
    d.log.close()
    assert tier.exists()
    return tier


def _restart(d: DaemonProcess, **kw) -> DaemonProcess:
    return DaemonProcess(d.root, **kw).start()


def _stop(d: DaemonProcess) -> None:
    shm = d.shm_dir
    rc = d.stop()
    d.kill()
    assert rc == 0, d.log_path.read_text()
    assert not shm.exists()


def test_restart_after_a_crash_readopts_the_host_tier(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.add(zoo_file("tiny-vit"), "vit")
        assert not c.open("cnn").hit
        assert not c.open("vit").hit
    old = _sigkill(d)
    d2 = _restart(d)
    try:
        assert not old.exists() and d2.shm_dir.exists()      # claimed: renamed to the new daemon's name
        with d2.client() as c:
            assert c.stats().counters["adopted"] == 2
            assert c.open("cnn").hit and c.open("vit").hit
            assert c.stats().counters["promotions"] == 0
            sess = modelcache.InferenceSession("cnn", client=c)
            assert sess.was_cache_hit
            feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
            ref = _plain_ort(zoo_file("tiny-cnn"), feeds)
            assert abs(sess.run(None, feeds)[0] - ref).max() < 1e-4
            sess.close()
    finally:
        _stop(d2)


def test_a_corrupted_segment_is_not_adopted(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    old = _sigkill(d)
    seg = next(old.glob("seg-*.bin"))
    os.chmod(seg, 0o640)
    with open(seg, "r+b") as f:           # one flipped byte, in the first tensor
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    d2 = _restart(d)
    try:
        with d2.client() as c:
            assert c.stats().counters["adopted"] == 0
            assert not c.open("cnn").hit                     # promoted again from disk
            feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
            with modelcache.InferenceSession("cnn", client=c) as sess:
                assert abs(sess.run(None, feeds)[0] - _plain_ort(zoo_file("tiny-cnn"), feeds)).max() < 1e-4
        assert "does not match the manifest" in d2.log_path.read_text()
    finally:
        _stop(d2)


def test_a_clean_stop_clears_the_tier_unless_told_to_keep_it(tmp_path, zoo_file):
    keep = {"MODELCACHE_KEEP_HOST_TIER": "1"}
    d = DaemonProcess(tmp_path, extra_env=keep).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    tier = d.shm_dir
    assert d.stop() == 0
    assert tier.exists()                                    # kept for the next daemon
    d2 = _restart(d)                                        # (without keep: its own stop clears)
    try:
        with d2.client() as c:
            assert c.open("cnn").hit
    finally:
        _stop(d2)


def test_a_dead_tier_of_another_socket_is_left_alone(tmp_path, zoo_file):
    a = DaemonProcess(tmp_path / "a")
    (tmp_path / "a").mkdir()
    a.start()
    with a.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    tier_a = _sigkill(a)
    (tmp_path / "b").mkdir()
    b = DaemonProcess(tmp_path / "b").start()
    try:
        assert tier_a.exists()                              # a's, for a's next daemon
        a2 = _restart(a)
        try:
            with a2.client() as c:
                assert c.open("cnn").hit
        finally:
            _stop(a2)
    finally:
        _stop(b)


def _plain_ort(path: str, feeds: dict):
    import onnxruntime as ort
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_clients_reconnect_and_keep_their_sessions_through_a_crash(tmp_path, zoo_file, monkeypatch):
    from modelcache.client import leases as lane_leases
    from modelcache.errors import DaemonUnavailable
    from conftest import wait_until

    d = DaemonProcess(tmp_path).start()
    monkeypatch.setenv("MODELCACHE_SOCKET", d.socket)      # for the process-wide client of drop-in sessions
    feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
    ref = _plain_ort(zoo_file("tiny-cnn"), feeds)
    c = d.client(timeout_s=60)
    c.add(zoo_file("tiny-cnn"), "cnn")
    dropin = modelcache.InferenceSession("cnn")              # on the process's lease client, over the lane
    explicit = modelcache.InferenceSession("cnn", client=c)  # on a full client, over ZeroMQ
    shared = lane_leases.shared_lease_client()
    assert dropin._client is shared
    _sigkill(d)
    with pytest.raises(DaemonUnavailable):
        c.list()                                             # the one call the outage costs
    d2 = _restart(d)
    try:
        # No call from either client: the full client's heartbeat and the lease client's watcher find the
        # new daemon and re-open their leases.
        def leases():
            return sorted(cl["leases"] for cl in c.stats().clients)
        assert wait_until(lambda: leases() == [1, 1], what="both clients back with one lease each")
        assert [m["refcount"] for m in c.list()] == [2]
        for sess in (dropin, explicit):                      # their mappings never stopped working
            assert abs(sess.run(None, feeds)[0] - ref).max() < 1e-4
        fresh = modelcache.InferenceSession("cnn")           # a new drop-in open, on the same lease client
        assert fresh.was_cache_hit and fresh._client is shared and lane_leases.shared_lease_client() is shared
        assert abs(fresh.run(None, feeds)[0] - ref).max() < 1e-4
        for sess in (dropin, explicit, fresh):
            sess.close()
        assert [m["refcount"] for m in c.list()] == [0]     # the old lease ids released the new leases
        c.close()
        shared.close()
    finally:
        _stop(d2)


def test_a_stray_reply_of_any_kind_is_dropped_by_request_id(tmp_path):
    """A late answer to an abandoned request (here: a list_ok to a request the client gave up on)
    must not break the next call, whose reply is of another kind."""
    d = DaemonProcess(tmp_path).start()
    try:
        c = d.client()
        from modelcache.wire import protocol as P
        conn = c._zmq.connect()                # the client's connection; an id no call of it waits for
        conn.send(*P.encode(P.ListModels(req_id=10**9)), time.monotonic() + 5)
        assert c.stats().pid == d.pid          # reads past the stray list_ok, no ProtocolError
        c.close()
    finally:
        _stop(d)


@pytest.mark.parametrize("garbage", [bytes(random.Random(0).randrange(256) for _ in range(64)), b"\xff\xfe\x00", b""],
                         ids=["random bytes", "invalid utf-8", "empty"])
def test_a_dead_tier_whose_owner_file_is_garbage_is_swept_not_fatal(tmp_path, shm_env, zoo_file, garbage):
    """Another daemon's dead tier whose `owner` holds random bytes: no daemon can re-adopt it, so the start
    sweeps it (naming the file) and comes up."""
    dead = shm_env / f"modelcache.{os.getuid()}.{dead_pid()}"
    dead.mkdir()
    (dead / "owner").write_bytes(garbage)
    (dead / "seg-0.bin").write_bytes(b"\0" * 4096)
    d = DaemonProcess(tmp_path).start()
    try:
        assert not dead.exists()
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
            assert not c.open("cnn").hit
    finally:
        _stop(d)
    log = d.log_path.read_text()
    assert "internal error" not in log and "Traceback" not in log
    assert str(dead) in log, log
