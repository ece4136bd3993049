"""The daemon's end of the serve lane (see modelcache/wire/lane.py): a listening Unix socket and
its connections, driven by the owner loop's poller. Nothing here blocks.

A connection stands in for a ZeroMQ routing id: handlers get it as `ident` and replies go
back through `send`; like identity.Peer it carries the client's kernel uid, gid and pid.
A message may bring file descriptors (SCM_RIGHTS): `add` passes the model's files so the daemon
never opens a client-named path, and a serve request the memory files of its large inputs
(`Infer.ipc_fds`, client/input_buffers.py). They are held in arrival order until the message
that declares them is handled, which takes them (`take_fds`). A reply may carry descriptors the other way (a GPU
lease under gpu_sharing = "vmm-read-only": the allocations' exported fds): they leave with the
reply's first byte, also when the reply waits behind others (then the connection holds
duplicates of them until they are sent or it drops). A reply to a connection that has gone is dropped,
as ROUTER drops one to a vanished peer; a client that stops reading is cut off once MAX_PENDING bytes wait.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from pathlib import Path

import zmq

from ..errors import ModelCacheError
from ..storage import remove_tree
from ..wire.lane import HEADER, MAX_BODY, MAX_FDS, FrameReader, LaneError, recv_chunk_with_fds, send_fds
from .identity import socket_credentials

log = logging.getLogger("modelcache.daemon")

READ_CHUNK = 1 << 20            # one read buffer, shared by every connection (the owner loop reads)
MAX_READ_PER_TURN = 16 << 20     # one busy client cannot hold the loop
MAX_PENDING = 256 << 20          # unread replies a client may leave before it is cut off
COALESCE_BYTES = 64 << 10        # a reply up to this size waits for flush_replies, to leave with its batch's others
# Descriptors held for messages not yet handled, over all connections: one open file sent 253 times
# is 253 of our descriptors, so many connections that never finish a message could exhaust them.
MAX_HELD_FDS = 1024
# ints, not pyzmq's enums: `int & IntFlag` runs Python code in the enum module, per event
_IN, _OUT, _IN_OUT = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.POLLIN | zmq.POLLOUT)


def check_socket_file(path: Path) -> None:
    """Refuse to start over a file at a socket path that is not a socket: a stale socket of ours may
    be replaced, anything else is someone's file (a wrong socket setting once deleted it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ModelCacheError(f"{path} exists and is not a socket: it is left alone, and the daemon does not start; "
                              "move it away or set another socket path")


class LaneConnection:
    carries_fds = True   # a reply may pass file descriptors (SCM_RIGHTS): see identity.Peer's, which may not

    __slots__ = ("sock", "fd", "reader", "out", "out_fds", "server", "polling_out", "uid", "gid", "pid", "fds",
                 "client_id", "queued")

    def __init__(self, sock: socket.socket, server: "LaneServer"):
        self.sock, self.fd, self.server = sock, sock.fileno(), server
        self.reader = FrameReader(server.max_body)
        self.out = bytearray()
        # Descriptors of replies waiting in `out`: [position in out of the reply's first byte, our duplicates].
        self.out_fds: list[list] = []
        self.polling_out = False  # registered for POLLOUT: replies wait for room in the socket
        self.queued = False       # in server.to_flush: replies wait for the end of the turn
        self.uid, self.gid, self.pid = socket_credentials(sock)
        # Descriptors received and not yet taken, oldest first. They come with the first byte of the message that
        # declares them (an Add's files, an Infer's memory files: `ipc_fds`), so every descriptor of one message
        # comes before any of the next one's, and a message is whole only once its own have come.
        self.fds: list = []
        self.client_id = ""         # the client this connection is, once it opened a lease with no hello

    def take_fds(self, n: int | None = None) -> list | None:
        """The oldest `n` descriptors received (None: all of them, an Add's, the first message of its connection);
        the caller now owns them, and closes them. None, and the connection dropped, where fewer came: a message
        declared descriptors its sender did not pass, and the stream cannot be trusted any further."""
        if n is None:
            n = len(self.fds)
        elif n > len(self.fds):
            self.server.drop(self, f"a message declares {n} file descriptors and {len(self.fds)} came with it")
            return None
        fds, self.fds = self.fds[:n], self.fds[n:]
        self.server.held_fds -= len(fds)
        return fds

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.server.held_fds -= len(self.fds)
        self.fds = []

    @staticmethod
    def _close_out_fds(entry: list) -> None:
        for fd in entry[1]:
            os.close(fd)

    def send(self, kind: bytes, body: bytes, fds=()) -> None:
        """Queue a reply; `fds` (still the caller's: passed as copies) go with its first byte. A small reply
        waits for LaneServer.flush_replies (after each batch the engine answers, and at the end of the loop's
        turn), so the answers of one batch leave in one write a connection, and wake its reader once; a big
        one goes now, uncopied."""
        if self.sock is None:
            return  # the client went away; its answer has nowhere to go
        if not self.out and not fds and len(body) > COALESCE_BYTES:
            head = HEADER.pack(len(kind), len(body)) + kind   # (sent beside the body: not joined to it, a copy)
            try:
                sent = self.sock.sendmsg([head, body])
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self.server.drop(self, f"write failed: {e}")
                return
            if sent == len(head) + len(body):
                return
            if sent < len(head):
                self.out += head[sent:]
                sent = len(head)
            self.out += memoryview(body)[sent - len(head):]
            self.flush()
            return
        if fds:
            self.out_fds.append([len(self.out), [os.dup(fd) for fd in fds]])   # ours until sent: see the docstring
        self.out += HEADER.pack(len(kind), len(body))
        self.out += kind
        self.out += body
        if not self.queued:
            self.queued = True
            self.server.to_flush.append(self)

    def flush(self) -> None:
        try:
            while self.out:
                at = self.out_fds[0][0] if self.out_fds else len(self.out)
                if at == 0:    # a reply with descriptors comes next: they leave with its first byte
                    end = self.out_fds[1][0] if len(self.out_fds) > 1 else len(self.out)
                    sent = send_fds(self.sock, memoryview(self.out)[:end], self.out_fds[0][1], 0)
                    self._close_out_fds(self.out_fds.pop(0))
                else:
                    end = at
                    sent = self.sock.send(memoryview(self.out)[:end])
                del self.out[:sent]
                for entry in self.out_fds:
                    entry[0] -= sent
                if sent < end:
                    break
        except BlockingIOError:
            pass
        except OSError as e:
            self.server.drop(self, f"write failed: {e}")
            return
        if len(self.out) > MAX_PENDING:
            self.server.drop(self, f"{len(self.out) >> 20} MiB of replies unread")
        elif bool(self.out) != self.polling_out:
            self.polling_out = bool(self.out)
            self.server.poller.modify(self.fd, _IN_OUT if self.out else _IN)


class LaneServer:
    def __init__(self, path: str, counters: dict, max_body: int = MAX_BODY):
        self.path = path
        self.counters = counters         # the daemon's: a broken stream counts as a bad message
        self.max_body = max_body         # a request's longest body (as MAXMSGSIZE): a longer one ends the connection
        self.listener: socket.socket | None = None
        self.poller: zmq.Poller | None = None
        self.conns: dict[int, LaneConnection] = {}
        self.held_fds = 0                # passed descriptors not yet taken by a handler (see MAX_HELD_FDS)
        self.scratch = memoryview(bytearray(READ_CHUNK))
        self.budget = None               # daemon/fds.py FdBudget: accept only while it has room
        self.accepting = False
        self.on_close = None             # called with each connection that went away (its client leaves with it)
        self.to_flush: list[LaneConnection] = []   # connections with replies queued this turn

    def set_accepting(self, on: bool) -> None:
        """Listen or not: a listener left in the poller with no descriptor to accept into wakes it forever."""
        if on == self.accepting or self.listener is None:
            return
        self.accepting = on
        if on:
            self.poller.register(self.listener.fileno(), _IN)
        else:
            self.poller.unregister(self.listener.fileno())

    def start(self, poller: zmq.Poller) -> None:
        """Listen (the main socket's checks already ruled out a live daemon, so a socket here is stale)."""
        check_socket_file(Path(self.path))
        Path(self.path).unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o660)  # as the main socket: the daemon's group may connect
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.poller = poller
        self.set_accepting(True)

    def flush_replies(self) -> None:
        """The end of the owner loop's turn: write what each connection was answered in it."""
        conns, self.to_flush = self.to_flush, []
        for conn in conns:
            conn.queued = False
            if conn.sock is not None:
                conn.flush()

    def on_ready(self, fd: int, events: int, handle) -> None:
        """The poller says `fd` is ready; complete messages go to handle([connection, kind, body])."""
        if self.listener is not None and fd == self.listener.fileno():
            self._accept()
            return
        conn = self.conns.get(fd)
        if conn is None:
            return
        if events & _OUT:
            conn.flush()
        if events & _IN and conn.sock is not None:
            self._read(conn, handle)

    def _accept(self) -> None:
        while True:
            if self.budget is not None and self.budget.check():
                self.set_accepting(False)   # the daemon's sweep listens again once descriptors are free
                return
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # the connection waits in the backlog; the client falls back to ZeroMQ
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    if self.budget is not None:
                        self.budget.paused = True
                    self.set_accepting(False)
                    log.warning("lane: out of file descriptors: not accepting until some are free")
                else:
                    log.warning("lane: accept failed: %s", e)
                return
            sock.setblocking(False)
            conn = LaneConnection(sock, self)
            self.conns[conn.fd] = conn
            self.poller.register(conn.fd, _IN)

    def _read(self, conn: LaneConnection, handle) -> None:
        got = 0
        while got < MAX_READ_PER_TURN:
            try:
                # Every read takes descriptors (~2 us more than recv_into): any message may bring some.
                data, fds = recv_chunk_with_fds(conn.sock, self.scratch)
                if fds:
                    conn.fds += fds
                    self.held_fds += len(fds)
                    if len(conn.fds) > MAX_FDS or self.held_fds > MAX_HELD_FDS:
                        # The connection holding the most goes (past the shared bound, not whoever came last: one
                        # client hoarding descriptors must not cost the others their large-input requests).
                        hog = conn if len(conn.fds) > MAX_FDS else max(self.conns.values(), key=lambda c: len(c.fds))
                        self.drop(hog, f"{len(hog.fds)} file descriptors passed and not taken, {self.held_fds} held "
                                       f"in all (at most {MAX_FDS} on a connection, {MAX_HELD_FDS} together)")
                        if hog is conn:
                            return
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.drop(conn, f"read failed: {e}")
                return
            except LaneError as e:
                self.counters["bad_messages"] += 1
                self.drop(conn, str(e))
                return
            if not data:
                self.drop(conn, None)
                return
            conn.reader.feed(data)
            got += len(data)
            if len(data) < READ_CHUNK:
                break  # drained, most likely; if not, the poller says so again (and no EAGAIN to raise)
        while conn.sock is not None:
            try:
                message = conn.reader.next()
            except LaneError as e:  # a stream cannot resync: this connection is done
                self.counters["bad_messages"] += 1
                self.drop(conn, str(e))
                return
            if message is None:
                return
            handle([conn, *message])

    def drop(self, conn: LaneConnection, why: str | None) -> None:
        if conn.sock is None:
            return
        if why:
            log.warning("lane: dropped a client connection: %s", why)
        self.conns.pop(conn.fd, None)
        conn.close_fds()
        try:
            self.poller.unregister(conn.fd)
        except KeyError:
            pass
        conn.sock.close()
        conn.sock = None
        conn.out = bytearray()
        for entry in conn.out_fds:   # replies never sent: the duplicates of their descriptors go
            conn._close_out_fds(entry)
        conn.out_fds = []
        if self.on_close is not None:   # (a client or not: a process killed before its first request had none)
            self.on_close(conn)

    def stop(self) -> None:
        """Hand over what is still queued (briefly: a client that does not read loses it), then close.
        The clients of the connections stay on the books: the daemon is stopping, not they leaving."""
        self.on_close = None
        for conn in list(self.conns.values()):
            if conn.out:
                try:
                    conn.sock.settimeout(1.0)
                    conn.sock.sendall(conn.out)
                except OSError:
                    pass
            self.drop(conn, None)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        error = remove_tree(self.path)   # (tried twice; what stays, the server's stop tries again)
        if error is not None:
            log.warning("could not remove the lane's socket %s: %s", self.path, error)
