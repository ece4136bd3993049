"""Where a serve client puts a large input for the daemon: memory files, passed as descriptors and reused.

A serve request's input over INLINE_MAX_BYTES used to go through a file in /dev/shm named in the message.
Two things were wrong with that. A client in another container (its own /dev/shm) could not send one at all:
the daemon found no such file. And it was slow: a new tmpfs file's pages are allocated as they are written
and freed at the unlink, on every request, and the daemon copied the file out (a file it maps could be
truncated under it: SIGBUS). `benchmarks/inputs/ways.py` measured the ways there are, round trip of the bare
hand-over (ways.txt, medians over 5 rounds): 0.3 MB 567 us by file against 240 us this way, 4.8 MB 7.5 against
3.2 ms, 48 MB 114 against 34 ms. A new memory file each time costs what a file does up to a few MB (its pages are
allocated as written, there too): the reuse is what pays.

So a lane client writes a large input into a memory file (memfd_create) it keeps for the next request, and
passes its descriptor with the Infer (SCM_RIGHTS): nothing to name, find or remove, in any mount namespace.
Each file is sealed against shrinking and growing at its birth (F_SEAL_SHRINK | F_SEAL_GROW), so the daemon may
map it instead of copying it (wire/tensors.map_passed_inputs checks the seal): it cannot shrink under a mapping.
It is not sealed against writing, which would make it single-use: what this process writes into a file the
daemon still reads changes only this process's own answer, and a file goes back into the pool only once its
request was answered (a timed-out or failed request's file is closed, never reused).

A reused file is written through a shared mapping the client keeps with it, as far as earlier writes allocated its
pages: a copy into pages that are there is a memcpy, where pwrite takes the kernel's page-cache path page by page
(`benchmarks/inputs/ways.py`: `memfd-mapped` x0.61-0.81 the round trip of `memfd-reused`, which writes with
pwrite). The mapping costs no memory of its own: it shows the file's pages. New pages are written with pwrite,
which reports a memory limit as ENOMEM where a mapping's page fault would be a SIGBUS or an OOM kill.

A file's size is the next power of two at or above the tensor's (at least 64 KiB): a tmpfs allocates only the
pages written, so the rounding costs no memory, and one file serves every tensor of its size class. The pool
keeps at most IDLE_MAX_BYTES of written pages between requests, and closes a file idle for IDLE_S (checked as
requests come: no thread). A forked child drops the files it inherited: the parent reuses them.
"""

from __future__ import annotations

import _thread
import fcntl
import mmap
import os
import time

from ..errors import DaemonUnavailable, ModelCacheError, RequestTimeout

MIN_FILE_BYTES = 64 << 10
IDLE_MAX_BYTES = 64 << 20     # written pages kept between requests, per pool (what an idle client holds at most)
IDLE_S = 30.0                 # a file not reused for this long is closed at the next request
MAX_PASSED = 64               # descriptors one request passes; its further large inputs go inline
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class _File:
    __slots__ = ("fd", "ino", "size", "written", "idle_since", "_map")

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.written, self.idle_since = fd, size, 0, 0.0
        self.ino = os.fstat(fd).st_ino   # named in the message: the daemon checks it has this very file
        self._map: mmap.mmap | None = None

    def write(self, data: memoryview) -> None:
        """Copy `data` (bytes) to the file's start: through the mapping as far as earlier writes allocated its pages,
        with pwrite past them. A page first written through a mapping that the memory limit (the cgroup's) cannot
        give is a SIGBUS or an OOM kill; pwrite says ENOMEM, which the request reports."""
        n = len(data)
        mapped = min(n, self.written)
        if mapped:
            if self._map is None:
                self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._map[:mapped] = data[:mapped]
        done = mapped
        while done < n:
            done += os.pwrite(self.fd, data[done:], done)
        self.written = max(self.written, n)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()   # (no view of it outlives a write: nothing holds it open)
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def size_class(nbytes: int) -> int:
    return max(MIN_FILE_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


class InputBuffers:
    """A client's memory files for its requests' large inputs (one pool per client, shared by its threads)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = _thread.allocate_lock()
        self._idle: dict[int, list[_File]] = {}   # size class -> files, the most recently used last
        self._out: set = set()                    # files taken by requests not yet settled
        self._generation = 0                      # + 1 in a forked child: the files taken before are the parent's
        self.refused = False                      # the daemon cannot take descriptors (older): files, as before
        _pools.add(self)

    def request(self) -> "Passing":
        """One request's inputs: tensors.encode puts the large ones here; send `passing.fds` with the message, then
        `settle(answered)`."""
        return Passing(self)

    @property
    def idle_bytes(self) -> int:
        return sum(f.written for files in self._idle.values() for f in files)

    def _take(self, nbytes: int) -> _File:
        size = size_class(nbytes)
        with self._lock:
            self._expire()
            files = self._idle.get(size)
            if files:
                f = files.pop()
                self._out.add(f)
                return f
        fd = os.memfd_create("modelcache-input", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            f = _File(fd, size)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._out.add(f)
        return f

    def _give_back(self, files: list, generation: int, reuse: bool) -> None:
        with self._lock:
            keep = reuse and generation == self._generation
            now = self._clock()
            for f in files:
                self._out.discard(f)
                if f.fd < 0:   # (closed at a fork: taken before it, in another thread of the parent)
                    continue
                if keep and self.idle_bytes + f.written <= IDLE_MAX_BYTES:
                    f.idle_since = now
                    self._idle.setdefault(f.size, []).append(f)
                else:
                    f.close()

    def _expire(self) -> None:
        """(Under the lock.) Close the files idle for IDLE_S."""
        cutoff = self._clock() - IDLE_S
        for size, files in list(self._idle.items()):
            while files and files[0].idle_since < cutoff:
                files.pop(0).close()
            if not files:
                del self._idle[size]

    def close(self) -> None:
        _pools.discard(self)
        with self._lock:
            for files in self._idle.values():
                for f in files:
                    f.close()
            self._idle.clear()

    def _after_fork(self) -> None:
        """In a forked child: the idle files are the parent's too (it writes into them for its own requests), and
        those out with requests were taken by the parent's other threads, which the child does not have: this
        process's copies of them all (descriptors and mappings) are closed."""
        self._lock = _thread.allocate_lock()
        for f in [f for files in self._idle.values() for f in files] + list(self._out):
            f.close()
        self._idle.clear()
        self._out.clear()
        self._generation += 1


class Passing:
    """One request's out-of-message inputs. `encode(feeds)` gives the message's tensors, the large ones written into
    memory files of `pool` (`put` says which of the message's descriptors each is) or, with no pool (ZeroMQ, a
    daemon older than passed inputs), into shared-memory files; `fds` go with the message; `settle_after` removes
    the shared-memory files and hands the memory files back once the request is over."""
    __slots__ = ("_pool", "_files", "_generation", "_shm_files")

    def __init__(self, pool: InputBuffers | None):
        self._pool, self._files, self._shm_files = pool, [], []
        self._generation = pool._generation if pool is not None else 0

    def encode(self, feeds: dict, group_of: str | None, model: str) -> list:
        """tensors.encode's wire list for `feeds` (shared-memory files readable by `group_of`'s group); a failure
        keeps no file."""
        from ..wire import tensors
        try:
            wire, self._shm_files = tensors.encode(feeds, group_of=group_of, model=model,
                                                   passing=self if self._pool is not None else None)
        except BaseException:   # (a memory file that could not be made or written, an input refused after it)
            self.settle(False)
            raise
        return wire

    @property
    def fds(self) -> list[int]:
        return [f.fd for f in self._files]

    def put(self, data: memoryview) -> int | None:
        """Write `data` (bytes) into a memory file of this request's; its index among `fds`, or None when the
        request passes MAX_PASSED already (the caller sends it inline)."""
        if len(self._files) >= MAX_PASSED:
            return None
        f = self._pool._take(len(data))
        self._files.append(f)   # (from now: a failed write closes it with the request's others)
        f.write(data)
        return len(self._files) - 1

    def inode(self, index: int) -> int:
        return self._files[index].ino

    def settle_after(self, error: BaseException | None) -> None:
        """The request ended with `error` (None: answered): its shared-memory files go, and its memory files are
        settled. An error reply is an answer too (the daemon is done with the files); a lost daemon, a timeout or
        an interruption is not."""
        files, self._shm_files = self._shm_files, []
        for path in files:
            os.unlink(path)
        self.settle(error is None or isinstance(error, ModelCacheError)
                    and not isinstance(error, (DaemonUnavailable, RequestTimeout)))

    def settle(self, answered: bool) -> None:
        """The request is over: an answered one's files are reused; else (a timeout, a lost daemon: it may still
        read them) they are closed."""
        if self._files:   # (most requests pass none: no lock to take)
            files, self._files = self._files, []
            self._pool._give_back(files, self._generation, answered)


_pools: set = set()   # every open pool, for the fork hook (a pool leaves it at close)


def _in_forked_child() -> None:
    for pool in list(_pools):
        pool._after_fork()


os.register_at_fork(after_in_child=_in_forked_child)
