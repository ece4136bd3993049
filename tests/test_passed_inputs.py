"""Serve mode's large inputs as memory files passed over the lane (client/input_buffers.py, wire/tensors.py
map_passed_inputs, daemon/server.py _map_passed), against a real daemon: right answers, no file left anywhere,
a client in another mount namespace served, and every bad descriptor refused with the daemon up and nothing leaked."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import modelcache
from modelcache.errors import InputError
from modelcache.wire import protocol as P
from modelcache.wire.lane import LaneClient, lane_path
from modelcache.wire.tensors import INLINE_MAX_BYTES, IO_DIR, IO_PREFIX

from conftest import DaemonProcess, in_threads, stop_cleanly, wait_until

N = 100_000                      # floats: 400 KB, over INLINE_MAX_BYTES
assert N * 4 > INLINE_MAX_BYTES


def one_op_model(path, op: str, y_shape: list, **attrs) -> None:
    """y = op(x) over a float vector x of any length."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], op.lower(), [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))


def sum_model(path) -> None:
    """y = ReduceSum(x): each answer says which input the daemon read."""
    one_op_model(path, "ReduceSum", [], keepdims=0)


@contextlib.contextmanager
def daemon_serving(tmp_path, write_model, name: str):
    """A daemon with the model `write_model(path)` writes added as `name`; stopped cleanly after."""
    d = DaemonProcess(tmp_path).start()
    try:
        write_model(tmp_path / f"{name}.onnx")
        with d.client() as c:
            c.add(str(tmp_path / f"{name}.onnx"), name)
        yield d
        stop_cleanly(d)
    finally:
        d.kill()


@pytest.fixture
def summing(tmp_path):
    with daemon_serving(tmp_path, sum_model, "sum") as d:
        yield d


def io_files(pid: int | None = None) -> list[str]:
    """The I/O files a process (default: this one) has in /dev/shm (named IO_PREFIX + UID.PID.N)."""
    mine = f"{IO_PREFIX}{os.getuid()}.{pid or os.getpid()}."
    return [n for n in os.listdir(IO_DIR) if n.startswith(mine)]


def memfds() -> int:
    """This process's memory files for inputs."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:modelcache-input")
        except OSError:
            pass
    return n


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def memory_files(pid: int) -> set:
    """The memory files for inputs a process has open (their inodes: a mapping holds a descriptor of its own)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:modelcache-input"):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return found


def mapped_memfds(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:" in line for line in f)


def test_large_inputs_travel_as_memory_files_and_each_answer_is_its_own_input_s(summing):
    with modelcache.InferenceSession("sum", mode="serve", socket=summing.socket) as s:
        rng = np.random.default_rng(0)
        for n in (N, N // 2, 3 * N, N):     # several size classes, a smaller tensor in a reused file
            for _ in range(5):
                x = rng.integers(-1000, 1000, n).astype(np.float32)
                assert float(s.run(None, {"x": x})[0]) == float(x.sum(dtype=np.float64))
                assert io_files() == []                # nothing named in /dev/shm
        assert memfds() >= 1                           # kept for the next request
    with summing.client() as c:                        # and the same through the full client's lane
        x = (np.arange(N) % 100).astype(np.float32)   # (sums exact in float32)
        assert float(c.infer("sum", {"x": x})[0]["y"]) == float(x.sum(dtype=np.float64))
        assert io_files() == []
    # Answered, the requests' memory files are mapped no more (a worker kept its last job, inputs and all).
    wait_until(lambda: mapped_memfds(summing.pid) == 0, 10, "the daemon's mappings of passed inputs gone")


def test_threads_sharing_a_session_each_get_their_own_answers(summing):
    s = modelcache.InferenceSession("sum", mode="serve", socket=summing.socket)
    wrong = []

    def loop(seed: int):
        rng = np.random.default_rng(seed)
        for _ in range(25):
            x = rng.integers(-1000, 1000, N + seed).astype(np.float32)
            got = float(s.run(None, {"x": x})[0])
            if got != float(x.sum(dtype=np.float64)):
                wrong.append((seed, got))

    errors = in_threads(loop, 6)
    s.close()
    assert not errors and not wrong, (errors, wrong)


CONTAINED = r"""
import sys, numpy as np, modelcache
s = modelcache.InferenceSession("sum", mode="serve")
x = (np.arange(int(sys.argv[1])) % 100).astype(np.float32)
print(float(s.run(None, {"x": x})[0]) == float(x.sum(dtype=np.float64)), sorted(__import__("os").listdir("/dev/shm")))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace needs root and unshare(1)")
def test_a_client_in_another_mount_namespace_sends_large_inputs(summing):
    """A container beside the daemon's, with a /dev/shm of its own: a file named there was never found."""
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs none /dev/shm && exec "$0" -c "$1" "$2"',
                        sys.executable, CONTAINED, str(N)], env=summing.env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["True", "[]"], r.stdout + r.stderr


# -- bad descriptors, sent by hand over the lane -----------------------------------------------------------------
def raw_infer(conn: LaneClient, fds: list, ipc_fds: int | None = None, entry: dict | None = None, n: int = N,
              **fields):
    """Send an Infer naming passed descriptor 0 (or `entry`) with `fds`; its reply, or None where the daemon hung up."""
    entry = entry or {"name": "x", "dtype": "float32", "shape": [n], "fd": 0, "nbytes": 4 * n}
    kind, body = P.encode(P.Infer(req_id=7, client_id="", name="sum", inputs=[entry],
                                  ipc_fds=len(fds) if ipc_fds is None else ipc_fds, **fields))
    conn.send(kind, body, time.monotonic() + 10, fds)
    try:
        return P.decode(list(conn.receive(time.monotonic() + 30)))
    except ConnectionError:
        return None


def memfd(data: bytes, seals: int | None = None) -> int:
    import fcntl
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_bad_descriptors_are_refused_with_the_daemon_up_and_nothing_leaked(summing, tmp_path):
    import fcntl
    path = lane_path(summing.socket)
    ones = np.ones(N, np.float32).tobytes()
    with modelcache.InferenceSession("sum", mode="serve", socket=summing.socket) as s:   # settled, then counted
        s.run(None, {"x": np.ones(N, np.float32)})
        baseline = open_fds(summing.pid)
        conn = LaneClient(path)
        mine = []
        try:
            def refused(reply, *words):
                assert isinstance(reply, P.ErrorReply) and reply.code == "input", reply
                assert all(w in reply.message for w in words), reply.message

            mine.append(memfd(ones))                                           # not sealed
            refused(raw_infer(conn, [mine[-1]]), "sealed against shrinking")
            r, w = os.pipe()
            mine += [r, w]
            refused(raw_infer(conn, [r]), "not a memory file")                 # a pipe: never read, never waited on
            plain = tmp_path / "plain.bin"
            plain.write_bytes(ones)
            mine.append(os.open(plain, os.O_RDONLY))
            refused(raw_infer(conn, [mine[-1]]), "sealed against shrinking")   # a plain file can be truncated
            sealed = memfd(ones, fcntl.F_SEAL_SHRINK)
            mine.append(sealed)
            refused(raw_infer(conn, [sealed], n=2 * N), "holds 400000 bytes")  # shorter than the tensor
            refused(raw_infer(conn, [sealed], entry={"name": "x", "dtype": "float32", "shape": [N], "fd": 3}),
                    "names passed descriptor 3")
            at = {"name": "x", "dtype": "float32", "shape": [N], "nbytes": 4 * N}
            refused(raw_infer(conn, [sealed], entry={**at, "fd_at": [0, 4]}), "needs 400004 (400000 from byte 4)")
            refused(raw_infer(conn, [sealed], entry={**at, "fd_at": [0, -4]}), "offset -4")
            sparse = memfd(b"")                                                 # its size, none of its pages
            os.ftruncate(sparse, 8 * N)
            fcntl.fcntl(sparse, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            mine.append(sparse)
            refused(raw_infer(conn, [sparse], n=2 * N), "bytes written")      # the daemon would allocate them
            # A request refused as it is decoded (its priority out of range) still has its descriptor taken off the
            # connection: the next request's own is the one it reads.
            reply = raw_infer(conn, [memfd(b"\0" * (4 * N), fcntl.F_SEAL_SHRINK)], priority=-1)
            assert isinstance(reply, P.ErrorReply) and "priority" in reply.message, reply
            good = raw_infer(conn, [sealed])
            assert isinstance(good, P.InferReply), good
            assert P.decode(P.encode(good)).outputs[0]["data"] == np.float32(N).tobytes()
        finally:
            conn.close()

        # Passed and not declared, then a request with its own: the one it gets is not the file its message names,
        # and it is refused, never answered from the other file.
        conn = LaneClient(path)
        try:
            twos = memfd(np.full(N, 2, np.float32).tobytes(), fcntl.F_SEAL_SHRINK)
            mine.append(twos)
            assert isinstance(raw_infer(conn, [twos], ipc_fds=0, entry={"name": "x", "dtype": "float32",
                                                                        "shape": [N], "data": ones}), P.InferReply)
            entry = {"name": "x", "dtype": "float32", "shape": [N], "fd": 0, "nbytes": 4 * N,
                     "ino": os.fstat(sealed).st_ino}
            reply = raw_infer(conn, [sealed], entry=entry)
            assert isinstance(reply, P.ErrorReply) and "not the memory file the request names" in reply.message, reply
        finally:
            conn.close()

        # Declaring more than it passed: the stream cannot be trusted; that connection goes, the daemon stays.
        conn = LaneClient(path)
        try:
            assert raw_infer(conn, [sealed], ipc_fds=2) is None
        finally:
            conn.close()
        # Over ZeroMQ, which carries no descriptors.
        with summing.client(lane=False) as c:
            entry = {"name": "x", "dtype": "float32", "shape": [N], "fd": 0, "nbytes": 4 * N}
            with pytest.raises(InputError, match="only the daemon's lane"):
                c._call(P.Infer(req_id=0, client_id=c.client_id, name="sum", inputs=[entry], ipc_fds=1),
                        expect=(P.InferReply,))
        for fd in mine:
            os.close(fd)
        assert float(s.run(None, {"x": np.ones(N, np.float32)})[0]) == N      # still serving
        wait_until(lambda: open_fds(summing.pid) <= baseline, 10, "the daemon's descriptors back to where they were")


def test_a_tensor_is_read_where_its_message_says_in_a_passed_file(summing):
    """{"fd_at": [index, offset]}: a tensor that lies inside a passed file (the HTTP front's received body) is read
    from its offset, aligned or not; the daemon stays up and answers each from its own bytes."""
    import fcntl
    conn = LaneClient(lane_path(summing.socket))
    try:
        for offset in (64, 4096 + 3):   # (the second misaligned for float32: copied before it runs)
            x = np.arange(N, dtype=np.float32) % 7
            fd = memfd(b"\xff" * offset + x.tobytes() + b"\xff" * 5, fcntl.F_SEAL_SHRINK)
            try:
                entry = {"name": "x", "dtype": "float32", "shape": [N], "fd_at": [0, offset], "nbytes": 4 * N,
                         "ino": os.fstat(fd).st_ino}
                reply = raw_infer(conn, [fd], entry=entry)
                assert isinstance(reply, P.InferReply), reply
                assert np.frombuffer(P.decode(P.encode(reply)).outputs[0]["data"], np.float32)[0] == x.sum()
            finally:
                os.close(fd)
    finally:
        conn.close()


@contextlib.contextmanager
def http_front(tmp_path, write_model, name: str):
    """(front, tritonclient) over a daemon that runs every request itself (none in the front), serving the model
    `write_model(path)` writes as `name`; the front stops cleanly after."""
    import tritonclient.http as tritonhttp
    from test_http import HttpFront
    d = DaemonProcess(tmp_path, {"MODELCACHE_FRONT_RUNS": "never"}).start()
    front = None
    try:
        write_model(tmp_path / f"{name}.onnx")
        with d.client() as c:
            c.add(str(tmp_path / f"{name}.onnx"), name)
        front = HttpFront(d)
        yield front, tritonhttp.InferenceServerClient(front.hostport)
    finally:
        rc = front.stop() if front is not None else 0
        stop_cleanly(d)
        d.kill()
    assert rc == 0, front.log_path.read_text()


def test_a_front_passes_its_requests_large_inputs_as_memory_files(tmp_path):
    """The HTTP front, every request run by the daemon's engine: a 400 KB input answered right, through a memory file
    the front keeps (none named in /dev/shm)."""
    import tritonclient.http as tritonhttp
    with http_front(tmp_path, sum_model, "sum") as (front, client):
        rng = np.random.default_rng(0)
        for n in (N, 2 * N, N):
            x = rng.integers(-1000, 1000, n).astype(np.float32)
            inp = tritonhttp.InferInput("x", [n], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            assert float(client.infer("sum", [inp]).as_numpy("y")) == float(x.sum(dtype=np.float64))
        fds = [os.readlink(f"/proc/{front.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{front.proc.pid}/fd")]
        assert any(link.startswith("/memfd:modelcache-input") for link in fds), fds
        assert not io_files(front.proc.pid)


def two_sums_model(path) -> None:
    """(sa, sb) = (ReduceSum(Cast(a)), ReduceSum(b)) over a uint8 vector and a float vector of any lengths."""
    a = helper.make_tensor_value_info("a", TensorProto.UINT8, ["m"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("sa", "sb")]
    nodes = [helper.make_node("Cast", ["a"], ["af"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["af"], ["sa"], keepdims=0),
             helper.make_node("ReduceSum", ["b"], ["sb"], keepdims=0)]
    model = helper.make_model(helper.make_graph(nodes, "sums", [a, b], outs),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_the_http_front_passes_tensors_from_the_body_it_received(tmp_path):
    """A large binary infer body is read into one memory file of the front's, and its tensors pass to the daemon
    from there (http/http1.py receive_into, Passing.adopt): a uint8 input of an odd length, then a float input
    after it (misaligned in the body), each answered from its own bytes, over requests of changing sizes; the
    front keeps the body's file, none for the tensors."""
    import tritonclient.http as tritonhttp
    with http_front(tmp_path, two_sums_model, "sums") as (front, client):
        rng = np.random.default_rng(1)
        for m, n in ((300_001, N), (300_001, N), (3 * N + 7, 2 * N)):
            a = rng.integers(0, 16, m).astype(np.uint8)   # (sums float32 holds exactly)
            b = rng.integers(-1000, 1000, n).astype(np.float32)
            inputs = [tritonhttp.InferInput("a", [m], "UINT8"), tritonhttp.InferInput("b", [n], "FP32")]
            inputs[0].set_data_from_numpy(a, binary_data=True)
            inputs[1].set_data_from_numpy(b, binary_data=True)
            result = client.infer("sums", inputs)
            assert float(result.as_numpy("sa")) == float(a.sum(dtype=np.float64))
            assert float(result.as_numpy("sb")) == float(b.sum(dtype=np.float64))
            if (m, n) == (300_001, N):   # one request of this size, then two: one file, the body's, reused
                assert len(memory_files(front.proc.pid)) == 1
