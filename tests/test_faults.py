"""Faults a client can cause: a real daemon subprocess, real clients, hostile or unlucky input.

Each test is a way a client once crashed, hung or tricked the daemon (issue #15); each checks
that the client gets a clear typed error and that the daemon still answers afterwards.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from modelcache.wire import protocol as P
from modelcache.bench.fuzz import peak_rss_bytes, reset_peak_rss, rss_bytes
from modelcache.bench.fuzz_messages import array_of
from modelcache import zoo
from modelcache.store import integrity
from modelcache.wire import tensors
from modelcache.errors import CapacityError, DaemonUnavailable, InputError, PackError
from modelcache.executor.workers import Worker
from modelcache.wire import lane
from modelcache.wire.lane import HEADER, frame
from conftest import HERE, DaemonProcess, wait_until
from test_daemon import raw_socket
from test_lane import raw_lane, read_frame
from test_serve import add_with_references, reference
from test_workers import stage_job

SOAK_S = 10.0


# -- eviction under serve load -------------------------------------------------------------------


def test_a_session_taken_for_an_inline_run_outlives_its_drop(tmp_path, zoo_file):
    """The owner loop decides to run a stage inline (can_run_inline), then the worker's thread drops
    the model's sessions (eviction): the run must use the session it took, over mappings still
    open, and the loop must not build a session itself."""
    src = zoo_file("tiny-cnn")
    job, feeds = stage_job(tmp_path, src)
    done = queue.Queue()
    worker = Worker(0, [0], post=lambda job, error: done.put(error))
    worker.start()
    try:
        worker.queue.put(job)                  # the worker's thread builds the session
        assert done.get(timeout=30) is None
        inline = stage_job(tmp_path / "again", src)[0]
        assert worker.can_run_inline(inline)
        worker.drop_model(job.model_key)       # eviction: the worker's thread forgets the session
        wait_until(lambda: not worker.sessions, timeout_s=10, what="the drop")
        assert worker.run(inline) is None
        assert not worker.sessions, "the owner loop built a session"
        np.testing.assert_allclose(inline.result["outputs"][inline.outputs[0]], reference(src, feeds)[0],
                                   rtol=1e-4, atol=1e-5)
        assert inline.session is None          # let go after the run: the dropped session is freed now
    finally:
        worker.stop()


@pytest.mark.parametrize("workers", ["1", "1,1", "2"])
def test_eviction_under_serve_load_never_crashes_or_serves_wrong_outputs(tmp_path, zoo_file, workers):
    """Serve clients (separate processes) run tiny models while another client evicts and reloads
    those same models.

    Eviction used to drop a worker's stage sessions (and unmap their weights) on the worker's
    thread while the owner loop ran one of them inline: SIGSEGV. "1" runs inline on the group's own session,
    "2" on the stage's single-threaded inline session, "1,1" with two groups, over a partitioned model too."""
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": workers, "MODELCACHE_STATE_DIR": str(tmp_path / "state"),
                                 "MODELCACHE_LOG_LEVEL": "info", "PYTHONFAULTHANDLER": "1"})
    d.start()
    procs = []
    try:
        models = {"cnn": "tiny-cnn", "vit": "tiny-vit", "emb": "tiny-embed", "fp16": "tiny-fp16"}
        with d.client() as admin:
            refs = add_with_references(admin, zoo_file, tmp_path, models)
            admin.partition("vit", stages=2)
        np.savez(tmp_path / "refs.npz", **refs)
        env = {**os.environ, "MODELCACHE_SOCKET": d.socket}
        procs += [subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "soak", str(tmp_path / "refs.npz"),
                                    str(SOAK_S), str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for seed in range(4)]
        churn = {"evictions": 0, "busy": 0, "loads": 0}
        with d.client() as c:
            deadline = time.monotonic() + SOAK_S
            while time.monotonic() < deadline and d.proc.poll() is None:
                for name in models:
                    try:
                        c.evict(name)
                        churn["evictions"] += 1
                        if name == "emb":   # a prefetch too, racing the serve clients' own loads
                            c.load(name)
                            churn["loads"] += 1
                    except CapacityError:   # a request holds it right now
                        churn["busy"] += 1
                    except DaemonUnavailable:
                        break
                time.sleep(0.001)
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
        total = {k: sum(r[k] for r in reports) for k in ("requests", "wrong")}
        errors = [e for r in reports for e in r["errors"]]
        print(f"soak workers={workers}, {SOAK_S:.0f} s: {total}, churn {churn}, errors {len(errors)}")
        assert d.proc.poll() is None, f"daemon died (rc {d.proc.returncode}):\n{d.log_path.read_text()[-3000:]}"
        assert not errors, errors[:5]
        assert total["wrong"] == 0 and total["requests"] > 100 and churn["evictions"] > 20, (total, churn)
        assert "client lost" not in d.log_path.read_text(), "a live client was dropped"
        assert d.stop() == 0, d.log_path.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        d.kill()


# -- hello and the client sweep ------------------------------------------------------------------

def ask(sock, frames: list) -> object:
    """Send raw frames on a raw DEALER and decode the answer."""
    sock.send_multipart(frames)
    return P.decode(sock.recv_multipart())


def answers(d: DaemonProcess) -> bool:
    """The daemon is alive and its owner loop answers a request."""
    with d.client() as c:
        return c.stats().pid == d.pid


@pytest.fixture
def fast_sweep(tmp_path):
    """A daemon whose client sweep runs every 0.2 s, so a test sees several sweeps quickly."""
    d = DaemonProcess(tmp_path, {"MODELCACHE_HEARTBEAT_INTERVAL_S": "0.2", "MODELCACHE_LEASE_TIMEOUT_S": "1.0",
                                 "PYTHONFAULTHANDLER": "1"}).start()
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]
    d.kill()


@pytest.mark.parametrize("pid", [2**31, 2**63 - 1, 2**64 - 1, -1, -(2**63)])
def test_hello_with_an_impossible_pid_is_refused_and_the_sweep_survives(fast_sweep, pid):
    sock = raw_socket(fast_sweep)
    reply = ask(sock, P.encode(P.Hello(req_id=7, protocol_version=P.PROTOCOL_VERSION, pid=pid)))
    assert isinstance(reply, P.ErrorReply) and reply.code == "protocol" and "not a process id" in reply.message
    assert reply.req_id == 7
    # A client that falls silent (the daemon takes the pid from the kernel, not the hello, so the exited
    # process below no longer decides): the next sweeps drop it, so a sweep ran after the bad hello.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reply = ask(sock, P.encode(P.Hello(req_id=8, protocol_version=P.PROTOCOL_VERSION, pid=gone.pid)))
    assert isinstance(reply, P.HelloReply)
    with fast_sweep.client() as c:
        wait_until(lambda: c.stats().counters["clients_lost"] >= 1, timeout_s=10, what="a sweep")
    assert answers(fast_sweep)
    sock.close()


def test_the_sweep_never_dies_on_one_client(tmp_path):
    """Whatever a client record holds, the sweep goes on to the next client (and the loop lives)."""
    from modelcache.config import Settings
    from modelcache.daemon.server import Daemon
    daemon = Daemon(Settings(socket=f"ipc://{tmp_path}/s.sock", repository=str(tmp_path / "repo"), workers="1"))
    now = daemon.clock()
    odd = daemon.registry.new_client(2**40, "odd", now)        # a pid os.kill cannot take
    broken = daemon.registry.new_client(os.getpid(), "broken", now)
    broken.last_seen = "yesterday"                              # a bug's worth of bad state
    daemon.registry.new_client(0, "silent", now - 3600)          # silent for an hour
    daemon.sweep_clients()
    assert set(daemon.registry.clients) == {odd.client_id, broken.client_id}   # the silent one went


def test_the_sweep_counts_no_silence_while_the_loop_was_stopped_before_it(tmp_path):
    """The pause between a turn's poll and the sweep is judged on the sweep's own clock reading: a check a
    few calls earlier left a window, and a SIGSTOP landing in it dropped every live client (CI, once)."""
    from modelcache.config import Settings
    from modelcache.daemon.server import Daemon
    now = [100.0]
    daemon = Daemon(Settings(socket=f"ipc://{tmp_path}/s.sock", repository=str(tmp_path / "repo"), workers="1",
                             lease_timeout_s=1.0), clock=lambda: now[0])
    live = daemon.registry.new_client(os.getpid(), "live", 100.0)
    daemon.turn_at = 100.0                 # the poll returned, then the process stopped for 1.5 s
    now[0] = 101.5
    daemon.sweep_clients()
    assert live.client_id in daemon.registry.clients
    daemon.turn_at = now[0] = 102.0        # listening again; its beats are a moment away
    daemon.sweep_clients()
    assert live.client_id in daemon.registry.clients
    daemon.turn_at = now[0] = 102.6        # a whole lease timeout after listening again, and still silent
    daemon.sweep_clients()
    assert live.client_id not in daemon.registry.clients


# -- bounded input -------------------------------------------------------------------------------

MiB = 1 << 20


def map_with(req_id: int, key: str, packed_value: bytes) -> bytes:
    return b"\x82" + msgpack.packb("req_id") + msgpack.packb(req_id) + msgpack.packb(key) + packed_value


INFLATING = {
    # 50 MB that msgpack would make into 50 million list slots, or empty lists (64 B each)
    "array of zeros": array_of(50_000_000),
    "inputs: array of zeros": map_with(3, "inputs", array_of(50_000_000)),
    "inputs: array of empty arrays": map_with(3, "inputs", array_of(50_000_000, b"\x90")),
    # every container under the limit, all of them together far over it
    "inputs: nested arrays": map_with(3, "inputs", b"\xdc" + (800).to_bytes(2, "big")
                                      + (b"\xdc" + (60000).to_bytes(2, "big") + b"\x00" * 60000) * 800),
}


@pytest.mark.parametrize("what", list(INFLATING))
def test_an_inflating_body_costs_the_daemon_no_more_than_its_size(daemon, what):
    body = INFLATING[what]
    sock = raw_socket(daemon)
    assert answers(daemon)
    baseline = rss_bytes(daemon.pid)
    reset_peak_rss(daemon.pid)
    reply = ask(sock, [b"infer", body])
    peak = peak_rss_bytes(daemon.pid) - baseline
    assert isinstance(reply, P.ErrorReply) and reply.code == "protocol", reply
    assert "max_array_len" in reply.message or "more than 65536 items" in reply.message, reply.message
    assert reply.req_id == (0 if what == "array of zeros" else 3)
    print(f"{what}: {len(body) / MiB:.0f} MiB body, daemon peak RSS +{peak / MiB:.0f} MiB")
    assert peak <= 2 * len(body) + 16 * MiB      # the frame in libzmq and its copy in Python, at most
    assert answers(daemon)
    wait_until(lambda: rss_bytes(daemon.pid) <= baseline + 10 * MiB, timeout_s=5, what="RSS back to baseline")
    sock.close()


@pytest.fixture
def small_messages(tmp_path):
    d = DaemonProcess(tmp_path, {"MODELCACHE_MAX_MESSAGE_SIZE": "1M"}).start()
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]
    d.kill()


def test_a_message_over_max_message_size_costs_its_sender_the_connection(small_messages):
    d = small_messages
    sock = raw_socket(d)
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    baseline = rss_bytes(d.pid)
    reset_peak_rss(d.pid)
    sock.send_multipart([b"infer", msgpack.packb({"req_id": 1, "inputs": [{"data": b"x" * (2 * MiB)}]})])
    with pytest.raises(zmq.Again):              # libzmq dropped the connection: no answer ever comes
        sock.recv_multipart()
    assert peak_rss_bytes(d.pid) - baseline < 2 * MiB
    assert answers(d)
    # Just under the limit is a message like any other.
    reply = ask(sock, [b"infer", msgpack.packb({"req_id": 2, "inputs": [{"data": b"x" * (MiB // 2)}]})])
    assert isinstance(reply, P.ErrorReply) and reply.req_id == 2 and "missing field" in reply.message
    sock.close()


def test_a_lane_frame_over_max_message_size_ends_the_connection(small_messages):
    d = small_messages
    s = raw_lane(d)
    s.sendall(HEADER.pack(5, 2 * MiB) + b"infer" + b"\x00" * 1024)   # refused from its header
    assert s.recv(100) == b""
    s.close()
    s = raw_lane(d)                         # the same 50 MB inflating array, under the limit here
    s.sendall(frame(b"infer", map_with(4, "inputs", array_of(MiB // 2))))
    kind, body = read_frame(s)
    reply = P.decode([kind, body])
    assert isinstance(reply, P.ErrorReply) and reply.req_id == 4 and "max_array_len" in reply.message
    s.close()
    assert answers(d)


def test_a_message_of_a_million_frames_is_refused(daemon):
    sock = raw_socket(daemon)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)    # reading a million frames took over 5 s on a loaded 2-core machine
    sock.send_multipart([b"open"] + [b""] * 1_000_000)
    reply = P.decode(sock.recv_multipart())
    assert isinstance(reply, P.ErrorReply) and "2 frames" in reply.message
    assert answers(daemon)
    sock.close()


@pytest.mark.parametrize("stages, tail, says", [
    (10**7, None, "2 <= K <= 64"), (0, None, "2 <= K <= 64"), (-3, None, "2 <= K <= 64"), (None, None, "give --stages"),
    (None, float("nan"), "between 0 and 1"), (None, 1.5, "between 0 and 1"), (60, None, "cut points"),
])
def test_a_partition_that_cannot_be_met_is_refused_before_anything_is_built(daemon, zoo_file, stages, tail, says):
    src = zoo_file("tiny-vit")
    feeds = zoo.sample_inputs(src)
    with daemon.client() as c:
        c.add(src, "vit")
        kept = [{k: e[k] for k in ("file", "inputs", "outputs")} for e in c.partition("vit", stages=2)]
        baseline = rss_bytes(daemon.pid)
        reset_peak_rss(daemon.pid)
        t0 = time.monotonic()
        with pytest.raises(PackError, match=says):
            c.partition("vit", stages=stages, tail_fraction=tail)
        assert time.monotonic() - t0 < 10
        assert peak_rss_bytes(daemon.pid) - baseline < 64 * MiB     # 10**7 stages: +434 MiB before
        if says != "cut points":    # (that one is refused by the loader, after the profile: it had to look)
            assert [{k: e[k] for k in ("file", "inputs", "outputs")} for e in c.describe("vit").stages] == kept
        np.testing.assert_allclose(c.infer("vit", feeds)[0]["logits"], reference(src, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("deadline_ms", [float("nan"), float("inf"), -5.0])
def test_an_impossible_deadline_is_an_input_error(daemon, zoo_file, deadline_ms):
    src = zoo_file("tiny-cnn")
    with daemon.client() as c:
        c.add(src, "cnn")
        with pytest.raises(InputError, match="deadline_ms"):
            c.infer("cnn", zoo.sample_inputs(src), deadline_ms=deadline_ms)
        assert c.infer("cnn", zoo.sample_inputs(src))[0]["logits"].shape == (1, 10)


# -- configuration a client stores ---------------------------------------------------------------

MISSING = object()
GOOD_PROFILE = {"kind": "cpu2", "batches": [1, 4], "stage_s": [[0.001], [0.003]], "ratios": [[1.0], [1.0]],
                "g": [0.001, 0.0007, 2.0, 2.0], "t_opt_ms": 50.0, "n_opt": 4, "request_s": [0.0015, 0.004]}
BAD_PROFILES = {
    "request_s a number": ({"request_s": 0.002}, "request_s"),
    "request_s too short": ({"request_s": [0.002]}, "request_s"),
    "g of 3": ({"g": [0.001, 0.0007, 2.0]}, "g must be 4 numbers"),
    "g of strings": ({"g": ["a", "b", "c", "d"]}, "g must be 4 numbers"),
    "z3 zero": ({"g": [0.001, 0.0007, 0.0, 2.0]}, "z3 > 0"),
    "n_opt zero": ({"n_opt": 0}, "n_opt"),
    "n_opt huge": ({"n_opt": 10**9}, "n_opt"),
    "n_opt a bool": ({"n_opt": True}, "n_opt"),
    "n_opt a float": ({"n_opt": 4.5}, "n_opt"),
    "t_opt_ms NaN": ({"t_opt_ms": float("nan")}, "t_opt_ms"),
    "batches unsorted": ({"batches": [4, 1]}, "ascending"),
    "batch zero": ({"batches": [0, 4]}, "batch sizes >= 1"),
    "stage time a string": ({"stage_s": [["x"], [0.003]]}, "stage_s must be"),
    "negative stage time": ({"stage_s": [[-1.0], [0.003]]}, "stage_s must be"),
    "ratios missing": ({"ratios": MISSING}, "no 'ratios'"),
    "an unknown field": ({"extra": [0] * 1000}, "unknown field 'extra'"),
    "kind a number": ({"kind": 2}, "kind"),
}


def test_a_malformed_plan_is_an_input_error_and_the_daemon_goes_on(daemon, zoo_file):
    """A plan whose stages are not node ranges used to reach the engine as a free dict (an internal error)."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    with daemon.client() as c:
        c.add(src, "cnn")
        for plan in ({"nodes": 3, "stages": "x"}, {"nodes": 3, "stages": [{"start": 0, "end": 3, "worker_names": 7}]}):
            with pytest.raises(InputError, match="the plan's"):
                c.partition("cnn", plan=plan)
        assert c.describe("cnn").stages == []
        np.testing.assert_allclose(c.infer("cnn", feeds)[0]["logits"], reference(src, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("what", list(BAD_PROFILES))
def test_a_profile_is_validated_in_full_before_it_is_stored(daemon, zoo_file, what):
    change, says = BAD_PROFILES[what]
    profile = {k: v for k, v in {**GOOD_PROFILE, **change}.items() if v is not MISSING}
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    manifest = daemon.repository / "cnn" / "1" / "manifest.json"
    with daemon.client() as c:
        c.add(src, "cnn")
        before = manifest.read_text()
        with pytest.raises(InputError, match=says):
            c.set_batching("cnn", profile)
        assert manifest.read_text() == before                   # nothing was stored
        for _ in range(3):                                      # and serving goes on
            np.testing.assert_allclose(c.infer("cnn", feeds)[0]["logits"], reference(src, feeds)[0],
                                       rtol=1e-4, atol=1e-5)
        c.set_batching("cnn", GOOD_PROFILE)                     # a good one is still taken
        assert json.loads(manifest.read_text())["batching"] == GOOD_PROFILE
        assert c.infer("cnn", feeds)[0]["logits"].shape == (1, 10)


def test_a_bad_profile_already_stored_is_ignored_not_fatal(tmp_path, zoo_file):
    """A manifest written before profiles were checked: every serve request failed (then hung after a restart)."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    d = DaemonProcess(tmp_path, {"MODELCACHE_BATCHING": "layer"}).start()
    try:
        with d.client() as c:
            c.add(src, "cnn")
        assert d.stop() == 0
        path = d.repository / "cnn" / "1" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["batching"] = {**GOOD_PROFILE, "request_s": 0.002}
        manifest["checksum"] = integrity.manifest_checksum(manifest)   # as the daemon itself stored it then
        path.write_text(json.dumps(manifest))
        d.start()
        with d.client(timeout_s=10) as c:
            for _ in range(3):
                np.testing.assert_allclose(c.infer("cnn", feeds)[0]["logits"], reference(src, feeds)[0],
                                           rtol=1e-4, atol=1e-5)
            assert c.stats().executor["in_flight"] == 0
        assert "ignoring its stored batching profile" in d.log_path.read_text()
        assert d.stop() == 0
    finally:
        d.kill()


# -- I/O files of large inputs -------------------------------------------------------------------

def infer_wire(c, wire: list):
    """An infer request with hand-made tensors, through the client's own transport."""
    return c._call(P.Infer(req_id=0, client_id=c.client_id, name="cnn", inputs=wire), expect=(P.InferReply,),
                   use_lane=True)


def io_entry(path: str, nbytes: int = 1 * 3 * 32 * 32 * 4) -> dict:
    return {"name": "input", "dtype": "float32", "shape": [1, 3, 32, 32], "shm": path, "nbytes": nbytes}


@pytest.fixture
def io_paths(tmp_path):
    """Names in /dev/shm for a test's I/O files, removed after it (and a stuck FIFO reader released)."""
    made = []

    def make(tag: str) -> str:
        made.append(f"/dev/shm/modelcache-io.test-{os.getpid()}-{tag}")
        return made[-1]
    yield make
    for path in made:
        if os.path.exists(path) and not os.path.islink(path) and stat.S_ISFIFO(os.stat(path).st_mode):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))   # a reader blocked on it gets EOF
            except OSError:
                pass
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_io_files_that_are_not_plain_files_of_the_client_are_refused_at_once(daemon, zoo_file, tmp_path, io_paths):
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    secret = tmp_path / "secret"             # stands for a file only the daemon's user may read
    secret.write_bytes(b"s3cret!!" * 2048)
    fifo = io_paths("fifo")
    os.mkfifo(fifo)
    link = io_paths("link")
    os.symlink(secret, link)
    directory = io_paths("dir")
    os.mkdir(directory)
    twice = io_paths("twice")
    with open(twice, "wb") as f:
        f.write(feeds["input"].tobytes())
    other_name = io_paths("other-name")
    os.link(twice, other_name)
    elsewhere = tmp_path / "modelcache-io.elsewhere"
    elsewhere.write_bytes(feeds["input"].tobytes())
    cases = {fifo: "not a regular file", link: "is a symbolic link", directory: "not a regular file",
             twice: "has 2 names", str(elsewhere): "not a modelcache I/O file",
             "/dev/shm/../shm/modelcache-io.x": "not a modelcache I/O file",
             io_paths("missing"): "cannot be opened"}
    with daemon.client(timeout_s=5) as c:
        c.add(src, "cnn")
        for path, says in cases.items():
            t0 = time.monotonic()
            with pytest.raises(InputError, match=says):
                infer_wire(c, [io_entry(path)])
            assert time.monotonic() - t0 < 2, path
        # A plain I/O file of the client's still works, the large-input path included.
        big = {"input": np.random.default_rng(0).standard_normal((64, 3, 32, 32)).astype(np.float32)}
        np.testing.assert_allclose(c.infer("cnn", big)[0]["logits"], reference(src, big)[0], rtol=1e-4, atol=1e-5)
    assert answers(daemon)


def test_a_client_that_truncates_its_io_file_after_sending_it_costs_only_its_request(daemon, zoo_file):
    """The daemon mapped I/O files: one truncated under a request was a SIGBUS in the daemon (rc -7)."""
    src = zoo_file("tiny-cnn")
    big = {"input": np.random.default_rng(0).standard_normal((256, 3, 32, 32)).astype(np.float32)}
    want = reference(src, big)[0]
    outcomes: list[str] = []
    with daemon.client() as admin:
        admin.add(src, "cnn")

    def attack(k: int):
        with daemon.client(timeout_s=10) as c:
            raw = lane.connect(c.address)
            for i in range(25):
                wire, files = tensors.encode(big)
                msg = P.Infer(req_id=i + 1, client_id=c.client_id, name="cnn", inputs=wire)
                raw.send(*P.encode(msg), time.monotonic() + 10)   # a lane of its own, one request at a time
                time.sleep(0.0005 * (i % 4))
                os.truncate(files[0], 0)        # while the request waits for the worker, or runs
                reply = P.decode(raw.receive(time.monotonic() + 10))
                os.unlink(files[0])
                if isinstance(reply, P.InferReply):
                    out = tensors.decode(reply.outputs)[0]["logits"]
                    outcomes.append("right" if np.allclose(out, want, rtol=1e-4, atol=1e-5) else "wrong")
                else:
                    outcomes.append(reply.code + ("" if "bytes; the tensor needs" in reply.message
                                                  or "truncated" in reply.message else ": " + reply.message))
            raw.close()

    threads = [threading.Thread(target=attack, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert daemon.proc.poll() is None, daemon.log_path.read_text()[-2000:]
    assert len(outcomes) == 100 and set(outcomes) <= {"right", "input"}, sorted(set(outcomes))
    assert answers(daemon)


# -- files that are not ours ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["socket", "lane"])
def test_a_file_at_the_socket_path_is_left_alone_and_the_daemon_refuses_to_start(tmp_path, where):
    d = DaemonProcess(tmp_path)
    path = Path(d.socket[len("ipc://"):] + (".lane" if where == "lane" else ""))
    path.parent.mkdir(parents=True)
    path.write_text("someone's notes\n")
    with pytest.raises(RuntimeError, match="did not get ready"):
        d.start(timeout_s=20)
    assert d.proc.returncode == 1
    assert path.read_text() == "someone's notes\n"
    assert f"{path} exists and is not a socket" in d.log_path.read_text()
    assert not d.shm_dir.exists()                 # refused before it made anything
    if where == "lane":
        assert not Path(d.socket[len("ipc://"):]).exists()


def test_live_clients_survive_a_daemon_that_was_not_listening(fast_sweep):
    """A daemon stopped for longer than the lease timeout (SIGSTOP here; a VM pause, swapping or a
    starved process alike) swept its clients as silent before reading the heartbeats they had sent
    meanwhile: every live client was dropped, and got "unknown client" for the rest of its life."""
    d = fast_sweep                       # lease timeout 1 s, heartbeats every 0.2 s
    clients = [d.client() for _ in range(4)]
    sock = raw_socket(d)                 # a client that says hello and then never beats
    try:
        for _ in range(3):
            os.kill(d.pid, signal.SIGSTOP)
            time.sleep(2.5)
            os.kill(d.pid, signal.SIGCONT)
            time.sleep(0.6)              # several sweeps, and time for the heartbeats to come in
            stats = clients[0].stats()
            assert stats.counters["clients_lost"] == 0
            assert {c.client_id for c in clients} <= {e["client_id"] for e in stats.clients}
        # Silence still costs a client its place, counted from when the daemon listens again.
        silent = ask(sock, P.encode(P.Hello(req_id=1, protocol_version=P.PROTOCOL_VERSION, pid=0))).client_id
        os.kill(d.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(d.pid, signal.SIGCONT)
        wait_until(lambda: silent not in {e["client_id"] for e in clients[0].stats().clients}, timeout_s=10,
                   what="the silent client to be dropped")
        assert clients[0].stats().counters["clients_lost"] == 1
    finally:
        sock.close()
        for c in clients:
            c.close()
