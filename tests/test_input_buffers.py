"""client/input_buffers.py: a serve client's memory files for large inputs (real memfds, an injected clock)."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from modelcache.client import input_buffers
from modelcache.client.input_buffers import IDLE_MAX_BYTES, IDLE_S, MAX_PASSED, InputBuffers, size_class


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def is_open(fd: int) -> bool:
    """Whether `fd` is still the memory file it was when first asked about (a closed number may be reused)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return _inodes.setdefault(fd, (st.st_dev, st.st_ino)) == (st.st_dev, st.st_ino)


_inodes: dict = {}


def same(fds: list) -> list:
    """Note which file each descriptor is now (for is_open later)."""
    for fd in fds:
        _inodes.pop(fd, None)
        is_open(fd)
    return fds


def written(fd: int, n: int) -> bytes:
    return os.pread(fd, n, 0)


def mapped_inodes() -> set:
    """Inodes of the memory files this process maps (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:modelcache-input" in line}


@pytest.fixture
def pool():
    p = InputBuffers(clock=Clock())
    yield p
    p.close()


def test_size_classes_are_powers_of_two_from_64_kib():
    assert size_class(1) == 64 << 10
    assert size_class(300_000) == 1 << 19
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == 1 << 21


def test_a_file_is_sealed_against_shrinking_and_growing_and_holds_what_was_put(pool):
    data = np.arange(100_000, dtype=np.float32)
    passing = pool.request()
    assert passing.put(memoryview(data).cast("B")) == (0, 0)
    fd = passing.fds[0]
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and not seals & fcntl.F_SEAL_WRITE
    assert os.fstat(fd).st_size == size_class(data.nbytes)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 10)                         # what would SIGBUS a reader's mapping
    assert written(fd, data.nbytes) == data.tobytes()
    passing.settle(answered=True)


def test_an_answered_request_s_file_is_reused_and_a_failed_one_s_closed(pool):
    a, b = np.ones(90_000, np.float32), np.full(80_000, 7, np.float32)   # the same size class
    first = pool.request()
    first.put(memoryview(a).cast("B"))
    fd = same(first.fds)[0]
    first.settle(answered=True)
    assert pool.idle_bytes == a.nbytes
    second = pool.request()
    second.put(memoryview(b).cast("B"))
    assert second.fds == [fd] and is_open(fd)        # the same file, the new tensor over the old one
    assert written(fd, b.nbytes) == b.tobytes()
    second.settle(answered=False)                    # a timeout: the daemon may still read it
    assert not is_open(fd) and pool.idle_bytes == 0
    third = pool.request()
    third.put(memoryview(b).cast("B"))
    assert third.fds != [] and is_open(same(third.fds)[0])   # a new one
    third.settle(answered=True)


def test_a_reused_file_is_written_through_its_mapping_as_far_as_it_had_pages_and_past_them_with_pwrite(pool):
    """The second tensor is longer than the first, in the same size class: its first bytes go through the mapping the
    file keeps, the rest by pwrite (pages the file never had). Each answer holds exactly what was put; the mapping
    goes with the file."""
    short, long_ = np.arange(70_000, dtype=np.float32), -np.arange(120_000, dtype=np.float32)   # 512 KiB files
    first = pool.request()
    first.put(memoryview(short).cast("B"))
    fd = same(first.fds)[0]
    ino = os.fstat(fd).st_ino
    assert ino not in mapped_inodes()                # a new file's pages are written with pwrite
    first.settle(answered=True)
    second = pool.request()
    second.put(memoryview(long_).cast("B"))
    assert second.fds == [fd] and ino in mapped_inodes()
    assert written(fd, long_.nbytes) == long_.tobytes()
    second.settle(answered=True)
    assert pool.idle_bytes == long_.nbytes
    third = pool.request()
    third.put(memoryview(short).cast("B"))           # all of it over pages the file has
    assert written(fd, short.nbytes) == short.tobytes()
    third.settle(answered=True)
    pool.close()
    assert not is_open(fd) and ino not in mapped_inodes()


def test_concurrent_requests_get_files_of_their_own(pool):
    x = np.zeros(70_000, np.float32)
    one, two = pool.request(), pool.request()
    one.put(memoryview(x).cast("B"))
    two.put(memoryview(x).cast("B"))
    assert one.fds[0] != two.fds[0]
    one.settle(True)
    two.settle(True)
    assert pool.idle_bytes == 2 * x.nbytes


def test_idle_files_are_kept_up_to_a_bound_and_closed_once_idle_too_long(pool):
    big = np.zeros(IDLE_MAX_BYTES // 4 // 4 * 3, np.float32)   # three quarters of the bound
    taken = [pool.request() for _ in range(2)]
    for p in taken:
        p.put(memoryview(big).cast("B"))
    fds = same([p.fds[0] for p in taken])
    for p in taken:
        p.settle(True)
    assert is_open(fds[0]) and not is_open(fds[1])   # the second would pass the bound: closed
    assert pool.idle_bytes == big.nbytes
    small = np.zeros(20_000, np.float32)
    p = pool.request()
    p.put(memoryview(small).cast("B"))
    p.settle(True)
    pool._clock.t += IDLE_S + 1
    p = pool.request()
    p.put(memoryview(small).cast("B"))               # (a take looks at the idle files first)
    assert not is_open(fds[0])
    p.settle(True)


def test_a_request_passes_at_most_max_passed_descriptors(pool):
    x = np.zeros(20_000, np.float32)
    p = pool.request()
    assert [p.put(memoryview(x).cast("B")) for _ in range(MAX_PASSED)] == [(i, 0) for i in range(MAX_PASSED)]
    assert p.put(memoryview(x).cast("B")) is None    # the caller sends it inline
    p.settle(False)


def test_a_forked_child_drops_the_files_it_inherited_and_never_gives_back_the_parents(pool):
    x = np.zeros(20_000, np.float32)
    for _ in range(2):                               # (the second write goes through the file's mapping)
        idle = pool.request()
        idle.put(memoryview(x).cast("B"))
        idle_fd = same(idle.fds)[0]
        idle.settle(True)
    idle_ino = os.fstat(idle_fd).st_ino
    assert idle_ino in mapped_inodes()
    in_flight = pool.request()                       # taken by another thread as the fork happens
    in_flight.put(memoryview(np.zeros(200_000, np.float32)).cast("B"))   # (another size class than the idle one)
    flying_fd = same(in_flight.fds)[0]
    pid = os.fork()
    if pid == 0:
        try:
            ok = (not is_open(idle_fd) and not is_open(flying_fd) and pool.idle_bytes == 0
                  and pool in input_buffers._pools and idle_ino not in mapped_inodes())
            in_flight.settle(True)                   # the parent's: closed here, not kept
            ok = ok and pool.idle_bytes == 0
            mine = pool.request()
            mine.put(memoryview(x).cast("B"))
            mine.settle(True)
            os._exit(0 if ok and pool.idle_bytes == x.nbytes else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert is_open(idle_fd) and is_open(flying_fd)   # the parent's files are the parent's still
    in_flight.settle(True)
    assert pool.idle_bytes == x.nbytes + 800_000


def test_close_closes_every_idle_file():
    pool = InputBuffers()
    p = pool.request()
    p.put(memoryview(np.zeros(20_000, np.float32)).cast("B"))
    fd = same(p.fds)[0]
    p.settle(True)
    pool.close()
    assert not is_open(fd) and pool not in input_buffers._pools


def test_a_request_that_fails_to_encode_keeps_no_memory_file(pool):
    """The first input written into a memory file, the second refused: the request never leaves, its file is closed."""
    from modelcache.client.rpc import infer_call
    from modelcache.errors import InputError

    def memfds() -> set:
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:modelcache-input"):
                    out.add(int(fd))
            except OSError:
                pass
        return out

    before = memfds()
    feeds = {"big": np.zeros(100_000, np.float32), "bad": np.array(["fine", object()], dtype=object)}
    with pytest.raises(InputError, match="string tensor"):
        infer_call(lambda wire, fds: pytest.fail("sent"), feeds, None, "m", pool)
    assert memfds() == before and pool.idle_bytes == 0


def test_a_received_body_s_tensors_pass_where_they_lie_and_the_rest_are_written(pool):
    """A body received into a file of the pool (the HTTP front's): its binary part starts aligned, its pages are
    allocated before anything writes there, and a tensor inside it passes as (its file, its offset) while one
    outside it is written into a file of its own; the body goes back to the pool once released, unless its request
    was not answered."""
    head, a, b = b'{"json": 1}', np.arange(70_000, dtype=np.float32), np.arange(90_000, dtype=np.float32)
    body = pool.receive(len(head) + a.nbytes, aligned_after=len(head))
    assert (body.start + len(head)) % input_buffers.BODY_ALIGN == 0
    assert os.fstat(body.file.fd).st_blocks * 512 >= body.start + len(body.view)   # allocated, not faulted in
    body.view[:] = head + a.tobytes()
    inside = np.frombuffer(body.view[len(head):], np.float32)
    passing = pool.request()
    passing.adopt(body)
    assert passing.put(memoryview(inside).cast("B")) == (0, body.start + len(head))
    assert passing.put(memoryview(inside[10:]).cast("B")) == (0, body.start + len(head) + 40)   # (one file, once)
    assert passing.put(memoryview(b).cast("B")) == (1, 0)
    assert written(passing.fds[0], body.start + len(body.view))[body.start + len(head):] == a.tobytes()
    body_fd = same(passing.fds)[0]
    passing.settle(answered=True)
    del inside
    body.release()
    assert is_open(body_fd) and pool.idle_bytes > 0   # kept for the next body
    again = pool.receive(len(head) + a.nbytes, aligned_after=len(head))
    assert again.file.fd == body_fd
    unanswered = pool.request()
    unanswered.adopt(again)
    unanswered.put(memoryview(np.frombuffer(again.view[len(head):], np.float32)).cast("B"))
    unanswered.settle(answered=False)                # the daemon may still read it
    again.release()
    assert not is_open(body_fd)

