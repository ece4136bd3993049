"""Attach mode's lease client (client/leases.py): one open message on the lane, the connection as the lease.

Real daemons, real sessions, real sockets: a drop-in session in a fresh process must open with
no ZeroMQ and no hello, and its leases must end with its connection, not a heartbeat timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import modelcache
from modelcache import zoo
from modelcache.client.leases import LeaseClient, NoLaneOpen, shared_lease_client
from modelcache.errors import DaemonUnavailable, LeaseError, ModelNotFound
from modelcache.wire import lane, protocol as P

from conftest import DaemonProcess, stop_cleanly, wait_until

# The fresh process: what a FaaS function does, then it says what it loaded and holds its session.
FUNCTION = """
import json, sys
import numpy as np
import onnxruntime
import modelcache
sess = modelcache.InferenceSession("cnn")
feeds = dict(np.load(sys.argv[1]))
out = sess.run(None, feeds)[0]
np.save(sys.argv[2], out)
print(json.dumps({"zmq": "zmq" in sys.modules, "config": "modelcache.config" in sys.modules,
                  "client": type(sess._client).__name__}), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def slow_expiry_daemon(tmp_path):
    """A daemon whose heartbeat expiry is far off: only a connection's end can release a lease in time."""
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_LEASE_TIMEOUT_S": "120"}).start()
    yield d
    stop_cleanly(d)


def _refcount(c, name: str) -> int:
    return next(m["refcount"] for m in c.list() if m["name"] == name)


def test_a_fresh_process_opens_without_zeromq_and_its_death_releases_the_lease(slow_expiry_daemon, zoo_file,
                                                                               tmp_path):
    d = slow_expiry_daemon
    c = d.client()
    c.add(zoo_file("tiny-cnn"), "cnn")
    feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
    np.savez(tmp_path / "feeds.npz", **feeds)
    script = tmp_path / "function.py"
    script.write_text(FUNCTION)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "feeds.npz"), str(tmp_path / "out.npy")],
                            env={**d.env, "MODELCACHE_LOG_LEVEL": ""}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        said = json.loads(proc.stdout.readline())
        assert said == {"zmq": False, "config": False, "client": "LeaseClient"}
        import onnxruntime as ort
        ref = ort.InferenceSession(zoo_file("tiny-cnn"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.abs(np.load(tmp_path / "out.npy") - ref).max() < 1e-4
        function = [cl for cl in c.stats().clients if cl["pid"] == proc.pid]
        assert [(cl["name"], cl["leases"]) for cl in function] == [("function.py", 1)]
        assert _refcount(c, "cnn") == 1
        t_kill = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # The kernel closes the connection; the daemon releases at once, far within the 120 s heartbeat expiry.
        wait_until(lambda: _refcount(c, "cnn") == 0, timeout_s=10, what="the dead function's lease released")
        assert time.monotonic() - t_kill < 10
        assert all(cl["pid"] != proc.pid for cl in c.stats().clients)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        c.close()


def test_sessions_of_a_process_share_one_connection_and_closing_releases(slow_expiry_daemon, zoo_file):
    d = slow_expiry_daemon
    c = d.client()
    c.add(zoo_file("tiny-cnn"), "cnn")
    leases = LeaseClient(d.socket, timeout_s=30, name="two-sessions")
    try:
        a = modelcache.InferenceSession("cnn", client=leases)
        b = modelcache.InferenceSession("cnn", client=leases)
        mine = [cl for cl in c.stats().clients if cl["name"] == "two-sessions"]
        assert [cl["leases"] for cl in mine] == [2]
        a.close()
        assert _refcount(c, "cnn") == 1
        b.close()
        assert _refcount(c, "cnn") == 0
        again = modelcache.InferenceSession("cnn", client=leases)
        assert again.was_cache_hit
        leases.close()            # hanging up releases what is still open
        wait_until(lambda: _refcount(c, "cnn") == 0, timeout_s=10, what="the hung-up client's lease released")
        assert not [cl for cl in c.stats().clients if cl["name"] == "two-sessions"]
        with pytest.raises(DaemonUnavailable):
            leases.open("cnn")
        again.close()             # the daemon has nothing left to release; closing must not raise
    finally:
        leases.close()
        c.close()


def test_lane_opens_fail_with_the_daemons_errors(daemon, zoo_file):
    c = daemon.client()
    c.add(zoo_file("tiny-cnn"), "cnn")
    mine, theirs = LeaseClient(daemon.socket, 30), LeaseClient(daemon.socket, 30)
    try:
        with pytest.raises(ModelNotFound):
            mine.open("no-such-model")
        lease = theirs.open("cnn")
        with pytest.raises(LeaseError):          # another connection's lease is not ours to release
            mine.release(lease.lease_id)
        assert _refcount(c, "cnn") == 1
        theirs.release(lease.lease_id)
        assert _refcount(c, "cnn") == 0
        # The connection is still good after the errors.
        mine.release(mine.open("cnn").lease_id)
    finally:
        mine.close()
        theirs.close()
        c.close()


def test_a_drop_in_session_falls_back_where_the_daemon_predates_lane_opens(tmp_path):
    """An older daemon answers an open with no hello "unknown client ''": the lease client says so
    (and InferenceSession then takes the full client)."""
    path = str(tmp_path / "old.sock.lane")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def old_daemon():
        conn, _ = listener.accept()
        reader = lane.FrameReader()
        while (msg := reader.next()) is None:
            reader.feed(conn.recv(65536))
        req = P.decode(list(msg))
        conn.sendall(lane.frame(*P.encode(P.ErrorReply(
            req_id=req.req_id, code="lease",
            message="unknown client '': its lease expired or the daemon restarted; reconnect"))))
        conn.recv(1)
        conn.close()

    server = threading.Thread(target=old_daemon, daemon=True)
    server.start()
    client = LeaseClient(f"ipc://{tmp_path}/old.sock", 10)
    try:
        with pytest.raises(NoLaneOpen):
            client.open("cnn")
    finally:
        client.close()
        listener.close()
        server.join(5)


def test_no_daemon_is_a_clear_error_and_no_lane_means_the_full_client(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELCACHE_CONFIG", "")
    with pytest.raises(DaemonUnavailable, match="no socket file"):
        shared_lease_client(f"ipc://{tmp_path}/none.sock")
    assert shared_lease_client("tcp://127.0.0.1:5555") is None
    (tmp_path / "nolane.sock").touch()     # a daemon socket without a lane beside it: a daemon from before lanes
    assert shared_lease_client(f"ipc://{tmp_path}/nolane.sock") is None
    assert os.path.exists(tmp_path / "nolane.sock")


def test_the_lease_keeper_reopens_after_a_restart_and_a_close_names_the_id_of_now():
    """What both client stacks keep (client/lease_keeper.py), stepped by hand: no daemon needed."""
    from modelcache.client.lease_keeper import LeaseKeeper
    keeper, sent = LeaseKeeper(), []

    def close(lease_id):
        msg = P.Close(req_id=0, client_id="", lease_id=lease_id)
        keeper.address_close(msg)          # as rpc.Channel's prepare does, before each send
        sent.append(msg.lease_id)

    for lease_id, name in (("l1", "a"), ("l2", "b")):
        keeper.opened(P.OpenReply(req_id=0, lease_id=lease_id, name=name, version=1, skeleton_path=""), "cpu")
    # The daemon restarted: a comes back as l7, b is refused (removed meanwhile, say).
    answers = {"a": P.OpenReply(req_id=0, lease_id="l7", name="a", version=1, skeleton_path=""),
               "b": P.ErrorReply(req_id=0, code="not_found", message="no model named 'b'")}
    assert keeper.reopen(lambda name, version, device: answers[name]) == (1, ["b: no model named 'b'"])
    keeper.release("l1", lambda: close("l1"))
    keeper.release("l2", lambda: close("l2"))      # lost: the daemon has nothing to release, nothing is sent
    assert sent == ["l7"]
    assert keeper.reopen(lambda *a: pytest.fail("nothing is held any more")) == (0, [])
