"""The request core (client/rpc.py): many requests in flight from many threads on one connection,
each answered to its own caller, and reconnects after the daemon goes away."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.client.rpc import Channel, lane_connection
from modelcache.errors import DaemonUnavailable, RequestTimeout
from modelcache.wire import lane, protocol as P
from conftest import DaemonProcess, wait_until
from test_batched_serving import batching_daemon


def fake_daemon(path: str, answer_after: int):
    """A lane peer that reads `answer_after` requests before answering any, then answers them in
    reverse order: only a client with that many requests in flight at once gets any answer."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        reader, requests = lane.FrameReader(), []
        while len(requests) < answer_after:
            data = conn.recv(65536)
            if not data:
                return
            reader.feed(data)
            while (message := reader.next()) is not None:
                requests.append(P.decode(list(message)))
        for req in reversed(requests):
            conn.sendall(lane.frame(*P.encode(P.ModelList(req_id=req.req_id, models=[{"asked": req.name}]))))
        conn.recv(1)      # until the client hangs up
        conn.close()
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def ask_from_threads(channel: Channel, threads_n: int) -> dict:
    """Thread k asks for model "mk" at once with the others; k -> the name its answer names, or its error
    (the fake daemons answer each request with the name it asked for)."""
    got: dict[int, object] = {}

    def ask(k: int):
        try:
            got[k] = channel.call(P.Describe(req_id=0, name=f"m{k}"), (P.ModelList,)).models[0]["asked"]
        except Exception as e:    # noqa: BLE001 (reported by the caller's assert)
            got[k] = e

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return got


def test_requests_of_many_threads_are_in_flight_at_once_and_each_gets_its_own_answer(tmp_path):
    path = str(tmp_path / "d.sock.lane")
    threads_n = 8
    server = fake_daemon(path, answer_after=threads_n)
    channel = Channel("ipc://" + path[:-len(".lane")], lambda: lane.LaneClient(path), timeout_s=10)
    got = ask_from_threads(channel, threads_n)
    channel.close()
    server.join(5)
    assert got == {k: f"m{k}" for k in range(threads_n)}


SAMPLES = 16


def test_threads_of_one_client_batch_together_in_the_daemon(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    # The batcher waits up to 20 ms for company: requests in flight together cannot miss each other.
    with batching_daemon(tmp_path, "dynamic", max_batch=256, max_queue_delay_ms=20) as (d, c):
        c.add(src, "cnn")
        c.infer("cnn", zoo.sample_inputs(src))
        batches, errors = [], []

        def serve(k: int):
            try:
                for i in range(20):
                    feeds = zoo.sample_inputs(src, batch=SAMPLES, seed=100 * k + i)   # long enough to queue behind
                    out, timings = c.infer("cnn", feeds)
                    np.testing.assert_allclose(out["logits"], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-5)
                    batches.extend(s["batch"] for s in timings["stages"])
            except Exception as e:    # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=serve, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(batches) >= 120
        # A batch above one request's samples holds requests of different threads of this one client.
        assert max(batches) > SAMPLES, batches


def test_the_core_reconnects_after_a_restart_and_fails_fast_meanwhile(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    path = lane.lane_path(d.socket)
    connects = []
    channel = Channel(d.socket, lane_connection(path, d.socket), timeout_s=30,
                      on_connect=lambda conn: connects.append(conn))
    try:
        assert isinstance(channel.call(P.ListModels(req_id=0), (P.ModelList,)), P.ModelList)
        channel.watch()
        assert d.stop() == 0
        wait_until(lambda: not channel.connected, timeout_s=10, what="the core to see the daemon gone")
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            channel.call(P.ListModels(req_id=0), (P.ModelList,), retry_safe=True)
        assert time.monotonic() - t0 < 2          # not the 30 s timeout
        d.start()
        # The watcher connects again by itself (with backoff), running on_connect before any call.
        wait_until(lambda: len(connects) >= 2 and channel.connected, timeout_s=15, what="a reconnect")
        assert isinstance(channel.call(P.ListModels(req_id=0), (P.ModelList,)), P.ModelList)
    finally:
        channel.close()
        assert d.stop() == 0
        d.kill()


def test_a_client_shared_by_threads_comes_back_after_a_restart(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    d = DaemonProcess(tmp_path).start()
    try:
        with d.client(timeout_s=20) as c:
            c.add(src, "cnn")
            feeds = zoo.sample_inputs(src)
            c.infer("cnn", feeds)
            assert d.stop() == 0
            d.start()
            results, errors = [], []

            def serve():
                try:
                    for _ in range(5):
                        results.append(c.infer("cnn", feeds)[0]["logits"].shape)
                except Exception as e:    # noqa: BLE001
                    errors.append(e)

            threads = [threading.Thread(target=serve) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert results == [(1, 10)] * 20
    finally:
        assert d.stop() == 0
        d.kill()


def test_a_caller_whose_answer_never_comes_times_out_while_others_are_answered(tmp_path):
    path = str(tmp_path / "d.sock.lane")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve():       # answers every request but the first
        conn, _ = server.accept()
        reader, seen = lane.FrameReader(), 0
        while True:
            data = conn.recv(65536)
            if not data:
                break
            reader.feed(data)
            while (message := reader.next()) is not None:
                req = P.decode(list(message))
                seen += 1
                if seen > 1:
                    conn.sendall(lane.frame(*P.encode(P.ModelList(req_id=req.req_id))))
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = Channel("ipc://x", lambda: lane.LaneClient(path), timeout_s=1.0)
    out = {}

    def first():
        try:
            channel.call(P.ListModels(req_id=0), (P.ModelList,))
        except RequestTimeout as e:
            out["first"] = e

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.1)    # the first request is out, and its caller reads for everyone
    for _ in range(3):
        assert isinstance(channel.call(P.ListModels(req_id=0), (P.ModelList,)), P.ModelList)
    t.join(5)
    assert isinstance(out.get("first"), RequestTimeout)
    channel.close()
    server.close()
    thread.join(5)


def test_the_zeromq_connection_carries_many_threads_requests_at_once(tmp_path):
    """A ZeroMQ socket is not thread-safe: senders hand their frames to the thread that reads for everyone."""
    import zmq
    from modelcache.client.connection import ZmqConnection
    address = f"ipc://{tmp_path}/z.sock"
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    threads_n = 8

    def serve():      # answers only once every thread's request is in, last first
        requests = [router.recv_multipart() for _ in range(threads_n)]
        for identity, kind, body in reversed(requests):
            req = P.decode([kind, body])
            router.send_multipart([identity, *P.encode(P.ModelList(req_id=req.req_id, models=[{"asked": req.name}]))])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    channel = Channel(address, lambda: ZmqConnection(ctx, address), timeout_s=10)
    got = ask_from_threads(channel, threads_n)
    server.join(5)
    channel.close()
    router.close(linger=0)
    assert got == {k: f"m{k}" for k in range(threads_n)}


def test_an_answer_followed_at_once_by_the_end_of_the_connection_is_an_answer(tmp_path):
    """A daemon that answers, then stops (a graceful stop after a long add), did answer."""
    path = str(tmp_path / "d.sock.lane")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        reader = lane.FrameReader()
        while (message := reader.next()) is None:
            reader.feed(conn.recv(65536))
        req = P.decode(list(message))
        time.sleep(0.2)    # the caller is in its poll by now: the answer and the end come in one read
        conn.sendall(lane.frame(*P.encode(P.ModelList(req_id=req.req_id))))
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = Channel("ipc://x", lambda: lane.LaneClient(path), timeout_s=5)
    assert isinstance(channel.call(P.ListModels(req_id=0), (P.ModelList,)), P.ModelList)
    with pytest.raises(DaemonUnavailable):
        channel.call(P.ListModels(req_id=0), (P.ModelList,))
    channel.close()
    server.close()
    thread.join(5)
