"""Serve mode against a real daemon: partitioned models, concurrent clients, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import numpy as np
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.errors import InputError, ModelNotFound, PackError, RequestTimeout
from modelcache.wire import protocol as P
from conftest import HERE, DaemonProcess
from test_daemon import raw_socket


@pytest.fixture
def serving(tmp_path):
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1,1", "MODELCACHE_STATE_DIR": str(tmp_path / "state")}).start()
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]
    d.kill()


def reference(src, feeds):
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def add_with_references(client, zoo_file, tmp_path, models: dict) -> dict:
    """Add each zoo model (name -> zoo name), save its batch-2 feeds as refs-NAME-feeds.npz for the client
    workers, and return plain ORT's first output per model."""
    refs = {}
    for name, zname in models.items():
        client.add(zoo_file(zname), name)
        feeds = zoo.sample_inputs(zoo_file(zname), batch=2)
        np.savez(tmp_path / f"refs-{name}-feeds.npz", **feeds)
        refs[name] = reference(zoo_file(zname), feeds)[0]
    return refs


def test_partitioned_models_from_many_processes_match_plain_ort(serving, zoo_file, tmp_path):
    models = {"cnn": "tiny-cnn", "vit": "tiny-vit", "emb": "tiny-embed"}
    with serving.client() as c:
        refs = add_with_references(c, zoo_file, tmp_path, models)
        stages = c.partition("vit", stages=2)
        assert len(stages) == 2 and stages[0]["outputs"] == stages[1]["inputs"]
        assert len(c.partition("cnn", tail_fraction=0.3)) == 2
        np.savez(tmp_path / "refs.npz", **refs)
        env = {**os.environ, "MODELCACHE_SOCKET": serving.socket}
        procs = [subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "serve",
                                   str(tmp_path / "refs.npz"), "5"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            report = json.loads(out.strip().splitlines()[-1])
            assert report == {"wrong": 0, "onnxruntime_imported": False}
        ex = c.stats().executor
        assert ex["served"] == 4 * 5 * 3 and ex["failed"] == 0
        assert {w["id"] for w in ex["workers"]} == {0, 1}
        assert ex["perf_models"]["predictions_checked"] > 0


def test_serve_session_surface_and_timings(serving, zoo_file):
    src = zoo_file("tiny-cnn")
    with serving.client() as c:
        c.add(src, "cnn")
        c.partition("cnn", stages=2)
        with modelcache.InferenceSession("cnn", mode="serve", client=c) as s:
            assert [(i.name, i.type) for i in s.get_inputs()] == [("input", "tensor(float)")]
            assert [o.name for o in s.get_outputs()] == ["logits"]
            feeds = zoo.sample_inputs(src, batch=3)
            np.testing.assert_allclose(s.run(["logits"], feeds)[0], reference(src, feeds)[0], rtol=1e-4, atol=1e-5)
            t = s.last_timings
            assert [st["stage"] for st in t["stages"]] == [0, 1]
            assert all(st["run_ms"] > 0 and st["worker"] in (0, 1) for st in t["stages"])
            assert t["total_ms"] >= sum(st["run_ms"] for st in t["stages"])
            assert not any(st["inline"] for st in t["stages"])  # never timed: a worker thread runs it
            # Once calibrated (well under inline_run_ms) the loop runs the stages itself. How many runs that takes
            # depends on the machine: the prediction is a median of measured runs, which a loaded CI machine
            # (the suite runs 4 workers on 2 cores) can push past 1 ms for a few runs (a CI run saw stage 1 still
            # on its worker after 4). So: within 40 runs, every one checked.
            for _ in range(40):
                np.testing.assert_allclose(s.run(["logits"], feeds)[0], reference(src, feeds)[0],
                                           rtol=1e-4, atol=1e-5)
                if all(st["inline"] for st in s.last_timings["stages"]):
                    break
            assert [st["inline"] for st in s.last_timings["stages"]] == [True, True]


def test_a_serve_session_in_a_fresh_process_goes_over_the_lane_without_zeromq(serving, zoo_file):
    """A FaaS function in serve mode imports neither onnxruntime nor pyzmq (15-30 ms of its start here): its
    describe and infers go over the lane alone (client/leases.py), and its answers are plain ORT's."""
    src = zoo_file("tiny-cnn")
    script = ("import json, sys\nimport numpy as np\nimport modelcache\nfrom modelcache import zoo\n"
              "s = modelcache.InferenceSession('cnn', mode='serve')\n"
              f"out = s.run(None, zoo.sample_inputs({src!r}, batch=2))[0]\n"
              "np.save(sys.argv[1], out)\n"
              "print(json.dumps({m: m in sys.modules for m in ('zmq', 'onnxruntime')} |"
              " {'client': type(s._client).__name__}))\n")
    with serving.client() as c:
        c.add(src, "cnn")
        out = serving.root / "out.npy"
        r = subprocess.run([sys.executable, "-c", script, str(out)],
                           env={**os.environ, "MODELCACHE_SOCKET": serving.socket}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1]) == {"zmq": False, "onnxruntime": False, "client": "LeaseClient"}
        feeds = zoo.sample_inputs(src, batch=2)
        want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(np.load(out), want, rtol=1e-4, atol=1e-5)


def test_a_forked_child_gets_a_connection_of_its_own_and_the_parent_its_own_answers(serving, zoo_file):
    """A session made before a fork (gunicorn's preload, multiprocessing): the child's calls, on the session it
    inherited or on a new one, must not read the parent's replies off their shared lane connection, nor write its
    inputs into the memory files the parent reuses for its own (each input here is 295 KB: passed as one)."""
    src = zoo_file("tiny-cnn")
    script = f"""
import os, sys, numpy as np, onnxruntime as ort, modelcache
from modelcache import zoo
ref = ort.InferenceSession({src!r}, providers=["CPUExecutionProvider"])
s = modelcache.InferenceSession("cnn", mode="serve")
def loop(sess, seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        x = {{"input": rng.standard_normal((24, 3, 32, 32)).astype(np.float32)}}
        assert np.allclose(sess.run(None, x)[0], ref.run(None, x)[0], rtol=1e-4, atol=1e-5)
loop(s, 0)
pid = os.fork()
if pid == 0:
    try:
        loop(s, 1)
        loop(modelcache.InferenceSession("cnn", mode="serve"), 2)
        os._exit(0)
    except BaseException:
        os._exit(1)
loop(s, 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    with serving.client() as c:
        c.add(src, "cnn")
        r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MODELCACHE_SOCKET": serving.socket},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "child 0", r.stdout + r.stderr


def test_a_full_client_made_before_a_fork_works_in_the_child_as_a_client_of_its_own(serving, zoo_file):
    """connect() before a fork: a call in the child on the parent's ZeroMQ socket hung both processes. The child's
    client now connects afresh at its first call (its own context, hello, client id, heartbeat); both processes'
    answers are their own, large inputs (memory files) included."""
    src = zoo_file("tiny-cnn")
    script = f"""
import os, sys, numpy as np, onnxruntime as ort, modelcache
ref = ort.InferenceSession({src!r}, providers=["CPUExecutionProvider"])
c = modelcache.connect()
parent_id = c.client_id
def loop(seed):
    rng = np.random.default_rng(seed)
    for i in range(60):
        x = {{"input": rng.standard_normal((24 if i % 2 else 1, 3, 32, 32)).astype(np.float32)}}
        assert np.allclose(c.infer("cnn", x)[0]["logits"], ref.run(None, x)[0], rtol=1e-4, atol=1e-5)
loop(0)
pid = os.fork()
if pid == 0:
    try:
        loop(1)
        ok = c.client_id not in ("", parent_id) and c.stats().pid > 0
        c.close()
        os._exit(0 if ok else 3)
    except BaseException as e:
        print("child:", type(e).__name__, e, file=sys.stderr, flush=True)
        os._exit(1)
loop(2)
_, status = os.waitpid(pid, 0)
loop(3)
print("child", os.waitstatus_to_exitcode(status), c.client_id == parent_id)
"""
    with serving.client() as c:
        c.add(src, "cnn")
        r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MODELCACHE_SOCKET": serving.socket},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == ["child", "0", "True"], r.stdout + r.stderr


def test_a_process_that_closed_its_serve_session_is_gone_not_lost(serving, zoo_file):
    """`clients_lost` is an alert: a process that closed its session and exited said goodbye, so only a
    client that died (or fell silent) counts."""
    from conftest import wait_until
    src = zoo_file("tiny-cnn")
    script = ("import modelcache\nfrom modelcache import zoo\n"
              "with modelcache.InferenceSession('cnn', mode='serve') as s:\n"
              f"    s.run(None, zoo.sample_inputs({src!r}, batch=1))\n")
    with serving.client() as c:
        c.add(src, "cnn")
        r = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MODELCACHE_SOCKET": serving.socket},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert [cl["client_id"] for cl in c.stats().clients] == [c.client_id]   # gone at once: said goodbye
        killed = subprocess.Popen([sys.executable, "-c", script + "import os, signal\n"
                                   "os.kill(os.getpid(), signal.SIGKILL)\n"],
                                  env={**os.environ, "MODELCACHE_SOCKET": serving.socket})
        assert killed.wait(120) == -9
        wait_until(lambda: len(c.stats().clients) == 1, timeout_s=15, what="the sweep to drop the killed client")
        assert c.stats().counters["clients_lost"] == 1                 # the killed one alone
    assert serving.log_path.read_text().count("client lost") == 1


def test_large_inputs_travel_through_shared_memory(serving, zoo_file):
    src = zoo_file("tiny-cnn")
    with serving.client() as c:
        c.add(src, "cnn")
        feeds = zoo.sample_inputs(src, batch=128)       # 1.5 MB: over the inline limit
        before = set(os.listdir("/dev/shm"))
        out, _ = c.infer("cnn", feeds)
        np.testing.assert_allclose(out["logits"], reference(src, feeds)[0], rtol=1e-4, atol=1e-5)
        assert {f for f in os.listdir("/dev/shm") if f.startswith("modelcache-io.")} - before == set()


def test_serve_errors_are_clear_and_the_daemon_stays_up(serving, zoo_file):
    src = zoo_file("tiny-cnn")
    with serving.client() as c:
        c.add(src, "cnn")
        good = zoo.sample_inputs(src)
        with pytest.raises(ModelNotFound):
            c.infer("ghost", good)
        with pytest.raises(InputError, match="unknown input 'img'"):
            c.infer("cnn", {"img": good["input"]})
        with pytest.raises(InputError, match="must have shape"):
            c.infer("cnn", {"input": good["input"][:, :1]})
        with pytest.raises(InputError, match="unknown output 'nope'"):
            c.infer("cnn", good, output_names=["nope"])
        c.add(zoo_file("resnet50"), "r50")
        c.partition("r50", stages=2)
        with pytest.raises(RequestTimeout, match="deadline"):
            c.infer("r50", zoo.sample_inputs(zoo_file("resnet50")), deadline_ms=1)
        with pytest.raises(PackError, match="cut points"):
            c.add(zoo_file("tiny-if"), "iff")
            c.partition("iff", stages=2)
        sock = raw_socket(serving)
        bad = {"req_id": 5, "client_id": c.client_id, "name": "cnn",
               "inputs": [{"name": "input", "dtype": "float32", "shape": [1, 3, 32, 32], "data": b"short"}]}
        sock.send_multipart([b"infer", msgpack.packb(bad)])
        reply = P.decode(sock.recv_multipart())
        assert reply.code == "protocol" and "malformed tensor" in reply.message
        bad["inputs"] = [{"name": "input", "dtype": "float32", "shape": [1], "shm": "/etc/passwd", "nbytes": 4}]
        sock.send_multipart([b"infer", msgpack.packb(bad)])
        assert "not a modelcache I/O file" in P.decode(sock.recv_multipart()).message
        sock.close()
        out, _ = c.infer("cnn", good)   # still serving, model intact
        np.testing.assert_allclose(out["logits"], reference(src, good)[0], rtol=1e-4, atol=1e-5)
        assert {m["name"]: m["refcount"] for m in c.list()}["r50"] == 0   # failed requests released it


def test_idle_serve_sessions_are_dropped(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path, {"MODELCACHE_SERVE_IDLE_S": "0.5", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.2"}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
            c.infer("cnn", zoo.sample_inputs(zoo_file("tiny-cnn")))
            from conftest import wait_until
            wait_until(lambda: "serve sessions of cnn@1 dropped" in d.log_path.read_text(), what="idle drop")
            out, _ = c.infer("cnn", zoo.sample_inputs(zoo_file("tiny-cnn")))   # rebuilt on demand
            assert out["logits"].shape == (1, 10)
    finally:
        assert d.stop() == 0
        d.kill()
