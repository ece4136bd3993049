"""The serve lane: the daemon's messages over a plain Unix stream socket, for serve-mode calls.

ZeroMQ carries every message through an I/O thread on each end, so a round trip wakes
four more threads than a plain socket does. On this project's 2-core VM a bare round trip
measured 68-127 us against 30-60 us for this socket, by how long the peer slept
(`modelcache bench transport`, benchmarks/transport). So a daemon listening on
ipc://PATH also listens on PATH.lane, and a client sends `infer` there (an InferStream
too, on a connection of its own); everything else (hello, heartbeats, open, admin) stays
on ZeroMQ, and a client falls back to ZeroMQ when there is no lane (a tcp:// daemon, or
one that predates it).

A message is the same two parts as on ZeroMQ (kind, msgpack body), framed:
    u8 kind length | u32 body length (little-endian) | kind | body
"""

from __future__ import annotations

import _socket as socket  # not `socket`: it builds its IntEnums at import, ~4 ms of a client's cold start
import mmap
import os
import select
import struct
import time

HEADER = struct.Struct("<BI")
MAX_BODY = 1 << 30            # a bigger length is a broken stream, not a message
SUFFIX = ".lane"
CLIENT_READ_BYTES = 256 << 10  # a client's read buffer: one read takes any inline-sized reply
MAX_FDS = 253                  # descriptors one message may pass (the kernel's SCM_MAX_FD): a model and its data files
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
_CMSG_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)   # descriptors we receive do not leak into our children


class LaneError(Exception):
    """The byte stream is not lane frames: the connection cannot be trusted any further."""


def lane_path(address: str) -> str | None:
    """Where the lane of the daemon at `address` listens; None unless it is an ipc:// address."""
    return address[len("ipc://"):] + SUFFIX if address.startswith("ipc://") else None


def frame(kind: bytes, body: bytes) -> bytes:
    return HEADER.pack(len(kind), len(body)) + kind + body


def recv_chunk(sock: socket.socket, scratch: memoryview) -> bytes:
    """What the socket has now, up to len(scratch) bytes; b"" at the end of the stream.

    Not sock.recv(n): that allocates n bytes per call, and above glibc's mmap threshold
    (128 KiB) each allocation is an mmap and a munmap. Per 12 KB message that cost 33 us
    against 6 us for this (`modelcache bench transport`, "reads"), on each end of every
    request. Reading into a reused buffer costs one copy of what came."""
    n = sock.recv_into(scratch)
    return bytes(scratch[:n])


def recv_chunk_with_fds(sock: socket.socket, scratch: memoryview, flags: int = 0) -> tuple[bytes, list[int]]:
    """recv_chunk, and the file descriptors (SCM_RIGHTS) that came with those bytes; now the caller's.
    recvmsg costs ~2 us more than recv_into: a client reads this way only where replies bring descriptors."""
    n, ancdata, flags, _ = sock.recvmsg_into([scratch], _FDS_SPACE, flags)
    fds = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(data) // 4}i", data[:len(data) - len(data) % 4])
    if flags & socket.MSG_CTRUNC:   # the kernel closed the descriptors that did not fit
        for fd in fds:
            os.close(fd)
        raise LaneError(f"more than {MAX_FDS} file descriptors passed")
    return bytes(scratch[:n]), fds


class FrameReader:
    """Bytes in as they arrive, whole (kind, body) messages out.

    A chunk that holds whole messages (the usual case: one request, one reply) is read
    where it lies; only a message split across chunks is gathered in a bytearray. A frame
    over GATHER_EXACT_BYTES is gathered into one buffer of its exact size and its body handed
    out as a view of it: growing a bytearray and copying the body out of it cost a 50 MB
    request 143 MiB of daemon memory (3x its size) where this costs 1x. The buffer is an
    anonymous mapping, whose pages cost memory only once written: a header alone, promising
    64 MB that never come, costs nothing (a zero-filled bytearray would cost it all)."""

    GATHER_EXACT_BYTES = 1 << 20

    def __init__(self, max_body: int = MAX_BODY):
        self._buf: bytes | bytearray = b""
        self._at = 0                      # where the unread part of _buf starts
        self._max_body = max_body         # a longer frame is refused from its header, before it is gathered
        self._big: mmap.mmap | None = None  # a big frame being gathered (it comes before anything in _buf)
        self._have = 0                    # bytes of it gathered so far

    def feed(self, data: bytes) -> None:
        if self._big is not None and self._have < len(self._big):
            n = min(len(data), len(self._big) - self._have)
            self._big[self._have:self._have + n] = memoryview(data)[:n]
            self._have += n
            data = data[n:]
            if not data:
                return
        if self._at >= len(self._buf):
            self._buf, self._at = data, 0
        else:
            if self._at or not isinstance(self._buf, bytearray):
                self._buf = bytearray(memoryview(self._buf)[self._at:])
                self._at = 0
            self._buf += data
        self._gather_if_big()

    def _gather_if_big(self) -> None:
        """Move a big incomplete frame at the read position into a buffer of its exact size."""
        buf, at = self._buf, self._at
        if self._big is not None or len(buf) - at < HEADER.size:
            return
        kind_len, body_len = HEADER.unpack_from(buf, at)
        size = HEADER.size + kind_len + body_len
        if size <= self.GATHER_EXACT_BYTES or len(buf) - at >= size or kind_len == 0 or body_len > self._max_body:
            return   # small, complete, or refused by next()
        self._big = mmap.mmap(-1, size)
        self._have = len(buf) - at
        self._big[:self._have] = memoryview(buf)[at:]
        self._buf, self._at = b"", 0

    def next(self) -> tuple[bytes, bytes] | None:
        if self._big is not None:
            if self._have < len(self._big):
                return None
            big, self._big = self._big, None
            start = HEADER.size + big[0]
            return bytes(big[HEADER.size:start]), memoryview(big)[start:]
        buf, at = self._buf, self._at
        if len(buf) - at < HEADER.size:
            return None
        kind_len, body_len = HEADER.unpack_from(buf, at)
        if kind_len == 0 or body_len > self._max_body:
            raise LaneError(f"bad frame header (kind {kind_len} bytes, body {body_len} bytes)")
        start = at + HEADER.size + kind_len
        end = start + body_len
        if len(buf) < end:
            self._gather_if_big()
            return None
        with memoryview(buf) as view:
            kind, body = bytes(view[at + HEADER.size:start]), bytes(view[start:end])
        self._at = end
        return kind, body


class LaneClient:
    """A client's end: one request at a time (the caller holds its lock).

    The socket stays blocking, and deadlines are kept with poll(): socket timeouts would
    cost two fcntl calls per send and per receive, on every request.

    with_fds: read with recvmsg and keep the descriptors replies bring (a GPU lease under read-only
    sharing), in the order they came; `take_fds(n)` hands the oldest n to the message that declares
    them. That order is the messages' own: the daemon sends a reply's descriptors with its first byte,
    so every descriptor of an earlier message came before any of a later one's. Only connections that
    open leases want this: recvmsg costs each read ~2 us, which serve calls do not pay."""

    def __init__(self, path: str, with_fds: bool = False):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise
        self._reader = FrameReader()
        self._scratch = memoryview(bytearray(CLIENT_READ_BYTES))
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self.with_fds = with_fds
        self._fds: list[int] = []   # received and not yet taken, oldest first

    def send(self, kind: bytes, body: bytes, deadline: float, fds: list[int] = ()) -> None:
        """TimeoutError or OSError leave the stream unusable: close the lane then.
        fds travel with the message's first byte; the message declares them (an Add's files, an Infer's ipc_fds)."""
        self.send_frames(frame(kind, body), deadline, fds)

    def send_frames(self, data: bytes, deadline: float, fds: list[int] = ()) -> None:
        """Whole frames (`frame()`'s, joined) in one write: several requests cost the daemon one wake-up."""
        try:
            if fds:
                sent = send_fds(self._sock, data, fds)
            else:
                sent = self._sock.send(data, socket.MSG_DONTWAIT)   # all of it, unless the daemon lags
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                self._sock.sendall(memoryview(data)[sent:])
            finally:
                self._sock.settimeout(None)

    def receive(self, deadline: float) -> tuple[bytes, bytes]:
        """The next whole message; TimeoutError at the deadline, ConnectionError when the daemon is gone.
        A partial message read before a timeout stays buffered for the next call."""
        while True:
            message = self._reader.next()
            if message is not None:
                return message
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not self._read(remaining_ms):
                raise TimeoutError

    def receive_all(self, deadline: float) -> list[tuple[bytes, bytes]]:
        """Every whole message there is: waits until the deadline for the first, then takes what else
        has come without waiting. [] at the deadline; ConnectionError when the daemon is gone."""
        try:
            out = [self.receive(deadline)]
        except TimeoutError:
            return []
        while True:
            message = self._reader.next()
            if message is not None:
                out.append(message)
                continue
            try:
                if not self._read(0):
                    return out
            except ConnectionError:
                return out   # a daemon that answered, then stopped, did answer: the next call hears of the end

    def _read(self, timeout_ms: float) -> bool:
        """Feed the reader what the socket has within timeout_ms; False when nothing came."""
        if not self._poll.poll(timeout_ms):
            return False
        if self.with_fds:
            data, fds = recv_chunk_with_fds(self._sock, self._scratch, _CMSG_CLOEXEC)
            self._fds += fds
        else:
            data = recv_chunk(self._sock, self._scratch)
        if not data:
            raise ConnectionError("the daemon closed the lane")
        self._reader.feed(data)
        return True

    def take_fds(self, n: int) -> list[int]:
        """The next n descriptors that came (now the caller's, to close); LaneError if fewer came."""
        if n > len(self._fds):
            raise LaneError(f"a message declares {n} file descriptors and {len(self._fds)} came with it"
                            + ("" if self.with_fds else " (this connection does not take descriptors)"))
        fds, self._fds = self._fds[:n], self._fds[n:]
        return fds

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self) -> None:
        """End the stream both ways: wakes a thread that polls this socket (a close alone does not)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass   # not connected any more: nothing to end

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:   # came with replies no one took (given up on)
            os.close(fd)
        self._sock.close()


def send_fds(sock, data, fds, flags: int = socket.MSG_DONTWAIT) -> int:
    """socket.send_fds, which the plain _socket module lacks: the bytes, with `fds` as SCM_RIGHTS (the kernel
    passes copies; ours stay open). They arrive with the first byte sent: a reader that takes them (a
    LaneClient made with_fds) finds them with the first chunk of the message."""
    import array
    return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], flags)


def connect(address: str) -> LaneClient | None:
    """The lane of the daemon at `address`, or None where it has none (the caller uses ZeroMQ)."""
    path = lane_path(address)
    if path is None or not os.path.exists(path):
        return None
    try:
        return LaneClient(path)
    except OSError:
        return None
