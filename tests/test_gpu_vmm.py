"""Read-only GPU sharing (gpu_sharing = "vmm-read-only") end to end, over the fake devices (`fake_gpus`).

A fake device under read-only sharing is the plumbing of CUDA's VMM sharing, for real: each allocation
a memfd the daemon maps writable and then seals, passed by SCM_RIGHTS over the lane to real client
processes that map it read-only. So a client's write to a weight is killed by the kernel, a killed
client's mapping goes with its process, descriptors are counted in /proc, and a peer that may not read
the model gets none. What only a GPU can show (cuMemSetAccess really refusing a kernel's write, device
memory and attach time against legacy IPC) is benchmarks/gpu/check_vmm.py's.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import zmq

import modelcache
from modelcache.client.device import attach_weights, handle_cache
from modelcache.cuda import vmm_token
from modelcache.daemon.identity import may_read
from modelcache.errors import CapacityError, ProtocolError
from modelcache.store.format import load_manifest
from modelcache.wire import protocol as P

from conftest import HERE, DaemonProcess, left_open, open_fds, stop_cleanly, wait_until
from vmm_worker import memfd_links

CUDA = ["CUDAExecutionProvider"]
VMM_ENV = {"MODELCACHE_FAKE_GPUS": "1x64M", "MODELCACHE_GPU_SHARING": "vmm-read-only"}
NOBODY = 65534


@pytest.fixture
def vmm_daemon(tmp_path, monkeypatch):
    """A daemon with one simulated 64 MiB GPU shared read-only; this test process is its client (drop-in sessions
    without a client= go to it through MODELCACHE_SOCKET)."""
    d = DaemonProcess(tmp_path, VMM_ENV).start()
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    monkeypatch.setenv("MODELCACHE_SOCKET", d.socket)
    yield d
    stop_cleanly(d)


def memfd_maps(pid: int | str = "self") -> dict[str, set]:
    """memfd name -> the permissions of process `pid`'s mappings of it."""
    out: dict[str, set] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/memfd:modelcache"):
                out.setdefault(parts[5].split(" (deleted)")[0].strip(), set()).add(parts[1])
    return out


def expected_sha256(d: DaemonProcess, name: str) -> dict[str, str]:
    manifest = load_manifest(d.repository / name / "1")
    return {t.name: t.sha256 for t in manifest.gpu_tensors}


def worker(d: DaemonProcess, mode: str, name: str = "cnn", become: tuple = (), **kw):
    """tests/vmm_worker.py against the daemon: a finished process (mode report/write) or a running one (hold)."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path), "MODELCACHE_CONFIG": "",
           "MODELCACHE_FAKE_GPUS": "1x64M", "HOME": "/tmp"}
    argv = [sys.executable, str(HERE / "vmm_worker.py"), d.socket, name, mode, *map(str, become)]
    if mode == "hold":
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, cwd="/")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd="/", **kw)


def model_info(client, name) -> dict:
    return next(m for m in client.list() if m["name"] == name)


def gpu_tier(stats) -> dict:
    return next(t for t in stats.tiers if t["tier"] == "gpu")


# -- the drop-in session over read-only weights --------------------------------------------------------------

def test_a_gpu_lease_maps_the_weights_read_only_and_runs_like_plain_ort(vmm_daemon, zoo_file):
    from modelcache import zoo
    with vmm_daemon.client() as c:
        for name in ("tiny-cnn", "tiny-fp16"):
            c.add(zoo_file(name), name)
            feeds = zoo.sample_inputs(zoo_file(name))
            want = ort.InferenceSession(zoo_file(name), providers=["CPUExecutionProvider"]).run(None, feeds)
            for client in (None, c):   # the lane's lease client, and the full client (its GPU opens go on the lane)
                with modelcache.InferenceSession(name, providers=CUDA, client=client) as sess:
                    lease = sess._lease
                    assert lease.ipc_kind == "fake-vmm" and lease.ipc_fds == len(lease.ipc_handles) >= 1
                    assert sess.device == "fake-0"
                    assert memfd_links() == [], "a descriptor stayed open after its allocation was mapped"
                    assert set().union(*memfd_maps().values()) == {"r--s"}     # this process: read-only
                    for a, b in zip(sess.run(None, feeds), want):
                        tol = 1e-3 if a.dtype == np.float16 else 1e-5
                        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
            assert memfd_maps() == {}, "the mapping outlived the session"
        # The daemon's own mappings are the only writable ones; it holds one descriptor per allocation.
        daemon_maps = memfd_maps(vmm_daemon.pid)
        assert daemon_maps and all(perms == {"rw-s"} for perms in daemon_maps.values()), daemon_maps
        assert sorted(memfd_links(vmm_daemon.pid)) == sorted(f"{m} (deleted)" for m in daemon_maps)
        assert gpu_tier(c.stats())["sharing"] == "vmm-read-only" and gpu_tier(c.stats())["sharing_note"] == ""
    out = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=vmm_daemon.env, capture_output=True,
                         text=True, timeout=60)
    assert "GPU 0 fake-gpu fake-0; shared read-only (vmm)" in out.stdout, out.stdout + out.stderr
    assert "shared read-only (VMM)" in vmm_daemon.log_path.read_text()


def test_a_clients_write_to_a_weight_is_killed_by_the_kernel(vmm_daemon, zoo_file):
    from modelcache import zoo
    with vmm_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        proc = worker(vmm_daemon, "write")
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
        assert "WROTE" not in proc.stdout
        report = json.loads(proc.stdout.splitlines()[0])
        assert report["kind"] == "fake-vmm" and report["fds"] == report["declared"] == 1
        assert report["sha256"] == expected_sha256(vmm_daemon, "cnn")     # bit-identical through the mapping
        assert set(report["perms"]) == {"r--s"} and report["memfds"] == []
        assert report["mprotect_write"] == "Permission denied"            # nor can it make its mapping writable
        wait_until(lambda: model_info(c, "cnn")["gpu"][0]["leases"] == 0, what="the dead writer's lease released")
        feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
        with modelcache.InferenceSession("cnn", providers=CUDA, client=c) as sess:   # the weights are as they were
            np.testing.assert_allclose(sess.run(None, feeds)[0], ort.InferenceSession(
                zoo_file("tiny-cnn"), providers=["CPUExecutionProvider"]).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_killed_clients_mapping_goes_with_it_and_eviction_then_frees_the_memory(vmm_daemon, zoo_file):
    with vmm_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        proc = worker(vmm_daemon, "hold")
        try:
            report = json.loads(proc.stdout.readline())
            assert proc.stdout.readline().strip() == "OPEN"
            held = memfd_maps(proc.pid)
            assert report["memfds"] == [] and list(held.values()) == [{"r--s"}]
            assert model_info(c, "cnn")["gpu"][0]["leases"] == 1
            with pytest.raises(CapacityError, match="in use by 1 GPU session"):
                c.evict("cnn", tier="gpu")
        finally:
            proc.kill()
            proc.wait()
        wait_until(lambda: model_info(c, "cnn")["gpu"][0]["leases"] == 0, what="the killed client's lease released")
        [name] = held
        assert name in memfd_maps(vmm_daemon.pid)
        c.evict("cnn", tier="gpu")
        # No process of the test holds the memory any more (the kernel frees a memfd with its last reference).
        assert name not in memfd_maps(vmm_daemon.pid) and memfd_links(vmm_daemon.pid) == []
        assert memfd_maps() == {} and memfd_links() == []
        assert gpu_tier(c.stats())["used_bytes"] == 0


def test_leases_and_eviction_follow_the_rules_of_legacy_ipc(vmm_daemon, zoo_file):
    with vmm_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        one = modelcache.InferenceSession("cnn", providers=CUDA, client=c)
        two = modelcache.InferenceSession("cnn", providers=CUDA)          # the lane's lease client: another client
        handle = one._lease.ipc_handles[0]
        assert handle == two._lease.ipc_handles[0] and handle_cache().refs("fake-vmm", handle) == 2
        assert len(memfd_maps()) == 1 and sum(1 for line in open("/proc/self/maps") if "memfd:modelcache" in line) == 1
        assert gpu_tier(c.stats())["leased"] == {"cnn@1": 2}
        with pytest.raises(CapacityError, match="in use by 2 GPU sessions"):
            c.evict("cnn", tier="gpu")
        one.close()
        assert handle_cache().refs("fake-vmm", handle) == 1 and len(memfd_maps()) == 1   # mapped while two uses it
        two.close()
        assert handle_cache().refs("fake-vmm", handle) == 0 and memfd_maps() == {}
        c.evict("cnn", tier="gpu")
        assert model_info(c, "cnn")["tier"] == "host"
        with modelcache.InferenceSession("cnn", providers=CUDA, client=c) as again:
            assert not again.was_cache_hit and again._lease.ipc_handles[0] != handle   # a new allocation, a new token


def test_the_daemon_keeps_no_descriptor_per_open(vmm_daemon, zoo_file):
    with vmm_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        for client in (None, c):     # once each first: the connections they keep open are not leaks
            modelcache.InferenceSession("cnn", providers=CUDA, client=client).close()
        daemon_fds = len(os.listdir(f"/proc/{vmm_daemon.pid}/fd"))
        ours = open_fds("self")
        for _ in range(25):
            for client in (None, c):
                with modelcache.InferenceSession("cnn", providers=CUDA, client=client):
                    pass
            lease = c.open("cnn", device="cuda")    # a bare lease: its descriptors are ours to close
            assert len(lease.received_fds) == 1
            os.close(lease.received_fds[0])
            c.release(lease.lease_id)
        assert len(os.listdir(f"/proc/{vmm_daemon.pid}/fd")) == daemon_fds
        assert not left_open(open_fds("self"), ours)
        assert memfd_links(vmm_daemon.pid) == [memfd_links(vmm_daemon.pid)[0]]   # one: the allocation's own


def test_zeromq_never_carries_a_gpu_lease_under_read_only_sharing(vmm_daemon, zoo_file):
    with vmm_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10000)
        try:
            sock.connect(vmm_daemon.socket)
            sock.send_multipart(P.encode(P.Hello(req_id=1, protocol_version=P.PROTOCOL_VERSION, pid=os.getpid())))
            hello = P.decode(sock.recv_multipart())
            sock.send_multipart(P.encode(P.Open(req_id=2, client_id=hello.client_id, name="cnn", device="cuda")))
            reply = P.decode(sock.recv_multipart())
        finally:
            sock.close()
        assert isinstance(reply, P.ErrorReply) and "only the daemon's lane" in reply.message
        assert model_info(c, "cnn")["tier"] == "disk"       # refused before any load


# -- who gets a descriptor -----------------------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def shared_vmm_daemon():
    """A root daemon whose lane anyone may reach (the socket opened to all): the kernel lets every user connect,
    so what stops a peer is the daemon's own check."""
    root = Path(tempfile.mkdtemp(prefix="mc-vmm-", dir="/tmp"))
    root.chmod(0o755)
    d = DaemonProcess(root, VMM_ENV).start()
    (root / "run").chmod(0o755)
    os.chmod(d.socket[len("ipc://"):] + ".lane", 0o666)
    yield d
    stop_cleanly(d)
    shutil.rmtree(root, ignore_errors=True)


@needs_root
def test_a_peer_that_may_not_read_the_model_gets_no_descriptor(shared_vmm_daemon, zoo_file):
    d = shared_vmm_daemon
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        member = worker(d, "report", become=(NOBODY, NOBODY, "0"))     # in the host tier's group: may read it
        assert member.returncode == 0, member.stderr
        got = json.loads(member.stdout.splitlines()[0])
        assert got.get("kind") == "fake-vmm" and got["sha256"] == expected_sha256(d, "cnn"), got
        stranger = worker(d, "report", become=(NOBODY, NOBODY, ""))   # connects (the socket is open to all) ...
        assert stranger.returncode == 0, stranger.stderr
        refused = json.loads(stranger.stdout.splitlines()[0])
        assert refused["error"] == "PermissionDenied" and refused["memfds"] == [], refused   # ... and gets nothing
        assert f"uid {NOBODY} may not read" in refused["message"] and "cnn@1's GPU memory" in refused["message"]
        wait_until(lambda: model_info(c, "cnn")["gpu"][0]["leases"] == 0, what="the member's lease released")
        assert all(cl["leases"] == 0 for cl in c.stats().clients)


def test_may_read_follows_the_permission_bits_of_the_file_and_its_directories():
    top = Path(tempfile.mkdtemp(prefix="mc-may-read-", dir="/tmp"))   # (pytest's tmp_path is under a 0700 directory)
    try:
        _check_may_read(top)
    finally:
        shutil.rmtree(top)


def _check_may_read(top: Path) -> None:
    d = top / "tier"
    d.mkdir()
    f = d / "skeleton.onnx"
    f.write_bytes(b"x")
    st = os.stat(f)
    owner, group = st.st_uid, st.st_gid
    other_uid = owner + 4242
    os.chmod(top, 0o755)
    os.chmod(d, 0o750)
    os.chmod(f, 0o440)
    assert may_read(str(f), other_uid, {group}) and not may_read(str(f), other_uid, {group + 4242})
    assert may_read(str(f), 0, set())                                   # root
    os.chmod(d, 0o740)                                                  # no search for the group: out of reach
    assert not may_read(str(f), other_uid, {group})
    os.chmod(d, 0o750)
    os.chmod(f, 0o040)                                                  # the owner's bits decide for the owner
    if owner != 0:
        assert not may_read(str(f), owner, {group})
    assert may_read(str(f), other_uid, {group})
    assert not may_read(str(top / "missing"), other_uid, {group})


# -- the pieces: descriptors on the lane, the reply, the client's mapping ------------------------------------

def test_descriptors_leave_with_their_reply_also_behind_a_full_socket(tmp_path):
    """A reply with descriptors queued behind a big one keeps them: each reply's descriptors arrive with it, in
    order, and the connection's own duplicates go once they are sent (or it drops)."""
    from modelcache.daemon.lane_server import LaneConnection, LaneServer
    from modelcache.wire.lane import LaneClient

    path = str(tmp_path / "x.lane")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    client = LaneClient(path, with_fds=True)
    sock, _ = listener.accept()
    sock.setblocking(False)
    server = LaneServer(path, counters={"bad_messages": 0})
    server.poller = zmq.Poller()
    server.poller.register(sock.fileno(), zmq.POLLIN)
    conn = LaneConnection(sock, server)
    server.conns[conn.fd] = conn
    files = []
    for tag in (b"first", b"second"):
        fd = os.memfd_create("lane-test")
        os.write(fd, tag)
        files.append(fd)
    before = len(os.listdir("/proc/self/fd"))
    conn.send(b"big", b"x" * (8 << 20))                    # more than the socket takes at once: the rest waits
    assert conn.out
    conn.send(b"one", b"1", [files[0]])
    conn.send(b"none", b"-")
    conn.send(b"two", b"22", [files[1], files[0]])
    assert len(os.listdir("/proc/self/fd")) == before + 3   # the connection's duplicates, until sent
    got = []
    while len(got) < 4:
        conn.flush()
        for kind, body in client.receive_all(time.monotonic() + 0.01):   # (what came; the rest after a flush)
            received = client.take_fds({b"one": 1, b"two": 2}.get(kind, 0))
            got.append((kind, [os.pread(fd, 6, 0) for fd in received]))
            for fd in received:
                os.close(fd)
    assert got == [(b"big", []), (b"one", [b"first"]), (b"none", []), (b"two", [b"second", b"first"])]
    conn.flush()
    assert conn.out_fds == [] and not conn.out
    # A connection that drops with a reply still queued closes its duplicates.
    conn.send(b"big", b"x" * (8 << 20))
    conn.send(b"one", b"1", [files[0]])
    assert conn.out_fds
    server.drop(conn, None)
    client.close()
    listener.close()
    for fd in files:
        os.close(fd)
    assert not any(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:lane-test")
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


def test_a_reply_must_bring_one_descriptor_per_handle():
    fields = dict(req_id=1, lease_id="l", name="m", version=1, skeleton_path="/x", device_uuid="fake-0",
                  ipc_kind="fake-vmm", ipc_handles=[b"a" * 32, b"b" * 32])
    assert P.decode(P.encode(P.OpenReply(**fields, ipc_fds=2))).ipc_fds == 2
    with pytest.raises(ProtocolError, match="declares 1 file descriptors for 2 handles"):
        P.decode(P.encode(P.OpenReply(**fields, ipc_fds=1)))


def test_attach_closes_every_descriptor_whatever_happens(tmp_path):
    """The client's descriptors are closed once mapped, and on every error before."""
    class Options:
        def add_initializer(self, name, value):
            self.last = (name, value)

    def memfd(data: bytes) -> int:
        fd = os.memfd_create("modelcache-attach-test")
        os.ftruncate(fd, mmap.PAGESIZE)
        os.pwrite(fd, data, 0)
        return fd

    weights = np.arange(6, dtype=np.float32)
    token = vmm_token(os.urandom(16), 1, mmap.PAGESIZE)
    row = ["w", "float32", [2, 3], 0, 0, weights.nbytes]
    fd = memfd(weights.tobytes())
    attached = attach_weights(Options(), "fake-vmm", "fake-0", [token], [row], [fd])
    with pytest.raises(OSError):
        os.fstat(fd)                                      # closed: the mapping holds the memory
    np.testing.assert_array_equal(attached.values["w"].numpy(), weights.reshape(2, 3))
    assert handle_cache().refs("fake-vmm", token) == 1
    attached.release()
    assert handle_cache().refs("fake-vmm", token) == 0
    for bad_fds, rows, says in ([[], [row], "came with 0 file descriptors"],
                                [None, [["w", "float32", [2, 3], 0, mmap.PAGESIZE, 24]], "beyond the"]):
        fds = [memfd(b"")] if bad_fds is None else bad_fds
        with pytest.raises(ProtocolError, match=says):
            attach_weights(Options(), "fake-vmm", "fake-0", [vmm_token(os.urandom(16), 2, mmap.PAGESIZE)], rows, fds)
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    fd = memfd(b"")
    with pytest.raises(ProtocolError, match="came with 1 file descriptors"):   # a kind that takes none
        attach_weights(Options(), "fake", "fake-0", [b"/dev/shm/x"], [row], [fd])
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_ctypes_structs_are_the_drivers_own():
    """cuda.py's CUmemAllocationProp and CUmemAccessDesc, byte for byte as NVIDIA's cuda-bindings lay them out."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from modelcache import cuda
    ours = cuda._device_prop(3)
    ours.allocFlags.usage = 0x1234
    theirs = driver.CUmemAllocationProp()
    theirs.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    theirs.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    theirs.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    theirs.location.id = 3
    theirs.allocFlags.usage = 0x1234
    assert ctypes.sizeof(ours) == 32 and bytes(ours) == ctypes.string_at(theirs.getPtr(), 32)
    access = cuda._CUmemAccessDesc(cuda._CUmemLocation(1, 5), cuda.CU_MEM_ACCESS_FLAGS_PROT_READ)
    want = driver.CUmemAccessDesc()
    want.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    want.location.id = 5
    want.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    assert bytes(access) == ctypes.string_at(want.getPtr(), ctypes.sizeof(access))
    for name in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
        assert getattr(cuda, name) == int(getattr(driver.CUdevice_attribute, name))


def test_the_setting_is_off_by_default_and_checked():
    from modelcache.config import ConfigError, load
    assert load(env={}).gpu_sharing == "ipc"
    assert load(env={"MODELCACHE_GPU_SHARING": "VMM-Read-Only"}).gpu_sharing == "vmm-read-only"
    with pytest.raises(ConfigError, match="MODELCACHE_GPU_SHARING=rw: gpu_sharing must be one of ipc, vmm-read-only"):
        load(env={"MODELCACHE_GPU_SHARING": "rw"})
    out = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "--gpu-sharing {ipc,vmm-read-only}" in out.stdout and "read-only" in out.stdout
