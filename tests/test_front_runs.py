"""Short models run by the fronts themselves, over the daemon's shared weights (modelcache/oip/front_runs.py).

A real daemon and real `modelcache http` / `modelcache grpc` subprocesses, Triton's own clients; that a request
ran at the front is read from the daemon: the model leased by the front's client, and the statistics counting
requests the engine never ran. Engine.front_may_run, the decision, is pure: tested on the engine's harness.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import onnxruntime as ort
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")   # in the [test] extra
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import DaemonProcess, stop_cleanly, wait_until  # noqa: E402
from test_engine import Harness  # noqa: E402
from test_http import HttpFront  # noqa: E402


class Served:
    """A daemon with tiny-cnn added as "cnn" and a `modelcache http` front for it; `d` may be replaced by a test
    (a restart): the one there at the end is stopped."""

    def __init__(self, tmp_path, zoo_file, env: dict):
        self.env = env
        self.d = DaemonProcess(tmp_path, extra_env=env).start()
        self.f = None
        self.path = zoo_file("tiny-cnn")
        with self.d.client() as c:
            c.add(self.path, "cnn")
        self.f = HttpFront(self.d)

    def stop(self) -> None:
        if self.f is not None:
            assert self.f.stop() == 0
        stop_cleanly(self.d)


@contextlib.contextmanager
def served(tmp_path, zoo_file, **env):
    s = None
    try:
        s = Served(tmp_path, zoo_file, env)
        yield s
    finally:
        if s is not None:
            s.stop()


@pytest.fixture
def front(tmp_path, zoo_file):
    """(daemon, HTTP front, tiny-cnn's path) with the defaults a user has: serial batching, front_runs short; a
    front lets go 0.5 s after a model's last request."""
    with served(tmp_path, zoo_file, MODELCACHE_FRONT_HOLD_S="0.5") as s:
        yield s.d, s.f, s.path


def _infer(c, x, outputs=None):
    inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer("cnn", [inp], outputs=outputs)


def _cnn(d) -> dict:
    with d.client() as c:
        return next(m for m in c.list() if m["name"] == "cnn")


def _front_holds(d) -> bool:
    """The front's lease on cnn: the only thing that holds it between requests."""
    return _cnn(d)["refcount"] > 0


def _run_at_front(d, c, x) -> None:
    """Requests until the daemon has timed the model and the front has it open (Describe's answer lives 2 s)."""
    def held():
        _infer(c, x)
        return _front_holds(d)
    wait_until(held, timeout_s=20, what="the front running cnn itself")


def test_a_short_model_runs_at_the_front_and_the_daemon_counts_every_request(front):
    d, f, path = front
    c = tritonhttp.InferenceServerClient(f.hostport)
    rng = np.random.default_rng(0)
    _run_at_front(d, c, rng.standard_normal((1, 3, 32, 32)).astype(np.float32))
    plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    # Both counts read before the two requests: the front's report may count them before the test looks.
    served_before = d.client().stats().executor["served"]
    [stats] = c.get_inference_statistics("cnn")["model_stats"]
    sent = stats["inference_stats"]["success"]["count"]
    for rows in (1, 3):   # a free batch dimension: any rows
        x = rng.standard_normal((rows, 3, 32, 32)).astype(np.float32)
        got = _infer(c, x).as_numpy("logits")
        np.testing.assert_allclose(got, plain.run(["logits"], {"input": x})[0], rtol=1e-5, atol=1e-6)
    assert _front_holds(d)
    # The engine ran none of the two above; the front's report (once a second) counts them as the engine's.
    wait_until(lambda: d.client().stats().executor["served"] >= served_before + 2, timeout_s=10,
               what="the front's report")
    def counted():
        [s] = c.get_inference_statistics("cnn")["model_stats"]
        return s if s["inference_stats"]["success"]["count"] >= sent + 2 else None
    s = wait_until(counted, timeout_s=10, what="statistics counting the front's requests")
    assert s["inference_count"] >= 4 and s["inference_stats"]["compute_infer"]["ns"] > 0
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]}   # the front's runs by their rows
    assert sizes.get(3) == 1 and sizes.get(1, 0) >= 1, s["batch_stats"]
    assert abs(s["last_inference"] - time.time() * 1e3) < 10_000
    # Idle past front_hold_s, the front lets go: the daemon may evict it again.
    wait_until(lambda: not _front_holds(d), timeout_s=10, what="the front letting go of cnn")
    with d.client() as mc:
        mc.evict("cnn")
    assert _cnn(d)["tier"] == "disk"
    # ... and the next requests bring it back, through the daemon first.
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(_infer(c, x).as_numpy("logits"), plain.run(["logits"], {"input": x})[0],
                               rtol=1e-5, atol=1e-6)


def test_a_bad_request_at_the_front_gets_the_daemons_answer(front):
    d, f, _ = front
    c = tritonhttp.InferenceServerClient(f.hostport)
    _run_at_front(d, c, np.zeros((1, 3, 32, 32), np.float32))
    cases = [(np.zeros((1, 3, 16, 16), np.float32), None, "input"),          # a shape the model refuses
             (np.zeros((1, 3, 32, 32), np.float64), None, "input"),          # a dtype it does not take
             (np.zeros((1, 3, 32, 32), np.float32), [tritonhttp.InferRequestedOutput("nope")], "nope")]
    for x, outputs, named in cases:
        inp = tritonhttp.InferInput("input", list(x.shape), "FP64" if x.dtype == np.float64 else "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as e:
            c.infer("cnn", [inp], outputs=outputs)
        assert int(e.value.status()) == 400 and named in str(e.value), e.value
    assert _front_holds(d)   # still serving here
    assert _infer(c, np.zeros((2, 3, 32, 32), np.float32)).as_numpy("logits").shape == (2, 10)


def test_unload_lets_go_at_once_and_evicts(front):
    d, f, _ = front
    c = tritonhttp.InferenceServerClient(f.hostport)
    _run_at_front(d, c, np.zeros((1, 3, 32, 32), np.float32))
    c.unload_model("cnn")
    assert _cnn(d)["tier"] == "disk" and not _front_holds(d)
    assert not c.is_model_ready("cnn")
    c.load_model("cnn")
    assert _infer(c, np.zeros((1, 3, 32, 32), np.float32)).as_numpy("logits").shape == (1, 10)


def test_with_front_runs_never_every_request_goes_to_the_daemon(tmp_path, zoo_file):
    with served(tmp_path, zoo_file, MODELCACHE_FRONT_RUNS="never") as s:
        c = tritonhttp.InferenceServerClient(s.f.hostport)
        end = time.monotonic() + 3   # past the front's 2 s view of the model's description
        n = 0
        while time.monotonic() < end:
            _infer(c, np.zeros((1, 3, 32, 32), np.float32))
            n += 1
            assert not _front_holds(s.d)
        assert s.d.client().stats().executor["served"] == n


# -- the decision: Engine.front_may_run ---------------------------------------------------------
def _timed(h: Harness, seconds: float, rows: int = 1) -> None:
    for _ in range(3):
        h.engine.perf.record("m@1", 0, h.worker.state.kind, rows, seconds)


def test_the_engine_lets_a_front_run_only_what_it_would_run_alone_inline():
    h = Harness("serial")
    assert not h.engine.front_may_run("m@1", None, 1)          # not timed yet: its first requests go to the daemon
    _timed(h, 0.0002)
    assert h.engine.front_may_run("m@1", None, 1)
    assert h.engine.front_may_run("m@1", {}, 0)                # (an unpartitioned manifest lists no stages)
    assert not h.engine.front_may_run("m@1", None, 2)          # split into stages: the scheduler places them
    assert not h.engine.front_may_run("m@1", {"policy": "dynamic"}, 1)   # its own dynamic batching
    h.engine.settings.front_runs = "never"
    assert not h.engine.front_may_run("m@1", None, 1)
    long = Harness("serial")
    _timed(long, 0.005)                                        # over inline_run_ms (1 ms)
    assert not long.engine.front_may_run("m@1", None, 1)
    batching = Harness("dynamic")
    _timed(batching, 0.0002)
    assert not batching.engine.front_may_run("m@1", None, 1)
    fours = Harness("serial")
    _timed(fours, 0.0004, rows=4)                              # its clients always send 4 rows: timed at those
    assert fours.engine.front_may_run("m@1", None, 1)
    named = Harness("m=serial,*=dynamic")
    _timed(named, 0.0002)
    assert named.engine.front_may_run("m@1", {"policy": "dynamic"}, 1)   # the setting naming it wins


def test_a_malformed_report_is_refused_and_a_good_one_counted(tmp_path, zoo_file):
    """FrontServed from any lane client: checked field by field (ProtocolError), counted when sound."""
    from modelcache.client.rpc import Channel, lane_connection
    from modelcache.executor.stats import INFER_BUCKETS_S
    from modelcache.wire import protocol as P
    from modelcache.wire.lane import lane_path

    d = DaemonProcess(tmp_path).start()
    try:
        with d.client() as mc:
            mc.add(zoo_file("tiny-cnn"), "cnn")
        ch = Channel(d.socket, lane_connection(lane_path(d.socket), d.socket), 10.0)
        ok = [0] * (len(INFER_BUCKETS_S) + 1)
        ok[0] = 3
        good = {"counts": ok, "success_s": 0.002, "samples": 3, "run_s": 0.001, "failed": 1, "failed_s": 0.001,
                "last_unix_ms": int(time.time() * 1e3), "batches": {"1": [3, 0.001]}}
        for bad in ([], {"cnn@1": []}, {"cnn@1": {**good, "counts": ok[:-1]}}, {"cnn@1": {**good, "counts": [-1] * len(ok)}},
                    {"cnn@1": {**good, "run_s": float("nan")}}, {"cnn@1": {**good, "samples": 1.5}}, {7: good},
                    {"cnn@1": {**good, "batches": {"0": [1, 0.1]}}}, {"cnn@1": {**good, "batches": {"1": [1]}}},
                    {"cnn@1": {**good, "batches": [1, 2]}}):
            reply = ch.exchange(P.FrontServed(req_id=0, models=bad), (P.FrontServedReply,))
            assert isinstance(reply, P.ErrorReply) and reply.code == "protocol", (bad, reply)
        reply = ch.exchange(P.FrontServed(req_id=0, models={"cnn@1": good, "gone@9": good}), (P.FrontServedReply,))
        assert isinstance(reply, P.FrontServedReply) and reply.answers_dropped == 0, reply
        ch.close()
        executor = d.client().stats().executor
        assert (executor["served"], executor["failed"]) == (3, 1)
        m = executor["models"]["cnn@1"]
        assert (m["success"], m["samples"], m["failed"], m["executions"]) == (3, 3, 1, 3)
        assert m["batches"] == {"1": [3, 0.001]}   # (Triton's batch_stats: runs by their rows)
    finally:
        stop_cleanly(d)


def test_the_daemons_own_grpc_front_runs_it_too(tmp_path, zoo_file):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from test_grpc import free_port, wait_live

    port = free_port()
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_GRPC_PORT": str(port)}).start()
    try:
        path = zoo_file("tiny-cnn")
        with d.client() as mc:
            mc.add(path, "cnn")
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        wait_live(c)
        plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)

        def held():
            got = c.infer("cnn", [inp]).as_numpy("logits")
            np.testing.assert_allclose(got, plain.run(["logits"], {"input": x})[0], rtol=1e-5, atol=1e-6)
            return _front_holds(d)
        wait_until(held, timeout_s=20, what="the gRPC front running cnn itself")
        with d.client() as mc:
            clients = {cl["name"] for cl in mc.stats().clients}
        assert "grpc-front" in clients, clients
        c.close()
    finally:
        stop_cleanly(d)


def test_a_front_running_a_model_rides_out_a_daemon_killed_and_restarted(tmp_path, zoo_file):
    """Its mapping outlives the daemon; while the daemon is away requests are refused (503), not answered from a
    model no daemon holds; once it is back the front runs the model again, and counts reach the new daemon."""
    with served(tmp_path, zoo_file, MODELCACHE_FRONT_HOLD_S="0.5") as s:
        c = tritonhttp.InferenceServerClient(s.f.hostport)
        x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
        _run_at_front(s.d, c, x)
        s.d.kill()

        def refused():
            try:
                _infer(c, x)
            except InferenceServerException as e:
                return int(e.status()) == 503
            return False
        wait_until(refused, timeout_s=15, what="503 with the daemon gone")
        s.d = DaemonProcess(tmp_path, extra_env=s.env).start()
        plain = ort.InferenceSession(s.path, providers=["CPUExecutionProvider"])
        _run_at_front(s.d, c, x)
        np.testing.assert_allclose(_infer(c, x).as_numpy("logits"), plain.run(["logits"], {"input": x})[0],
                                   rtol=1e-5, atol=1e-6)
        wait_until(lambda: s.d.client().stats().executor["models"].get("cnn@1", {}).get("success", 0) >= 3,
                   timeout_s=10, what="the new daemon counting the front's requests")
