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
pwrite). The mapping costs no memory of its own: it shows the file's pages. New pages are written with pwrite
(a fresh 48 MB file filled in 36 ms, 59-66 through a mapping: `benchmarks/inputs/fresh_pages.py`).
Under a memory limit the files' pages count as any memory of the process's, and past the limit the kernel's OOM
killer acts however they were allocated: 256 MiB written with pwrite, through a mapping, after fallocate, or as a
bytearray, in a 96 MiB cgroup (v1, kernel 6.18), was SIGKILLed each way; none saw ENOMEM
(`python benchmarks/inputs/fresh_pages.py`).

A file's size is the next power of two at or above the tensor's (at least 64 KiB): a tmpfs allocates only the
pages written, so the rounding costs no memory, and one file serves every tensor of its size class. The pool
keeps at most IDLE_MAX_BYTES of written pages between requests, and closes a file idle for IDLE_S (checked as
requests come: no thread). A forked child drops the files it inherited: the parent reuses them.

A file can also be filled by its owner before any tensor is known (`receive`): the HTTP front reads a large infer
body from its socket straight into one (http/http1.py), and the tensors the body holds pass as slices of that file
(`Passing.adopt`, {"fd_at": [index, offset]} on the wire): the bytes are copied once, from the socket, where a
body collected in chunks was joined, decoded and copied into a file of its own again (benchmarks/inputs,
`--fronts`). Its new pages are allocated in one fallocate before the socket writes into its mapping (a fresh 48 MB
file filled: 59 ms against 66 ms faulting each page in; the same file again, its mapping kept, 4.8 ms: the reuse is
what pays, `benchmarks/inputs/fresh_pages.py`).

The same files come back for outputs (`Passing.lend`, wire/lent_outputs.py): a request lends one, its pages allocated
here for as many bytes as the model's recent answers' large outputs took, and the daemon writes the answer's large
outputs into it. The arrays returned are views of a read-only mapping of it, so the file is held (`_held`) until the
last of them is gone, and only then reused (`_reap`, as a request takes a file).
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
BODY_ALIGN = 64               # a received body's binary part starts at a multiple of this in its file (a cache line)
HELD_MAX = 32                 # files whose answers' arrays live, kept for reuse; past it the oldest leaves the pool
HINTS_MAX = 256               # models whose answers' output size is kept (the size of the file lent next)
HINT_SHRINK_AFTER = 8         # smaller answers in a row after which a model's lent file is sized down
WASTE_MAX = 4                 # an answer this many times smaller than its lent file's pages is copied out of it
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class _File:
    __slots__ = ("fd", "ino", "size", "written", "idle_since", "_map", "_address", "answer_map")

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.written, self.idle_since = fd, size, 0, 0.0
        self.ino = os.fstat(fd).st_ino   # named in the message: the daemon checks it has this very file
        self._map: mmap.mmap | None = None
        self._address = 0                # where the mapping starts in this process (0: not asked yet)
        # Lent for an answer's outputs: the read-only mapping its arrays are views of (while they live, the file is
        # theirs, not the pool's: InputBuffers._reap).
        self.answer_map: mmap.mmap | None = None

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return self._map

    def write(self, data: memoryview) -> None:
        """Copy `data` (bytes) to the file's start: through the mapping as far as earlier writes allocated its pages,
        with pwrite past them."""
        n = len(data)
        mapped = min(n, self.written)
        if mapped:
            self._mapping()[:mapped] = data[:mapped]
        done = mapped
        while done < n:
            done += os.pwrite(self.fd, data[done:], done)
        self.written = max(self.written, n)

    def region(self, start: int, end: int) -> memoryview:
        """Bytes start..end of the file, writable, through its mapping, their pages allocated (fallocate: at once,
        where writing into the mapping would fault them in one by one). OSError when they cannot be."""
        self.allocate(end)
        return memoryview(self._mapping())[start:end]

    def allocate(self, end: int) -> None:
        """The file's pages up to byte `end` allocated, by this process (so charged to it). OSError when they cannot
        be."""
        if end > self.written:
            os.posix_fallocate(self.fd, self.written, end - self.written)
            self.written = end

    def map_answer(self) -> mmap.mmap:
        """A fresh read-only mapping of the whole file, for the arrays of the answer written into it (the daemon
        writes within the pages allocated, which fallocate rounds up to whole pages: past `written`)."""
        self.answer_map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        return self.answer_map

    def answer_dropped(self) -> bool:
        """Whether the arrays over the answer's mapping are all gone (it closes then), so that the file may be
        written again."""
        try:
            self.answer_map.close()
        except BufferError:   # (a view of it lives)
            return False
        self.answer_map = None
        return True

    @property
    def address(self) -> int:
        """Where the file's mapping starts in this process's memory."""
        if not self._address:
            import numpy as np
            self._address = np.frombuffer(self._mapping(), np.uint8).__array_interface__["data"][0]
        return self._address

    def close(self) -> None:
        for m in (self._map, self.answer_map):
            if m is not None:
                try:
                    m.close()
                except BufferError:   # a view of a body or of an answer still lives: it unmaps when the last one goes
                    pass
        self._map = self.answer_map = None
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
        self._held: list[_File] = []              # files with an answer's outputs that arrays may still be views of
        self._output_bytes: dict[str, tuple] = {}   # model -> (bytes to lend for, smaller answers since: Passing.lend)
        self._generation = 0                      # + 1 in a forked child: the files taken before are the parent's
        self.refused = False                      # the daemon cannot take descriptors (older): files, as before
        _pools.add(self)

    def receive(self, nbytes: int, aligned_after: int = 0) -> "Received | None":
        """A file of this pool to receive a body of `nbytes` into, placed so that its byte `aligned_after` (where its
        binary tensors begin) falls on a multiple of BODY_ALIGN; None when no memory file can be had for it (out of
        descriptors or map areas: the caller collects the body as it would have)."""
        pad = -aligned_after % BODY_ALIGN
        try:
            f = self._take(pad + nbytes)
        except OSError:
            return None
        try:
            view = f.region(pad, pad + nbytes)
        except (OSError, ValueError):   # (ENOMEM, EMFILE; ValueError: the mapping could not be made)
            self._give_back([f], self._generation, False)
            return None
        return Received(self, f, pad, view)

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
            self._reap()
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
                if not keep:
                    f.close()
                elif f.answer_map is not None and not f.answer_dropped():
                    self._held.append(f)   # the caller's arrays are views of it: the pool's again once they go
                    if len(self._held) > HELD_MAX:   # (the oldest one's arrays keep their mapping, not the pool)
                        self._held.pop(0).close()
                else:
                    self._to_idle(f, now)

    def _to_idle(self, f: _File, now: float) -> None:
        """(Under the lock.) `f` among the idle files, as far as IDLE_MAX_BYTES allows; else closed."""
        if self.idle_bytes + f.written <= IDLE_MAX_BYTES:
            f.idle_since = now
            self._idle.setdefault(f.size, []).append(f)
        else:
            f.close()

    def _reap(self) -> None:
        """(Under the lock.) The held files whose answers' arrays are all gone, back among the idle ones."""
        if not self._held:
            return
        now, still_held = self._clock(), []
        for f in self._held:
            if f.answer_dropped():
                self._to_idle(f, now)
            else:
                still_held.append(f)
        self._held = still_held

    def output_bytes(self, model: str) -> int:
        """How many bytes of large outputs to lend a file for, with `model`'s next request (0: none known yet)."""
        hint = self._output_bytes.get(model)
        return hint[0] if hint else 0

    def note_output_bytes(self, model: str, nbytes: int) -> None:
        """`model`'s answer took `nbytes` in large outputs. The file lent next is sized for the largest answer since
        the last HINT_SHRINK_AFTER smaller ones in a row: batches of changing sizes do not send every other large
        answer inline, and a model whose answers shrank for good lends smaller files again. An answer with no large
        output changes nothing."""
        if not nbytes:
            return
        hints = self._output_bytes
        hint, smaller = hints.pop(model, (0, 0))
        if nbytes >= hint:
            hint, smaller = nbytes, 0
        else:
            smaller += 1
            if smaller >= HINT_SHRINK_AFTER:
                hint, smaller = nbytes, 0
        hints[model] = (hint, smaller)
        if len(hints) > HINTS_MAX:   # (the model least recently answered goes)
            del hints[next(iter(hints))]

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
            for f in self._held:
                f.close()
            self._held.clear()

    def _after_fork(self) -> None:
        """In a forked child: the idle files are the parent's too (it writes into them for its own requests), and
        those out with requests were taken by the parent's other threads, which the child does not have: this
        process's copies of them all (descriptors and mappings) are closed."""
        self._lock = _thread.allocate_lock()
        for f in [f for files in self._idle.values() for f in files] + list(self._out) + self._held:
            f.close()
        self._idle.clear()
        self._out.clear()
        self._held.clear()
        self._generation += 1


class Received:
    """A request body received into a memory file of `pool` (InputBuffers.receive): `view` is where it goes, bytes
    `start`.. of the file. Its owner (the connection that received it) calls `release()` once the request is
    answered; a request that passed it to the daemon and was not answered (Passing.settle_after) marks it not to be
    reused, as a file of its own would be."""
    __slots__ = ("pool", "file", "start", "view", "reusable", "_generation")

    def __init__(self, pool: InputBuffers, file: _File, start: int, view: memoryview):
        self.pool, self.file, self.start, self.view = pool, file, start, view
        self.reusable = True
        self._generation = pool._generation

    def release(self) -> None:
        """Back into the pool (or closed); the view is the caller's no longer."""
        if self.file is not None:
            self.view = None
            self.pool._give_back([self.file], self._generation, self.reusable)
            self.file = None


class Passing:
    """One request's out-of-message inputs. `encode(feeds)` gives the message's tensors, the large ones written into
    memory files of `pool` (`put` says which of the message's descriptors each is and where in it) or, with no pool
    (ZeroMQ, a daemon older than passed inputs), into shared-memory files; `fds` go with the message; `settle_after`
    removes the shared-memory files and hands the memory files back once the request is over. A tensor that lies in
    a body `adopt`ed is passed where it lies, not copied. `lend(model)` adds a file for the answer's large outputs
    (wire/lent_outputs.py), after the inputs' (the message's last `lent_fds`); `decode(answer)` reads them."""
    __slots__ = ("_pool", "_files", "_passed", "_bodies", "_generation", "_shm_files", "_lent", "_inline_up_to")

    def __init__(self, pool: InputBuffers | None, inline_up_to: int | None = None):
        """inline_up_to: no pool and no file, every tensor in the message, at most this many bytes of them (a tcp://
        daemon: tensors.encode)."""
        self._pool, self._files, self._shm_files, self._lent = pool, [], [], []
        self._inline_up_to = inline_up_to
        self._passed: list[_File] = []       # the message's descriptors, in order: files of its own and adopted ones
        self._bodies: list[Received] = []    # received bodies its tensors may lie in
        self._generation = pool._generation if pool is not None else 0

    def adopt(self, body: Received) -> None:
        """Tensors that lie in `body` pass as slices of its file (its owner keeps it and releases it)."""
        self._bodies.append(body)

    def encode(self, feeds: dict, group_of: str | None, model: str) -> list:
        """tensors.encode's wire list for `feeds` (shared-memory files readable by `group_of`'s group); a failure
        keeps no file."""
        from ..wire import tensors
        try:
            wire, self._shm_files = tensors.encode(feeds, group_of=group_of, model=model,
                                                   passing=self if self._pool is not None else None,
                                                   inline_up_to=self._inline_up_to)
        except BaseException:   # (a memory file that could not be made or written, an input refused after it)
            self.settle(False)
            raise
        return wire

    @property
    def fds(self) -> list[int]:
        return [f.fd for f in self._passed]

    @property
    def lent_fds(self) -> int:
        return len(self._lent)

    def lend(self, model: str) -> None:
        """Lend the daemon a memory file for the answer's large outputs, its pages allocated here for as many bytes
        as `model`'s recent answers took (InputBuffers.note_output_bytes; none before the first: that one comes inline
        and says how many). Nothing when the request passes MAX_PASSED files already, or the pages cannot be had (the
        answer comes inline)."""
        nbytes = self._pool.output_bytes(model) if self._pool is not None else 0
        if not nbytes or len(self._passed) >= MAX_PASSED:
            return
        try:
            f = self._pool._take(nbytes)
        except OSError:
            return
        self._files.append(f)
        try:
            f.allocate(nbytes)
        except OSError:   # (ENOSPC: a full memory limit): inline, as before
            return
        self._passed.append(f)
        self._lent.append(f)

    def decode(self, wire: list, model: str) -> dict:
        """The answer's outputs (tensors.decode), those written into the lent file as read-only arrays over its
        mapping, which keep it from the pool while they live; notes the bytes its large outputs took, the size of
        the file lent with `model`'s next request."""
        from ..wire import tensors
        from ..wire.lent_outputs import BODY_ALIGN
        in_files = [e["name"] for e in wire if isinstance(e, dict) and "lent_at" in e] if self._lent else []
        lent = [(f.map_answer(), None, f.size) for f in self._lent] if in_files else ()
        outputs, _ = tensors.decode(wire, lent=lent)
        if in_files and sum(outputs[n].nbytes for n in in_files) * WASTE_MAX < sum(f.written for f in self._lent):
            # The file is far larger than this answer (sized for a larger recent one): arrays that held it would hold
            # all its pages. Copied out, the file is the pool's again at once.
            for n in in_files:
                outputs[n] = outputs[n].copy()
                outputs[n].flags.writeable = False
        if self._pool is not None:
            large = 0
            for a in outputs.values():
                nbytes = getattr(a, "nbytes", 0)
                if nbytes > tensors.INLINE_MAX_BYTES and a.dtype.kind not in "OUS":
                    large += -(-nbytes // BODY_ALIGN) * BODY_ALIGN
            self._pool.note_output_bytes(model, large)
        return outputs

    def put(self, data: memoryview) -> tuple[int, int] | None:
        """Where `data` (bytes) is for the daemon: (index among `fds`, offset in that file). In an adopted body, where
        it lies; else written into a memory file of this request's at offset 0. None when the request passes
        MAX_PASSED already (the caller sends it inline)."""
        if self._bodies:
            found = self._in_body(data)
            if found is not None:
                return found
        if len(self._passed) >= MAX_PASSED:
            return None
        f = self._pool._take(len(data))
        self._files.append(f)   # (from now: a failed write closes it with the request's others)
        self._passed.append(f)
        f.write(data)
        return len(self._passed) - 1, 0

    def _in_body(self, data: memoryview) -> tuple[int, int] | None:
        import numpy as np
        at = np.frombuffer(data, np.uint8).__array_interface__["data"][0]
        for body in self._bodies:
            f = body.file
            offset = at - f.address
            if body.start <= offset and offset + len(data) <= body.start + len(body.view):
                if f not in self._passed:
                    if len(self._passed) >= MAX_PASSED:
                        return None
                    self._passed.append(f)
                return self._passed.index(f), offset
        return None

    def inode(self, index: int) -> int:
        return self._passed[index].ino

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
        read them) they are closed, and the bodies it passed are not reused either."""
        if not answered:
            for body in self._bodies:
                if body.file in self._passed:
                    body.reusable = False
        self._passed, self._bodies, self._lent = [], [], []
        if self._files:   # (most requests pass none: no lock to take)
            files, self._files = self._files, []
            self._pool._give_back(files, self._generation, answered)


_pools: set = set()   # every open pool, for the fork hook (a pool leaves it at close)


def _in_forked_child() -> None:
    for pool in list(_pools):
        pool._after_fork()


os.register_at_fork(after_in_child=_in_forked_child)
