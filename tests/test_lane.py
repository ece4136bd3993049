"""The serve lane: framing (pure), then a real daemon answering over it, refusing garbage and going away."""

from __future__ import annotations

import os
import socket
import struct
import time

import msgpack
import numpy as np
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.errors import DaemonUnavailable, InputError
from modelcache.wire import tensors
from modelcache.wire import protocol as P
from modelcache.wire.lane import HEADER, FrameReader, LaneError, frame, lane_path
from conftest import DaemonProcess, wait_until


def test_frames_come_out_whole_however_the_bytes_arrive():
    stream = frame(b"infer", b"x" * 1000) + frame(b"ok", b"") + frame(b"k", b"yz")
    r = FrameReader()
    got = []
    for i in range(0, len(stream), 7):          # 7-byte pieces: headers and bodies split anywhere
        r.feed(stream[i:i + 7])
        while (m := r.next()) is not None:
            got.append(m)
    assert got == [(b"infer", b"x" * 1000), (b"ok", b""), (b"k", b"yz")]
    assert r.next() is None


@pytest.mark.parametrize("header", [HEADER.pack(0, 3), HEADER.pack(5, 1 << 31)])
def test_a_broken_header_is_an_error_not_a_wait(header):
    r = FrameReader()
    r.feed(header + b"xxxxxxxx")
    with pytest.raises(LaneError):
        r.next()


def test_only_ipc_daemons_have_a_lane():
    assert lane_path("ipc:///run/modelcache/daemon.sock") == "/run/modelcache/daemon.sock.lane"
    assert lane_path("tcp://127.0.0.1:5555") is None


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1"}).start()
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]
    d.kill()


def raw_lane(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(lane_path(daemon.socket))
    return s


def read_frame(s: socket.socket) -> tuple[bytes, bytes] | None:
    r = FrameReader()
    while (m := r.next()) is None:
        data = s.recv(65536)
        if not data:
            return None
        r.feed(data)
    return m


def test_infer_over_the_lane_and_over_zeromq_agree_with_ort(daemon, zoo_file):
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src, batch=2)
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with daemon.client() as c, daemon.client(lane=False) as z:
        c.add(src, "cnn")
        for conn in (c, z):
            np.testing.assert_allclose(conn.infer("cnn", feeds)[0]["logits"], want, rtol=1e-4, atol=1e-5)
        assert c.stats().executor["lane_connections"] == 1      # c's lane; z has none
        with pytest.raises(InputError, match="must be float32"):  # errors come back over the lane too
            c.infer("cnn", {"input": feeds["input"].astype(np.float64)})
        assert c.infer("cnn", feeds)[0]["logits"].shape == (2, 10)


def test_a_stream_of_requests_gets_every_answer_over_the_lane_and_over_zeromq(daemon, zoo_file):
    from modelcache.client.stream import InferStream
    src = zoo_file("tiny-cnn")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    feeds_list = [zoo.sample_inputs(src, seed=i) for i in range(20)]
    with daemon.client() as c, daemon.client(lane=False) as z:
        c.add(src, "cnn")
        for conn, lanes in ((c, 2), (z, 1)):   # c's stream has a lane of its own; z's uses ZeroMQ
            with InferStream(conn) as stream:
                # (the daemon accepts a lane connection on its own time, and drops add's once it sees it closed)
                wait_until(lambda: conn.stats().executor["lane_connections"] == lanes, timeout_s=10,
                           what=f"{lanes} lane connections")
                for i, feeds in enumerate(feeds_list):
                    stream.send(i, "cnn", tensors.encode(feeds)[0])
                stream.send(99, "ghost", tensors.encode(feeds_list[0])[0])   # an error is an answer too
                answers, deadline = {}, time.monotonic() + 60
                while len(answers) < 21 and time.monotonic() < deadline:
                    for req_id, wire, _, error in stream.receive(1000):
                        answers[req_id] = error if error is not None else tensors.decode(wire)[0]["logits"]
            assert "no model named 'ghost'" in str(answers.pop(99))
            for i, feeds in enumerate(feeds_list):
                np.testing.assert_allclose(answers[i], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-5)


def test_garbage_on_the_lane_costs_that_connection_only(daemon, zoo_file):
    with daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        s = raw_lane(daemon)                 # a well-framed message that is not one: answered with an error
        s.sendall(frame(b"infer", b"\xc1\xc1"))
        kind, body = read_frame(s)
        reply = P.decode([kind, body])
        assert isinstance(reply, P.ErrorReply) and reply.code == "protocol"
        s.sendall(frame(b"list", msgpack.packb({"req_id": 7})))   # ... and the connection still works
        assert P.decode(list(read_frame(s))).req_id == 7
        s.sendall(struct.pack("<BI", 0, 4) + b"junk")           # a broken stream: the daemon hangs up
        assert read_frame(s) is None
        s.close()
        half = raw_lane(daemon)              # a client that leaves mid-message
        half.sendall(HEADER.pack(5, 100) + b"infer" + b"x" * 10)
        half.close()
        out, _ = c.infer("cnn", zoo.sample_inputs(zoo_file("tiny-cnn")))
        assert out["logits"].shape == (1, 10)
        assert c.stats().counters["bad_messages"] >= 2


def test_a_client_that_leaves_before_its_answer_does_not_hurt(daemon, zoo_file):
    src = zoo_file("tiny-cnn")
    with daemon.client() as c:
        c.add(src, "cnn")
        wire, _ = tensors.encode(zoo.sample_inputs(src, batch=64), inline_only=True)  # 0.8 MB in the message
        for _ in range(5):
            s = raw_lane(daemon)
            s.sendall(frame(*P.encode(P.Infer(req_id=1, client_id=c.client_id, name="cnn", inputs=wire))))
            s.close()                         # gone before the answer
        assert c.infer("cnn", zoo.sample_inputs(src))[0]["logits"].shape == (1, 10)
        deadline = time.monotonic() + 10
        while c.stats().executor["lane_connections"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().executor["lane_connections"] == 1


def test_a_stopped_daemon_is_a_clear_error_and_leaves_no_lane_file(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    path = lane_path(d.socket)
    c = d.client(timeout_s=60)
    c.add(zoo_file("tiny-cnn"), "cnn")
    feeds = zoo.sample_inputs(zoo_file("tiny-cnn"))
    c.infer("cnn", feeds)
    from modelcache.client.stream import InferStream
    stream = InferStream(c)
    assert os.path.exists(path)
    assert d.stop() == 0
    assert not os.path.exists(path)
    t = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        c.infer("cnn", feeds)
    with pytest.raises(DaemonUnavailable):
        stream.receive(30_000)
    assert time.monotonic() - t < 5          # not the 60 s request timeout, nor the stream's 30 s
    stream.close()
    c.close()
    d.kill()


def test_a_large_reply_read_slowly_arrives_whole_and_exact(daemon, tmp_path):
    """A 4.8 MB output goes back inline, packed from the array and sent beside its frame header (not joined to it):
    read in small pieces by a client that lags, so the daemon sends it in parts, every byte arrives in order; two
    such replies on one connection, and a small request after them, keep their frames."""
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "neg.onnx"))
    with daemon.client() as c:
        c.add(str(tmp_path / "neg.onnx"), "neg")
        s = raw_lane(daemon)
        inputs = [np.arange(1_200_000, dtype=np.float32) + k for k in range(2)] + [np.ones(3, np.float32)]
        for k, a in enumerate(inputs):
            wire, _ = tensors.encode({"x": a}, inline_only=True)
            s.sendall(frame(*P.encode(P.Infer(req_id=k + 1, client_id="", name="neg", inputs=wire))))
        reader = FrameReader()
        for k, a in enumerate(inputs):
            while (m := reader.next()) is None:
                time.sleep(0.002)
                data = s.recv(32768)
                assert data, "the daemon hung up"
                reader.feed(data)
            reply = P.decode(list(m))
            assert isinstance(reply, P.InferReply) and reply.req_id == k + 1, reply
            np.testing.assert_array_equal(tensors.decode(reply.outputs)[0]["y"], -a)
        s.close()
