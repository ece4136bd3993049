"""Integration: a real daemon subprocess, real client processes, real shared memory and sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import zmq

import modelcache
from modelcache import zoo
from modelcache.errors import DaemonUnavailable, InputError, LeaseError, ModelNotFound, PackError
from modelcache.wire import protocol as P
from conftest import HERE, TINY, DaemonProcess, run_client, stop_cleanly, wait_until

FULL_ZOO = ["squeezenet1_1", "resnet50", "googlenet", "alexnet", "vit_b_16", "vgg16"]


def check_in_fresh_process(daemon, name, src, tmp_path, feeds=None):
    """Open `name` in a separate client process and compare its outputs with plain ORT on `src`."""
    feeds = feeds or zoo.sample_inputs(src)
    np.savez(tmp_path / f"{name}-in.npz", **feeds)
    out = tmp_path / f"{name}-out.npz"
    r = run_client(daemon.socket, "run", name, str(tmp_path / f"{name}-in.npz"), str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = np.load(out)
    for i, want in enumerate(ref):
        g = got[f"arr_{i}"]
        assert g.dtype == want.dtype and g.shape == want.shape
        np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-4)
    return report


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_from_a_fresh_process_match_plain_ort(daemon, client, zoo_file, tmp_path, name):
    client.add(zoo_file(name), name)
    report = check_in_fresh_process(daemon, name, zoo_file(name), tmp_path)
    if report["perms"]:  # models with weights: mapped, read-only, shared, from the daemon's /dev/shm
        assert all(seg.startswith(str(daemon.shm_dir)) for seg in report["segments"])
        # ours read-only and shared; ORT's own mmap of a pre-packed weight and its blobs is private
        # copy-on-write (rw-p) and never written: test_prepack checks it holds no anonymous page
        assert all(p.startswith("r") and ("w" not in p and p.endswith("s") or p.endswith("p"))
                   for p in report["perms"])


@pytest.mark.slow
def test_every_zoo_model_matches_plain_ort(daemon, client, zoo_file, tmp_path):
    for name in FULL_ZOO:
        client.add(zoo_file(name), name)
        report = check_in_fresh_process(daemon, name, zoo_file(name), tmp_path)
        assert report["perms"], f"{name}: weights not mapped from shared memory"


def test_open_hit_miss_refcount_and_ls(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "m")
    client.add(zoo_file("tiny-cnn"), "m")           # version 2
    assert [(m["name"], m["version"], m["tier"]) for m in client.list()] == [("m", 1, "disk"), ("m", 2, "disk")]
    a = modelcache.InferenceSession("m", client=client)
    assert a.model_version == 2 and not a.was_cache_hit
    b = modelcache.InferenceSession("m", version=2, client=client)
    assert b.was_cache_hit
    m2 = {m["version"]: m for m in client.list()}[2]
    assert (m2["refcount"], m2["tier"], m2["hits"]) == (2, "host", 1)
    a.close()
    b.close()
    b.close()  # idempotent
    assert {m["version"]: m for m in client.list()}[2]["refcount"] == 0
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "ls"], env=daemon.env, capture_output=True, text=True)
    assert r.returncode == 0 and "host" in r.stdout and "m" in r.stdout


def test_ls_shows_each_tiers_own_charge_not_the_stored_variants(daemon, client, zoo_file):
    """BYTES counted the CPU and GPU weights both, while a daemon without a GPU tier holds only the CPU ones:
    users sized host_capacity from it. HOST is the host tier's charge (before loading, what loading takes)."""
    client.add(zoo_file("tiny-cnn"), "m")
    before = client.list()[0]
    client.load("m")
    after = client.list()[0]
    used = client.stats().tiers[0]["used_bytes"]
    assert after["host_bytes"] == used and after["gpu_bytes"] == 0     # the tier's own figure
    assert before["host_bytes"] <= used <= before["host_bytes"] + 64 * 1024      # (up to the tensors' alignment)
    assert after["bytes"] > used                                       # the stored file: both variants
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "ls"], env=daemon.env, capture_output=True, text=True)
    header, row = r.stdout.splitlines()
    assert header.split()[:8] == ["NAME", "VER", "HOST", "FREES", "GPU", "DISK", "TIER", "STATE"], header
    # FREES: what evicting it would free; all of HOST, as it shares no tensor with another model.
    assert row.split()[2:10] == [*f"{used / 1024:.1f} KiB".split(), *f"{used / 1024:.1f} KiB".split(), "-",
                                 *f"{after['bytes'] / 1024:.1f} KiB".split(), "host"], row


def test_ls_lists_the_remote_stores_models(tmp_path, zoo_file):
    from modelcache.store.packing import pack
    from modelcache.tiers.remote import publish
    store = tmp_path / "store"
    pack(zoo_file("tiny-cnn"), store, "far", 3)
    publish(store)
    d = DaemonProcess(tmp_path, {"MODELCACHE_REMOTE": store.as_uri()}).start()
    try:
        r = subprocess.run([sys.executable, "-m", "modelcache.cli", "ls"], env=d.env, capture_output=True, text=True)
        assert r.returncode == 0 and "no models" not in r.stdout, r.stdout + r.stderr
        row = r.stdout.splitlines()[1].split()
        assert (row[0], row[1], row[2], row[3], row[4], row[7], row[8]) == ("far", "3", "-", "-", "-", "remote",
                                                                            "remote"), r.stdout
    finally:
        stop_cleanly(d)


def test_session_surface_matches_onnxruntime(daemon, client, zoo_file):
    src = zoo_file("tiny-cnn")
    client.add(src, "cnn")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    with modelcache.InferenceSession("cnn", client=client) as s:
        assert [(i.name, i.shape, i.type) for i in s.get_inputs()] == \
               [(i.name, i.shape, i.type) for i in ref.get_inputs()]
        assert [o.name for o in s.get_outputs()] == [o.name for o in ref.get_outputs()]
        feeds = zoo.sample_inputs(src, batch=3)
        np.testing.assert_allclose(s.run(["logits"], feeds)[0], ref.run(["logits"], feeds)[0], rtol=1e-4, atol=1e-5)


def test_wrong_inputs_are_clear_errors(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "cnn")
    with modelcache.InferenceSession("cnn", client=client) as s:
        good = zoo.sample_inputs(zoo_file("tiny-cnn"))["input"]
        with pytest.raises(InputError, match="unknown input 'img'.*takes input"):
            s.run(None, {"img": good})
        with pytest.raises(InputError, match="missing input 'input'"):
            s.run(None, {})
        with pytest.raises(InputError, match="must be float32, got float64"):
            s.run(None, {"input": good.astype(np.float64)})
        with pytest.raises(InputError, match=r"must have shape \['batch', 3, 32, 32\]"):
            s.run(None, {"input": good[:, :, :16]})
        assert s.run(None, {"input": good})[0].shape == (1, 10)  # still usable


def test_unknown_model_and_version(daemon, client, zoo_file):
    with pytest.raises(ModelNotFound, match="repository is empty"):
        client.open("ghost")
    client.add(zoo_file("tiny-cnn"), "cnn")
    with pytest.raises(ModelNotFound, match="no model named 'ghost'; known models: cnn"):
        modelcache.InferenceSession("ghost", client=client)
    with pytest.raises(ModelNotFound, match=r"has no version 7; it has \[1\]"):
        modelcache.InferenceSession("cnn", version=7, client=client)


def test_bad_add_keeps_daemon_and_models_intact(daemon, client, zoo_file, tmp_path):
    client.add(zoo_file("tiny-cnn"), "cnn")
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(PackError, match="not a valid ONNX model"):
        client.add(str(bad), "broken")
    with pytest.raises(FileNotFoundError, match="missing.onnx"):   # the client opens the file, not the daemon
        client.add(str(tmp_path / "missing.onnx"), "missing")
    with pytest.raises(PackError, match="invalid model name"):
        client.add(zoo_file("tiny-cnn"), "a/b")
    with pytest.raises(PackError, match="already exists"):
        client.add(zoo_file("tiny-cnn"), "cnn", version=1)
    assert [m["name"] for m in client.list()] == ["cnn"]
    with modelcache.InferenceSession("cnn", client=client) as s:
        assert s.run(None, zoo.sample_inputs(zoo_file("tiny-cnn")))[0].shape == (1, 10)


def raw_socket(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(daemon.socket)
    return sock


@pytest.mark.parametrize("frames, says", [
    ([b"open"], "2 frames"),
    ([b"open", b"\xc1\xc1\xc1"], "not valid msgpack"),
    ([b"teleport", msgpack.packb({"req_id": 1})], "unknown message kind"),
    ([b"open", msgpack.packb({"req_id": 9, "client_id": 5, "name": "m"})], "client_id: expected str"),
    ([b"open_ok", msgpack.packb({"req_id": 9})], "missing field"),
    ([b"ok", msgpack.packb({"req_id": 9})], "is a reply, not a request"),
    ([b"a", b"b", b"c", b"d"], "2 frames"),
])
def test_malformed_messages_get_errors_and_daemon_stays_up(daemon, client, zoo_file, frames, says):
    client.add(zoo_file("tiny-cnn"), "cnn")
    sess = modelcache.InferenceSession("cnn", client=client)  # a model in use while garbage arrives
    sock = raw_socket(daemon)
    sock.send_multipart(frames)
    reply = P.decode(sock.recv_multipart())
    assert isinstance(reply, P.ErrorReply) and reply.code == "protocol" and says in reply.message
    sock.close()
    # The daemon still answers and the model is intact, its lease included.
    assert {m["name"]: m["refcount"] for m in client.list()} == {"cnn": 1}
    assert sess.run(None, zoo.sample_inputs(zoo_file("tiny-cnn")))[0].shape == (1, 10)
    assert client.stats().counters["bad_messages"] >= 1
    sess.close()


def test_truncated_frame_and_empty_message(daemon, client):
    sock = raw_socket(daemon)
    body = msgpack.packb({"req_id": 3, "client_id": "c", "name": "m"})
    sock.send_multipart([b"open", body[:5]])
    assert P.decode(sock.recv_multipart()).code == "protocol"
    sock.send(b"")
    assert P.decode(sock.recv_multipart()).code == "protocol"
    sock.close()
    assert client.list() == []


def test_protocol_version_mismatch_is_clear(daemon):
    sock = raw_socket(daemon)
    sock.send_multipart(P.encode(P.Hello(req_id=1, protocol_version=999, pid=os.getpid())))
    reply = P.decode(sock.recv_multipart())
    assert reply.code == "protocol" and "protocol 999" in reply.message
    sock.close()


def test_unknown_lease_and_client(daemon, client):
    with pytest.raises(LeaseError):
        client.release("l-nope")
    sock = raw_socket(daemon)
    sock.send_multipart(P.encode(P.Open(req_id=4, client_id="stranger", name="m")))
    assert P.decode(sock.recv_multipart()).code == "lease"
    sock.close()


def test_killed_client_releases_its_references(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "cnn")
    env = {**os.environ, "MODELCACHE_SOCKET": daemon.socket}
    holder = subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "hold", "cnn"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "OPEN"
    assert client.list()[0]["refcount"] == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    wait_until(lambda: client.list()[0]["refcount"] == 0, timeout_s=10, what="the killed client's lease to go")
    assert client.stats().counters["clients_lost"] >= 1


def test_silent_client_loses_its_lease_after_the_timeout(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path, {"MODELCACHE_LEASE_TIMEOUT_S": "1.0", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.2"}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
            sock = raw_socket(d)  # a client that says hello, opens, and then never beats
            sock.send_multipart(P.encode(P.Hello(req_id=1, protocol_version=P.PROTOCOL_VERSION, pid=0)))
            cid = P.decode(sock.recv_multipart()).client_id
            sock.send_multipart(P.encode(P.Open(req_id=2, client_id=cid, name="cnn")))
            assert isinstance(P.decode(sock.recv_multipart()), P.OpenReply)
            assert c.list()[0]["refcount"] == 1
            wait_until(lambda: c.list()[0]["refcount"] == 0, timeout_s=10, what="lease expiry")
            sock.close()
    finally:
        assert d.stop() == 0
        d.kill()


def test_concurrent_cold_opens_share_one_promotion(daemon, client, zoo_file):
    client.add(zoo_file("resnet50"), "r50")
    clients = [daemon.client() for _ in range(8)]
    barrier = threading.Barrier(len(clients))
    results, errors = [], []

    def open_one(c):
        try:
            barrier.wait()
            results.append(c.open("r50"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = client.stats()
    assert stats.counters["promotions"] == 1
    assert len({r.lease_id for r in results}) == 8 and stats.models[0]["refcount"] == 8
    for c in clients:
        c.close()
    assert client.list()[0]["refcount"] == 0


def test_no_daemon_is_a_fast_clear_error(tmp_path):
    with pytest.raises(DaemonUnavailable, match="modelcache daemon"):
        modelcache.connect(f"ipc://{tmp_path}/nobody.sock")


def test_daemon_death_is_visible_to_the_client(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    c = d.client(timeout_s=60)
    c.add(zoo_file("tiny-cnn"), "cnn")
    sess = modelcache.InferenceSession("cnn", client=c)
    d.kill()
    with pytest.raises(DaemonUnavailable, match="lost the connection"):
        c.list()
    # The session keeps working: its mapping outlives the daemon.
    assert sess.run(None, zoo.sample_inputs(zoo_file("tiny-cnn")))[0].shape == (1, 10)
    sess.close()
    c.close()


def test_a_killed_daemons_socket_file_is_refused_at_once_not_after_the_hello_timeout(tmp_path, zoo_file):
    """SIGKILL leaves the socket file; libzmq would retry the refused connect in the background, so a
    client's hello (and every reconnect of a client that lost the daemon) waited out its timeout."""
    d = DaemonProcess(tmp_path).start()
    c = d.client(timeout_s=60)
    c.add(zoo_file("tiny-cnn"), "cnn")
    d.kill()
    assert os.path.exists(d.socket[len("ipc://"):])
    with pytest.raises(DaemonUnavailable, match="lost the connection"):
        c.list()
    with pytest.raises(DaemonUnavailable, match="no modelcache daemon is listening"):
        c.list()                                    # the reconnect: refused, not 5 s of hello
    c.close()
    with pytest.raises(DaemonUnavailable, match="no modelcache daemon is listening"):
        modelcache.connect(d.socket, timeout_s=60)   # was: RequestTimeout after 60 s


def test_stale_socket_and_host_tier_are_recovered(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.open("cnn")
    d.proc.kill()  # leaves its socket file and its /dev/shm tier behind
    d.proc.wait()
    stale = d.shm_dir
    assert stale.exists()
    d2 = DaemonProcess(tmp_path).start()
    try:
        assert not stale.exists()  # removed at start: its owner is dead
        with d2.client() as c:
            assert [m["name"] for m in c.list()] == ["cnn"]  # the repository survived
    finally:
        assert d2.stop() == 0
        d2.kill()


def test_second_daemon_on_same_socket_is_refused(daemon):
    other = DaemonProcess(daemon.root)
    with pytest.raises(RuntimeError, match="already serving"):
        other.start(timeout_s=20)


def test_cli_add_without_daemon_then_daemon_finds_it(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path)
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "add", zoo_file("tiny-cnn"), "--name", "offline"],
                       env=d.env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "no daemon running" in r.stdout
    d.start()
    try:
        with d.client() as c:
            assert [m["name"] for m in c.list()] == ["offline"]
    finally:
        assert d.stop() == 0
        d.kill()


def test_cli_errors_and_help(tmp_path):
    env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{tmp_path}/none.sock"}
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "ls"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "no modelcache daemon" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "daemon" in r.stdout and "add" in r.stdout
    for setting, says in (("MODELCACHE_GPUS", "no CUDA device 7"), ("MODELCACHE_WORKERS", "threads per group")):
        bad = {**env, "MODELCACHE_REPOSITORY": str(tmp_path / "repo"), setting: "7" if "GPUS" in setting else "0"}
        r = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon"], env=bad, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "none.sock").exists()


def test_evict_frees_host_memory_and_next_open_is_a_miss(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "cnn")
    s = modelcache.InferenceSession("cnn", client=client)
    with pytest.raises(modelcache.CapacityError, match="in use by 1"):
        client.evict("cnn")
    s.close()
    host_dir = daemon.shm_dir / "cnn@1.onnx"   # the resident skeleton
    assert host_dir.exists() and list(daemon.shm_dir.glob("seg-*.bin"))
    def evict(*args):
        return subprocess.run([sys.executable, "-m", "modelcache.cli", "evict", "cnn", *args], env=daemon.env,
                              capture_output=True, text=True)

    r = evict("--tier", "gpu")                  # this daemon has none: said so, nothing done
    assert r.returncode == 1 and "this daemon has no GPU tier" in r.stderr and r.stdout == "", r
    assert host_dir.exists()
    r = evict()                                 # what was done, to which version, and where it is now
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("evicted cnn@1 from the host tier (") and "it is on disk only now" in r.stdout
    assert not host_dir.exists() and not list(daemon.shm_dir.glob("seg-*.bin"))
    r = evict()                                 # again: it was not in memory, and the line says so
    assert r.returncode == 0 and r.stdout.strip() == "cnn@1 was not in memory (on disk only): nothing to evict"
    st = client.stats()
    assert st.models[0]["tier"] == "disk" and st.tiers[0]["used_bytes"] == 0 and st.counters["evictions"] == 1
    with modelcache.InferenceSession("cnn", client=client) as again:
        assert not again.was_cache_hit


def test_load_and_pin_say_what_they_did_to_which_version(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "cnn")
    client.add(zoo_file("tiny-cnn"), "cnn")

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "modelcache.cli", *args], env=daemon.env, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert cli("load", "cnn").startswith("loaded cnn@2 into the host tier in ")         # the version resolved
    assert cli("load", "cnn", "--version", "2") == "cnn@2 was already in the host tier"
    assert cli("pin", "cnn", "--version", "1").startswith("pinned cnn@1: the eviction policy will not evict it")
    assert cli("pin", "cnn", "--version", "1") == "cnn@1 was already pinned; it is on disk only"
    assert cli("unpin", "cnn") == "cnn@2 was already not pinned; it is in the host tier"
    assert cli("unpin", "cnn", "--version", "1") == \
        "unpinned cnn@1: the eviction policy may evict it again; it is on disk only"


def test_a_model_that_crashes_the_packer_costs_only_the_packer(zoo_file, tmp_path):
    # Stand-in for ORT crashing on a hostile file: a packing process that dies by SIGSEGV. The daemon's packs
    # are forked by its warm packer (`python -m modelcache.store.warm_packer`), or run as `python -m
    # modelcache.store.packing`; sitecustomize makes either crash.
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "if 'modelcache.store.packing' in ' '.join(sys.orig_argv):\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "if 'modelcache.store.warm_packer' in ' '.join(sys.orig_argv):\n"
        "    os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGSEGV))\n")
    d2 = DaemonProcess(tmp_path / "d2", {"PYTHONPATH": f"{crash}:{os.environ.get('PYTHONPATH', '')}"})
    (tmp_path / "d2").mkdir()
    d2.start()
    try:
        with d2.client() as c:
            with pytest.raises(PackError, match="killed by signal 11"):
                c.add(zoo_file("tiny-cnn"), "cnn")
            assert c.list() == [] and c.stats().pid == d2.pid  # same daemon, still answering
    finally:
        assert d2.stop() == 0
        d2.kill()


def test_an_add_to_a_daemon_that_has_gone_says_so_not_that_it_is_tcp(zoo_file, tmp_path):
    d = DaemonProcess(tmp_path)
    d.start()
    c = d.client()
    try:
        stop_cleanly(d)
        with pytest.raises(DaemonUnavailable, match="takes no connection on its lane .* stopping, or it is gone"):
            c.add(zoo_file("tiny-cnn"), "cnn")
    finally:
        c.close()
        d.kill()
