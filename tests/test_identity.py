"""Identities from the kernel: a member reads through modelcache only what it can read itself, acts only
on its own client and leases and on models it added; a user outside the socket's group is refused at once.

The pure parts are checked with hand-built inputs; the rest runs a real daemon (as root) and real
client processes as other users (nobody, 65534), so it skips where the tests cannot switch users."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

import modelcache
from modelcache.daemon.identity import Admins, check_client_owner, credentials_from_peer_address, socket_credentials
from modelcache.errors import PackError, PermissionDenied
from modelcache.store.sources import check_source_names, open_model_files
from modelcache.wire import protocol as P
from modelcache.wire.lane import recv_chunk_with_fds

from conftest import DaemonProcess, stop_cleanly, wait_until

HERE = Path(__file__).parent
NOBODY = 65534
STRANGER = 54321          # another uid, with no account: owns the file nobody may read

# -- pure parts -------------------------------------------------------------------------------------


def test_peer_address_gives_credentials_only_for_an_ipc_peer():
    assert credentials_from_peer_address("localhost:1000:100:4242") == (1000, 100, 4242)
    assert credentials_from_peer_address("127.0.0.1") is None        # a tcp:// peer: anonymous
    assert credentials_from_peer_address("::1") is None
    assert credentials_from_peer_address(None) is None
    assert credentials_from_peer_address("localhost:x:0:1") is None


def test_the_kernel_names_a_unix_socket_peer():
    a, b = socket.socketpair()
    with a, b:
        assert socket_credentials(b) == (os.getuid(), os.getgid(), os.getpid())


def test_descriptors_pass_with_the_bytes_they_came_with(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights")
    a, b = socket.socketpair()
    fd = os.open(f, os.O_RDONLY)
    try:
        with a, b:
            socket.send_fds(a, [b"hello"], [fd])
            data, fds = recv_chunk_with_fds(b, memoryview(bytearray(64)))
            assert data == b"hello" and len(fds) == 1 and fds[0] != fd
            assert os.pread(fds[0], 64, 0) == b"weights"
            os.close(fds[0])
    finally:
        os.close(fd)


@pytest.mark.parametrize("names", [["m.onnx"], ["m.onnx", "m.data"], ["m.onnx", "data/w.bin"]])
def test_source_names_inside_the_model_directory_pass(names):
    check_source_names(names)


@pytest.mark.parametrize("names, says", [
    ([], "no files"),
    (["../m.onnx"], "without '..'"),
    (["m.onnx", "../../etc/shadow"], "without '..'"),
    (["m.onnx", "/etc/shadow"], "relative"),
    (["m.onnx", "a/../b"], "plain path"),
    (["m.onnx", "./b"], "plain path"),
    (["dir/m.onnx"], "may not hold a directory"),
    (["m.onnx", "w", "w"], "named twice"),
    (["m.onnx", ""], "not a file name"),
    (["m.onnx", 7], "not a file name"),
])
def test_source_names_that_leave_it_are_refused(names, says):
    with pytest.raises(PackError, match=says):
        check_source_names(names)


def test_admins_are_root_the_daemons_user_and_the_admin_group():
    admins = Admins("", daemon_uid=1000)
    peer = lambda uid, gid=5000: SimpleNamespace(uid=uid, gid=gid, pid=1)  # noqa: E731
    assert admins.is_admin(peer(0)) and admins.is_admin(peer(1000))
    assert not admins.is_admin(peer(1001)) and not admins.is_admin(peer(None))
    grouped = Admins("4242", daemon_uid=1000)
    assert grouped.is_admin(peer(1001, gid=4242)) and not grouped.is_admin(peer(1001, gid=4243))


def test_a_model_is_for_its_owner_and_admins():
    admins = Admins("", daemon_uid=1000)
    model = lambda owner: SimpleNamespace(key="cnn@1", manifest=SimpleNamespace(owner_uid=owner))  # noqa: E731
    owner, other = SimpleNamespace(uid=1001, gid=1), SimpleNamespace(uid=1002, gid=1)
    admins.check_model_owner(owner, model(1001), "remove")
    admins.check_model_owner(SimpleNamespace(uid=0, gid=0), model(1001), "remove")
    with pytest.raises(PermissionDenied, match="may not remove model cnn@1: it was added by uid 1001"):
        admins.check_model_owner(other, model(1001), "remove")
    with pytest.raises(PermissionDenied, match="unrecorded user"):       # packed before owners were kept
        admins.check_model_owner(owner, model(-1), "evict")
    with pytest.raises(PermissionDenied, match="tcp://"):
        admins.check_model_owner(SimpleNamespace(uid=None, gid=None), model(1001), "pin")


def test_a_client_id_is_its_own_process():
    client = SimpleNamespace(client_id="c1-ab", uid=1001, pid=10)
    check_client_owner(SimpleNamespace(uid=1001, pid=10), client)
    for uid, pid in ((1001, 11), (1002, 10)):   # another process of the same user, another user
        with pytest.raises(PermissionDenied, match="c1-ab"):
            check_client_owner(SimpleNamespace(uid=uid, pid=pid), client)


def test_the_client_opens_the_model_and_its_external_data(tmp_path, zoo_file):
    import onnx
    model = onnx.load(zoo_file("tiny-cnn"))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data",
                    size_threshold=0)
    names, fds = open_model_files(str(tmp_path / "m.onnx"))
    try:
        assert names == ["m.onnx", "m.data"]
        assert os.fstat(fds[1]).st_size == (tmp_path / "m.data").stat().st_size
    finally:
        for fd in fds:
            os.close(fd)
    # A file whose bytes hold no "location" names no other: one descriptor, not parsed (the packer refuses junk)
    (tmp_path / "plain.onnx").write_bytes(open(zoo_file("tiny-cnn"), "rb").read())
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07 not protobuf \xff")
    for name in ("plain.onnx", "junk.onnx"):
        names, fds = open_model_files(str(tmp_path / name))
        for fd in fds:
            os.close(fd)
        assert names == [name]
    # The bytes without external data (a doc string): parsed, one file; in junk: parsed, and refused
    model = onnx.load(zoo_file("tiny-cnn"))
    model.doc_string = "location"
    onnx.save_model(model, str(tmp_path / "doc.onnx"))
    names, fds = open_model_files(str(tmp_path / "doc.onnx"))
    for fd in fds:
        os.close(fd)
    assert names == ["doc.onnx"]
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07 location \xff")
    with pytest.raises(PackError, match="junk.onnx is not a valid ONNX model"):
        open_model_files(str(tmp_path / "junk.onnx"))
    os.mkfifo(tmp_path / "fifo.onnx")
    with pytest.raises(PackError, match="not a regular file"):   # would block the packer
        open_model_files(str(tmp_path / "fifo.onnx"))


# -- a real daemon, clients as other users ------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def shared_root():
    """A directory other users can traverse (pytest's tmp_path is 0700): the daemon's socket lives here."""
    root = Path(tempfile.mkdtemp(prefix="mc-identity-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def root_daemon(shared_root):
    d = DaemonProcess(shared_root).start()
    yield d
    stop_cleanly(d)


def run_as(daemon, actions: list, member: bool = True) -> dict:
    """Run identity_worker.py as nobody: a member of the socket's group (root's, 0) or not. (It drops root
    itself, after its imports: see its docstring for why not subprocess's user=.)"""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "MODELCACHE_SOCKET": daemon.socket, "MODELCACHE_CONFIG": "", "HOME": "/tmp"}
    proc = subprocess.run([sys.executable, str(HERE / "identity_worker.py"), str(NOBODY), str(NOBODY),
                           "0" if member else "", daemon.socket, json.dumps(actions)],
                          env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def readable_copy(src: str, root: Path, name: str) -> str:
    d = root / "models"
    d.mkdir(exist_ok=True)
    shutil.copy(src, d / name)
    (d / name).chmod(0o644)
    return str(d / name)


@needs_root
def test_a_member_acts_only_on_its_own_clients_leases_and_models(root_daemon, shared_root, zoo_file):
    with root_daemon.client() as admin:
        admin.add(zoo_file("tiny-cnn"), "rootcnn")
        lease = admin.open("rootcnn")
        mine = readable_copy(zoo_file("tiny-if"), shared_root, "if.onnx")
        out = run_as(root_daemon, [
            ["stats", "stats"],
            ["bye_other", "raw", "Goodbye", {"client_id": admin.client_id}],
            ["close_other", "raw", "Close", {"client_id": admin.client_id, "lease_id": lease.lease_id}],
            ["open_as_other", "raw", "Open", {"client_id": admin.client_id, "name": "rootcnn"}],
            ["release_other_lease", "call", "release", lease.lease_id],     # with one's own client id
            ["remove", "call", "remove", "rootcnn", 1],
            ["evict", "call", "evict", "rootcnn"],
            ["pin", "call", "pin", "rootcnn"],
            ["load", "call", "load", "rootcnn"],
            ["open", "call", "open", "rootcnn"],            # reading a model is every member's right
            ["add_own", "call", "add", mine, "nobodys"],
            ["load_own", "call", "load", "nobodys"],
            ["evict_own", "call", "evict", "nobodys"],
        ])
        assert "error" not in out["connect"], out
        assert admin.client_id not in out["stats"]["ok"]                        # others' ids are hidden
        assert out["connect"]["ok"] in out["stats"]["ok"]                       # one's own is not
        for label in ("bye_other", "close_other", "open_as_other"):
            assert out[label]["error"] == "PermissionDenied", out[label]
            assert admin.client_id in out[label]["message"]
        for label in ("remove", "evict", "pin", "load"):
            assert out[label]["error"] == "PermissionDenied", out[label]
            assert "rootcnn@1" in out[label]["message"] and "uid 65534" in out[label]["message"]
        assert out["release_other_lease"]["error"] == "LeaseError", out["release_other_lease"]
        assert out["open"]["ok"]["name"] == "rootcnn"
        assert out["add_own"]["ok"]["name"] == "nobodys"
        assert "ok" in out["load_own"] and "ok" in out["evict_own"], out
        # The admin's client and lease survived every attempt on them; the admin may act on any model.
        assert admin.client_id in [c["client_id"] for c in admin.stats().clients]
        admin.release(lease.lease_id)
        models = {m["name"]: m for m in admin.list()}
        assert set(models) == {"rootcnn", "nobodys"}
        admin.remove("nobodys", 1)
        admin.remove("rootcnn", 1)


@needs_root
def test_a_member_cannot_read_through_modelcache_a_file_it_cannot_read(root_daemon, shared_root, zoo_file):
    private = shared_root / "private"
    private.mkdir(mode=0o700)
    secret = private / "secret.onnx"
    shutil.copy(zoo_file("tiny-cnn"), secret)
    secret.chmod(0o600)
    os.chown(secret, STRANGER, STRANGER)
    os.chown(private, STRANGER, STRANGER)
    out = run_as(root_daemon, [["add", "call", "add", str(secret), "stolen"]])
    assert out["add"]["error"] == "PermissionError" and out["add"]["errno"] == 13, out   # its own open failed
    assert str(secret) in out["add"]["message"]
    # Nor can a request make the daemon open a path: an add without descriptors is refused, whoever asks.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(root_daemon.socket)
        sock.send_multipart(P.encode(P.Add(req_id=7, path=str(secret), name="stolen", files=["secret.onnx"])))
        reply = P.decode(sock.recv_multipart())
    finally:
        sock.close()
    assert isinstance(reply, P.ErrorReply) and reply.code == "pack" and "descriptors" in reply.message
    with root_daemon.client() as admin:
        assert admin.list() == []


@needs_root
def test_a_non_member_is_told_permission_denied_at_once(root_daemon, shared_root):
    out = run_as(root_daemon, [], member=False)
    assert out["connect"]["error"] == "PermissionDenied", out
    assert "permission denied" in out["connect"]["message"] and "group root" in out["connect"]["message"]
    assert out["connect"]["ms"] < 100, out
    shared_root.chmod(0o700)   # a directory on the way closed to the user: the same answer, at once
    try:
        out = run_as(root_daemon, [], member=True)
    finally:
        shared_root.chmod(0o755)
    assert out["connect"]["error"] == "PermissionDenied" and out["connect"]["ms"] < 100, out
    with modelcache.connect(root_daemon.socket) as admin:   # and the daemon is still up for those who may
        assert [c["client_id"] for c in admin.stats().clients] == [admin.client_id]


@needs_root
def test_a_lease_s_descriptors_go_to_whoever_may_read_the_host_tier_and_no_one_else(shared_root, zoo_file):
    """A member maps a model served from the repository's files though the repository is closed to it (the
    descriptors stand for the host tier's rights, not the repository's); with the host tier's directory
    closed to it, the daemon refuses the open rather than hand over what the member could not read."""
    d = DaemonProcess(shared_root, {"MODELCACHE_HOST_CAPACITY": "64K"}).start()   # every open: from the files
    try:
        with d.client() as admin:
            admin.add(zoo_file("squeezenet1_1"), "cnn")   # 4.7 MiB: larger than the whole tier
        d.repository.chmod(0o700)
        out = run_as(d, [["session", "session", "cnn"]])
        assert out["session"]["ok"]["hit"] is False, out
        d.shm_dir.chmod(0o700)
        try:
            out = run_as(d, [["session", "session", "cnn"]])
        finally:
            d.shm_dir.chmod(0o750)
        assert out["session"]["error"] == "PermissionDenied", out
        assert "uid 65534 may not read" in out["session"]["message"] and "cnn@1" in out["session"]["message"]
        with d.client() as admin:
            assert admin.stats().counters["opens_from_disk"] == 1   # the refused one had no lease
        stop_cleanly(d)
    finally:
        d.kill()


def test_a_manifest_from_before_owners_loads_as_the_admins(tmp_path, zoo_file):
    from modelcache.store.format import Manifest, load_manifest
    from modelcache.store.packing import pack
    manifest = pack(zoo_file("tiny-if"), tmp_path, "m", 1, "basic", owner_uid=4242)
    assert load_manifest(tmp_path / "m" / "1").owner_uid == 4242
    old = {k: v for k, v in json.loads((tmp_path / "m" / "1" / "manifest.json").read_text()).items() if k != "owner_uid"}
    assert Manifest.from_dict(old).owner_uid == -1 and manifest.owner_uid == 4242


@needs_root
def test_the_daemon_checks_the_descriptors_it_is_passed(root_daemon, shared_root, zoo_file):
    """A client that skips modelcache's own checks: the daemon still packs only regular files, as named."""
    import time
    from modelcache.wire.lane import connect as lane_connect
    fifo = shared_root / "fifo"
    os.mkfifo(fifo)
    good = os.open(zoo_file("tiny-cnn"), os.O_RDONLY)
    pipe = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    cases = [(["m.onnx", "m.data"], [good], "2 files named, 1 descriptors passed"),
             (["m.onnx"], [pipe], "m.onnx is not a regular file"),
             (["../m.onnx"], [good], "without '..'")]
    daemon_fds = lambda: len(os.listdir(f"/proc/{root_daemon.pid}/fd"))  # noqa: E731
    fds_before = daemon_fds()
    try:
        for files, fds, says in cases:
            lane = lane_connect(root_daemon.socket)
            try:
                lane.send(*P.encode(P.Add(req_id=3, path="/x/m.onnx", name="m", files=files)),
                          time.monotonic() + 10, fds)
                reply = P.decode(lane.receive(time.monotonic() + 10))
            finally:
                lane.close()
            assert isinstance(reply, P.ErrorReply) and says in reply.message, (says, reply)
    finally:
        os.close(good)
        os.close(pipe)
    wait_until(lambda: daemon_fds() <= fds_before, timeout_s=5, what="the daemon to close every descriptor passed")
    with root_daemon.client() as admin:
        assert admin.list() == [] and admin.stats().counters["adds"] == 0


def test_the_packer_copies_whole_files_whatever_the_descriptors_offset(tmp_path):
    from modelcache.store.sources import copy_sources
    (tmp_path / "m.onnx").write_bytes(b"model" * 1000)
    (tmp_path / "w.bin").write_bytes(bytes(range(256)) * 4096)
    fds = [os.open(tmp_path / n, os.O_RDONLY) for n in ("m.onnx", "w.bin")]
    try:
        os.lseek(fds[1], 1234, os.SEEK_SET)            # the client had read part of it
        out = tmp_path / "copy"
        out.mkdir()
        assert copy_sources(fds, ["m.onnx", "data/w.bin"], str(out)) == str(out / "m.onnx")
        assert (out / "m.onnx").read_bytes() == (tmp_path / "m.onnx").read_bytes()
        assert (out / "data" / "w.bin").read_bytes() == (tmp_path / "w.bin").read_bytes()
        assert os.lseek(fds[1], 0, os.SEEK_CUR) == 1234   # and its offset is left alone
    finally:
        for fd in fds:
            os.close(fd)


def test_descriptors_held_for_unfinished_messages_are_bounded_and_released(tmp_path):
    """One open file sent 253 times on many connections that never finish a message: the lane drops
    connections past its budget instead of holding thousands of descriptors, and frees them all."""
    from modelcache.daemon.lane_server import MAX_HELD_FDS, LaneServer
    from modelcache.wire.lane import MAX_FDS
    poller = zmq.Poller()
    server = LaneServer(str(tmp_path / "d.sock.lane"), {"bad_messages": 0})
    server.start(poller)
    fd = os.open(tmp_path, os.O_RDONLY)
    own_fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = own_fds()
    clients = []
    try:
        for _ in range(2 * MAX_HELD_FDS // MAX_FDS):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(server.path)
            socket.send_fds(c, [b"\x05"], [fd] * MAX_FDS)   # one byte of a frame header: never a message
            clients.append(c)
            for key, events in poller.poll(100):
                server.on_ready(key, events, lambda message: pytest.fail("no message was whole"))
            assert server.held_fds <= MAX_HELD_FDS
        assert len(server.conns) < len(clients)                # some were cut off
        for c in clients:
            c.close()
        for _ in range(50):
            for key, events in poller.poll(20):
                server.on_ready(key, events, lambda message: None)
        assert server.held_fds == 0 and not server.conns
        assert own_fds() <= before
    finally:
        for c in clients:
            c.close()
        server.stop()
        os.close(fd)


def test_past_the_shared_bound_the_connection_holding_the_most_descriptors_goes(tmp_path):
    """One client hoarding descriptors on several connections must not cost another its request: past
    MAX_HELD_FDS the hoarder's fullest connection is dropped, not whichever sent last."""
    from modelcache.daemon.lane_server import MAX_HELD_FDS, LaneServer
    from modelcache.wire.lane import MAX_FDS
    poller = zmq.Poller()
    server = LaneServer(str(tmp_path / "d.sock.lane"), {"bad_messages": 0})
    server.start(poller)
    fd = os.open(tmp_path, os.O_RDONLY)

    def turn():   # until the server has read all there is
        while ready := poller.poll(100):
            for key, events in ready:
                server.on_ready(key, events, lambda message: pytest.fail("no message was whole"))

    clients = []
    try:
        hoard = [MAX_FDS] * (MAX_HELD_FDS // MAX_FDS) + [MAX_HELD_FDS % MAX_FDS]
        for n in hoard + [1]:      # the hoarder's connections up to the bound, then another's request
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(server.path)
            socket.send_fds(c, [b"\x05"], [fd] * n)      # one byte of a frame header: a message on its way
            clients.append(c)
            turn()
        assert sum(hoard) == MAX_HELD_FDS and server.held_fds <= MAX_HELD_FDS
        held = sorted(len(conn.fds) for conn in server.conns.values())
        assert held[0] == 1 and len(held) < len(clients), held   # the victim stays; a hoarding connection went
    finally:
        for c in clients:
            c.close()
        for _ in range(20):
            for key, events in poller.poll(20):
                server.on_ready(key, events, lambda message: None)
        os.close(fd)
        server.stop()
