"""Serve mode's large outputs written into memory files the request lent (wire/lent_outputs.py, client/input_buffers.py
Passing.lend), against a real daemon: exact answers over changing sizes, arrays that stay right while the client
holds them, files reused once they are dropped, and every file the daemon must not write refused with the daemon up
and nothing leaked."""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np
import pytest

import modelcache
from modelcache.client.input_buffers import InputBuffers
from modelcache.wire import protocol as P
from modelcache.wire.lane import LaneClient, lane_path
from modelcache.wire.tensors import INLINE_MAX_BYTES

from conftest import in_threads, wait_until
from test_passed_inputs import daemon_serving, http_front, memory_files, one_op_model, open_fds

N = 100_000                      # floats: 400 KB, over INLINE_MAX_BYTES
assert N * 4 > INLINE_MAX_BYTES


def neg_model(path) -> None:
    """y = -x: an output as large as the input, each answer exact."""
    one_op_model(path, "Neg", ["n"])


@pytest.fixture
def negating(tmp_path):
    with daemon_serving(tmp_path, neg_model, "neg") as d:
        yield d


def held_by(a: np.ndarray) -> str:
    """What an output array's memory is: "mmap" (a lent file's mapping) or "bytes" (an inline answer)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return type(a.obj if isinstance(a, memoryview) else a).__name__


def test_large_outputs_come_back_in_the_file_the_request_lent(negating):
    """The first answer of a size comes inline and sizes the file lent next (a small answer leaves it); later ones are
    views of that file. Arrays
    kept while more requests run stay exact (their file is not written again), and dropped, their files are
    reused."""
    rng = np.random.default_rng(0)
    kept = []
    with modelcache.InferenceSession("neg", mode="serve", socket=negating.socket) as s:
        for n, how in ((N, "bytes"), (N, "mmap"), (N, "mmap"), (3 * N, "bytes"), (3 * N, "mmap"),
                       (N // 2, "bytes"), (N, "mmap")):   # (N // 2: under INLINE_MAX_BYTES, inline whatever is lent)
            x = rng.standard_normal(n).astype(np.float32)
            y = s.run(None, {"x": x})[0]
            assert np.array_equal(y, -x) and held_by(y) == how, (n, held_by(y))
            assert not y.flags.writeable
            kept.append((x, y))
        assert all(np.array_equal(y, -x) for x, y in kept)   # none overwritten by a later answer
        held = len(memory_files(os.getpid()))
        kept.clear()
        x = rng.standard_normal(N).astype(np.float32)
        for _ in range(10):   # the held files back in the pool: no new file per request
            y = s.run(None, {"x": x})[0]
            assert np.array_equal(y, -x) and held_by(y) == "mmap"
            del y
        assert len(memory_files(os.getpid())) <= held
    with negating.client() as c:   # the full client's lane lends too
        x = rng.standard_normal(N).astype(np.float32)
        for how in ("bytes", "mmap"):
            y = c.infer("neg", {"x": x})[0]["y"]
            assert np.array_equal(y, -x) and held_by(y) == how
        # The daemon counts them: each "mmap" above was lent, each large "bytes" inline (N // 2 is not large).
        counters = c.stats().counters
        assert (counters["outputs_lent"], counters["outputs_large_inline"]) == (15, 3), counters
    wait_until(lambda: not memory_files(negating.pid), 10, "the daemon holding no lent file")


def test_threads_sharing_a_session_each_keep_their_own_answers(negating):
    """Six threads on one serve session, sizes changing, each keeping every answer it got: all exact at the end (no
    file lent to one request is written for another while an answer over it lives)."""
    s = modelcache.InferenceSession("neg", mode="serve", socket=negating.socket)
    kept = {}

    def loop(seed: int):
        rng = np.random.default_rng(seed)
        mine = kept.setdefault(seed, [])
        for i in range(20):
            x = rng.standard_normal(N * (1 + (i + seed) % 3) + seed).astype(np.float32)
            mine.append((x, s.run(None, {"x": x})[0]))
            if i % 4 == 3:
                del mine[0]   # (some answers dropped as the loop goes: their files reused meanwhile)

    errors = in_threads(loop, 6)
    s.close()
    assert not errors, errors
    assert all(np.array_equal(y, -x) for pairs in kept.values() for x, y in pairs)
    assert sum(held_by(y) == "mmap" for pairs in kept.values() for _, y in pairs) >= len(kept) * 5


def raw_infer(conn: LaneClient, fds: list, lent_fds: int = 1, n: int = N, **fields):
    """An Infer of `neg` with x inline (n floats, x[i] = i) and `fds`, the last `lent_fds` of them lent; its reply."""
    x = np.arange(n, dtype=np.float32)
    fields = {"name": "neg", **fields}
    kind, body = P.encode(P.Infer(req_id=7, client_id="", ipc_fds=len(fds), lent_fds=lent_fds,
                                  inputs=[{"name": "x", "dtype": "float32", "shape": [n], "data": x.tobytes()}],
                                  **fields))
    conn.send(kind, body, time.monotonic() + 10, fds)
    return P.decode(list(conn.receive(time.monotonic() + 30)))


def lent_file(size: int, allocated: int, seals: int = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK) -> int:
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocated:
        os.posix_fallocate(fd, 0, allocated)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_lent_files_the_daemon_must_not_write_are_refused_and_short_ones_answered_inline(negating):
    with modelcache.InferenceSession("neg", mode="serve", socket=negating.socket) as s:
        s.run(None, {"x": np.ones(N, np.float32)})   # the engine's session made before the descriptors are counted
        baseline = open_fds(negating.pid)
        conn = LaneClient(lane_path(negating.socket))
        mine = []
        try:
            def refused(reply, *words):
                assert isinstance(reply, P.ErrorReply) and reply.code == "input", reply
                assert all(w in reply.message for w in words), reply.message

            r, w = os.pipe()
            mine += [r, w]
            refused(raw_infer(conn, [w]), "lent descriptor 0", "sealed against growing")
            mine.append(lent_file(4 * N, 4 * N, fcntl.F_SEAL_SHRINK))     # may grow: a write past it would
            refused(raw_infer(conn, [mine[-1]]), "sealed against growing")
            mine.append(lent_file(4 * N, 4 * N, fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE))
            refused(raw_infer(conn, [mine[-1]]), "no write seal")
            good = lent_file(4 * N, 4 * N)
            mine.append(good)
            mine.append(os.open(f"/proc/self/fd/{good}", os.O_RDONLY))       # the same file, read-only
            refused(raw_infer(conn, [mine[-1]]), "writable")
            kind, body = P.encode(P.Infer(req_id=7, client_id="", name="neg", inputs=[], ipc_fds=1, lent_fds=2))
            conn.send(kind, body, time.monotonic() + 10, [good])
            reply = P.decode(list(conn.receive(time.monotonic() + 30)))
            assert isinstance(reply, P.ErrorReply) and "lent_fds 2" in reply.message, reply

            # Room only within the pages the client allocated: a file of holes gets the answer inline.
            sparse = lent_file(8 * N, 0)
            mine.append(sparse)
            reply = raw_infer(conn, [sparse])
            assert isinstance(reply, P.InferReply) and "data" in reply.outputs[0], reply
            assert os.fstat(sparse).st_blocks == 0                          # the daemon allocated nothing in it
            reply = raw_infer(conn, [good])
            assert isinstance(reply, P.InferReply) and reply.outputs[0]["lent_at"] == [0, 0], reply
            assert np.array_equal(np.frombuffer(os.pread(good, 4 * N, 0), np.float32), -np.arange(N, dtype=np.float32))
            reply = raw_infer(conn, [good], n=N + 1)                         # a float more than it has room for
            assert isinstance(reply, P.InferReply) and "data" in reply.outputs[0], reply
            # Refused after its files were taken (the model refuses the input; no such model): none kept.
            kind, body = P.encode(P.Infer(req_id=7, client_id="", name="neg", ipc_fds=1, lent_fds=1, inputs=[
                {"name": "x", "dtype": "int32", "shape": [N], "data": bytes(4 * N)}]))
            conn.send(kind, body, time.monotonic() + 10, [good])
            reply = P.decode(list(conn.receive(time.monotonic() + 30)))
            assert isinstance(reply, P.ErrorReply) and reply.code == "input", reply
            reply = raw_infer(conn, [good], name="nothing")
            assert isinstance(reply, P.ErrorReply) and reply.code == "not_found", reply
        finally:
            conn.close()
        for fd in mine:
            os.close(fd)
        x = np.ones(N, np.float32)
        assert np.array_equal(s.run(None, {"x": x})[0], -x)               # still serving
        wait_until(lambda: open_fds(negating.pid) <= baseline, 10, "the daemon's descriptors back to where they were")


def test_a_file_is_the_pools_again_only_once_the_arrays_over_its_answer_are_gone():
    """The pool's side, with no daemon: a file lent and answered into is held while an array over its answer lives,
    and taken again for the next request once the last one goes."""
    pool = InputBuffers()
    try:
        f = pool._take(4 * N)
        f.allocate(4 * N)
        os.pwrite(f.fd, np.arange(N, dtype=np.float32).tobytes(), 0)
        y = np.frombuffer(f.map_answer(), np.float32)[10:20]   # (a view of a view keeps it too)
        pool._give_back([f], pool._generation, True)
        other = pool._take(4 * N)
        assert other is not f and float(y[0]) == 10.0
        pool._give_back([other], pool._generation, True)
        del y
        assert pool._take(4 * N) is f
    finally:
        pool.close()


def test_the_http_front_answers_large_outputs_from_the_file_it_lent(tmp_path):
    """The HTTP front, every request run by the daemon's engine: y = -x exact over changing sizes, the answers read
    from the files the front lent, and the front holding a bounded number of them."""
    import tritonclient.http as tritonhttp
    with http_front(tmp_path, neg_model, "neg") as (front, client):
        rng = np.random.default_rng(2)
        files = []
        for _ in range(2):
            for n in (N, N, 3 * N, 3 * N, N, 3 * N):
                x = rng.standard_normal(n).astype(np.float32)
                inp = tritonhttp.InferInput("x", [n], "FP32")
                inp.set_data_from_numpy(x, binary_data=True)
                out = tritonhttp.InferRequestedOutput("y", binary_data=True)
                assert np.array_equal(client.infer("neg", [inp], outputs=[out]).as_numpy("y"), -x)
            files.append(memory_files(front.proc.pid))
        # Per size class, a file for the body received and one lent for the answer: taken again, none added.
        assert len(files[0]) == 4 and files[1] == files[0], files


def test_the_daemon_places_outputs_aligned_within_each_lent_files_allocated_pages():
    """LentFiles.place: at 64-byte boundaries, in the first file with room within the pages its owner allocated
    (a page past them, or past its size, is not written), else None (inline)."""
    from modelcache.wire.lent_outputs import LentFiles
    small, large = lent_file(1 << 16, 8192), lent_file(1 << 20, 1 << 20)
    mine = [os.dup(small), os.dup(large)]   # (LentFiles owns and closes the ones it is given)
    lent = LentFiles([small, large])
    try:
        assert lent.place(memoryview(b"a" * 100)) == (0, 0)
        assert lent.place(memoryview(b"b" * 4000)) == (0, 128)         # after byte 100, at the next 64
        assert lent.place(memoryview(b"c" * 8000)) == (1, 0)           # 4128 + 8000 > the 8192 allocated in file 0
        assert lent.place(memoryview(b"d" * (1 << 20))) is None        # room in neither
        assert os.pread(mine[0], 4, 128) == b"bbbb" and os.pread(mine[1], 4, 0) == b"cccc"
        assert os.fstat(mine[0]).st_blocks * 512 == 8192               # nothing allocated past the owner's pages
    finally:
        lent.close()
        for fd in mine:
            os.close(fd)


def test_a_forked_child_reads_the_answers_it_inherited_and_never_reuses_their_files():
    pool = InputBuffers()
    try:
        f = pool._take(4 * N)
        f.allocate(4 * N)
        os.pwrite(f.fd, np.arange(N, dtype=np.float32).tobytes(), 0)
        y = np.frombuffer(f.map_answer(), np.float32)
        pool._give_back([f], pool._generation, True)          # held: y is a view of its answer
        fd = f.fd
        pid = os.fork()
        if pid == 0:
            try:
                ok = f.fd < 0 and not pool._held and float(y[7]) == 7.0   # closed here; the array still reads
                taken = pool._take(4 * N)
                os._exit(0 if ok and taken is not f else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert f.fd == fd and pool._held == [f]                # the parent's, still
        del y
        assert pool._take(4 * N) is f
    finally:
        pool.close()


def test_the_file_lent_is_sized_for_the_largest_recent_answer_and_shrinks_after_smaller_ones():
    """InputBuffers.note_output_bytes: alternating batch sizes keep the larger size (neither goes inline); eight
    smaller answers in a row size it down; an answer without large outputs changes nothing; models apart."""
    from modelcache.client.input_buffers import HINT_SHRINK_AFTER
    pool = InputBuffers()
    try:
        assert pool.output_bytes("m") == 0
        for nbytes in (8 << 20, 1 << 20, 8 << 20, 1 << 20, 0, 8 << 20):
            pool.note_output_bytes("m", nbytes)
            assert pool.output_bytes("m") == 8 << 20
        for _ in range(HINT_SHRINK_AFTER - 1):
            pool.note_output_bytes("m", 1 << 20)
        assert pool.output_bytes("m") == 8 << 20
        pool.note_output_bytes("m", 1 << 20)
        assert pool.output_bytes("m") == 1 << 20 and pool.output_bytes("other") == 0
    finally:
        pool.close()


def test_an_answer_far_smaller_than_its_lent_file_is_copied_out_of_it(negating):
    """A file sized for a large recent answer, and an answer a tenth of it: the arrays are copies (read-only as the
    others), so that keeping them does not keep the whole file's pages."""
    rng = np.random.default_rng(3)
    with modelcache.InferenceSession("neg", mode="serve", socket=negating.socket) as s:
        for n, how in ((10 * N, "bytes"), (10 * N, "mmap"), (N, "NoneType"), (3 * N, "mmap")):
            x = rng.standard_normal(n).astype(np.float32)
            y = s.run(None, {"x": x})[0]
            assert np.array_equal(y, -x) and held_by(y) == how and not y.flags.writeable, (n, held_by(y))
