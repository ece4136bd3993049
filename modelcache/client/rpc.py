"""One request/reply core for the clients of the daemon's lane: ids, reply matching, deadlines, reconnects.

A Channel is one connection at a time to the daemon, shared by every thread of a process: any number
of requests in flight, each reply handed to the caller that sent it, by req_id. Senders are serialised
by a lock held only for the write. Replies are read either by the callers themselves (leader/follower:
the first waiter reads the socket and hands the others their replies, so a lone caller pays no thread
hop over a plain blocking read) or, with reader_thread=True (asyncio, streams: callers that do not
block), by one thread per connection.

When the connection is lost every request on it fails at once with DaemonUnavailable; a request safe
to repeat is sent once more on a new connection. `on_connect(conn)` runs on each new connection before
any other request may use it (a hello, the re-open of held leases), calling `exchange(..., conn=conn)`.
`watch()` starts a thread that notices the daemon's end closing while nothing is in flight, and
reconnects with backoff (so held leases are re-opened without waiting for the next call).

No call hangs: every wait has a deadline. Imports neither pyzmq, threading nor the settings loader:
the lane open path (client/leases.py) costs a fresh process ~40 ms less than the full client.
"""

from __future__ import annotations

import _thread  # not threading (~1 ms to import): locks and daemon threads are all this needs
import itertools
import os
import select
import time

from ..errors import DaemonUnavailable, ProtocolError, RequestTimeout, from_code, ModelCacheError
from ..wire import protocol as P
from ..wire.lane import LaneClient, LaneError, frame
from .input_buffers import Passing

RECONNECT_BACKOFF_S = (0.05, 2.0)    # the watcher's first retry, and the longest wait between retries
READER_WAIT_S = 3600.0               # a reader thread's wait for the next message (it ends with its connection)
# Linux reports a peer's close as POLLRDHUP; POLLHUP and POLLERR come whatever the mask.
_PEER_GONE = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR



def infer_call(send, feeds: dict, group_of: str | None, model: str, buffers=None,
               inline_up_to: int | None = None) -> tuple[dict, dict]:
    """Serve mode's round trip, whichever client makes it (connection.Client, leases.LeaseClient): `feeds` encoded,
    `send(wire, fds, lent_fds)` the Infer and its reply; (name -> output array, timings). Large inputs go in
    `buffers`' memory files, whose descriptors `send` passes with the message (over the lane:
    client/input_buffers.py), else into shared-memory files readable by `group_of`'s group, removed once answered.
    The last `lent_fds` of them are lent for the answer's large outputs (wire/lent_outputs.py). `inline_up_to`: a
    tcp:// daemon, every tensor in the message (tensors.encode)."""
    passing = Passing(buffers if buffers is not None and not buffers.refused else None, inline_up_to)
    wire = passing.encode(feeds, group_of, model)
    passing.lend(model)
    try:
        reply = send(wire, passing.fds, passing.lent_fds)
    except BaseException as e:
        passing.settle_after(e)
        if not (isinstance(e, ProtocolError) and passing.fds):
            raise
        buffers.refused = True   # a daemon older than passed inputs ("no 'shm'"): files, which it reads
        return infer_call(send, feeds, group_of, model)
    try:
        return passing.decode(reply.outputs, model), reply.timings
    finally:
        passing.settle_after(None)


def answer_within_ms(timeout_s: float) -> float:
    """The deadline_ms a request waiting in the daemon (an open, for room) carries: the client's timeout less a
    margin, so that the daemon's answer (CapacityError, saying what held the tier) arrives before the client
    gives up with a bare RequestTimeout."""
    return 1000 * (timeout_s - min(1.0, timeout_s / 10))

class _Waiter:
    """One request in flight: where its reply goes. A blocking caller parks on `lock` (held from birth);
    a callback caller is called from whichever thread reads its reply."""
    __slots__ = ("conn", "reply", "error", "done", "lock", "parked", "signalled", "callback")

    def __init__(self, conn, callback=None):
        self.conn = conn
        self.reply = None
        self.error: BaseException | None = None
        self.done = False
        self.callback = callback
        self.parked = False
        self.signalled = False
        if callback is None:
            self.lock = _thread.allocate_lock()
            self.lock.acquire()


class Channel:
    def __init__(self, address: str, open_connection, timeout_s: float, on_connect=None,
                 reader_thread: bool = False, on_lost=None):
        """open_connection() -> a new connection (a lane.LaneClient, or anything with its send, send_frames,
        receive_all, fileno, shutdown and close), raising DaemonUnavailable when there is no daemon. on_lost(): called
        once per lost connection, after its requests have failed."""
        self.address = address
        self.timeout_s = timeout_s
        self._open_connection = open_connection
        self._on_connect = on_connect
        self._on_lost = on_lost
        self._reader_thread = reader_thread
        self._ids = itertools.count(1)       # next() on a count is atomic under the GIL
        self._state = _thread.allocate_lock()    # guards _conn, _pending, _reading and every waiter's flags
        self._write = _thread.allocate_lock()    # held only while one message is written
        self._connecting = _thread.allocate_lock()
        self._pending: dict[int, _Waiter] = {}
        self._outbox: list = []              # (kind, body) queued for flush(), all for _outbox_conn
        self._outbox_conn = None
        self._conn = None
        self._reading = False                # a caller is reading the socket for everyone
        self._reading_conn = None            # ... this connection: the reader closes it, once lost
        self._closed = False
        self._watching = False

    # -- API ---------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._conn is not None

    def call(self, msg, expect: tuple, timeout_s: float | None = None, retry_safe: bool = False):
        """msg's reply, of a type in `expect`; a typed ModelCacheError for an error reply, a lost daemon
        (DaemonUnavailable) or no answer in time (RequestTimeout)."""
        reply = self.exchange(msg, expect, timeout_s, retry_safe)
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        return reply

    def exchange(self, msg, expect: tuple, timeout_s: float | None = None, retry_safe: bool = False,
                 conn=None, fds=(), prepare=None):
        """msg's reply (an ErrorReply too, for the caller to judge); DaemonUnavailable, RequestTimeout.
        On a lost connection a retry_safe request is sent once more on a new one. conn: send on this
        connection only (on_connect's requests, before the connection is anyone else's). prepare(msg):
        called before each send, after any reconnect (to address the message to the ids of now)."""
        if self._closed:
            raise DaemonUnavailable("this modelcache connection is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        lost = None
        for retry in (False, True):
            try:
                current = conn or self._conn or self.connect()
            except ModelCacheError:
                if lost is not None:   # not back (yet): the caller hears of the loss, which came first
                    raise lost from None
                raise
            if prepare is not None:
                prepare(msg)
            deadline = time.monotonic() + timeout_s
            try:
                reply = self._round_trip(current, msg, expect, deadline, fds)
                break
            except DaemonUnavailable as e:
                if retry or not retry_safe or conn is not None or self._closed:
                    raise
                lost = e
        if reply is None:
            raise RequestTimeout(f"the modelcache daemon at {self.address} did not answer "
                                 f"{msg.KIND.decode()} within {timeout_s:g} s")
        return reply

    def submit(self, msg, callback, deadline_s: float | None = None, fds=()) -> int:
        """Send msg without waiting (`fds` passed with it); callback(reply, error) runs on the reader thread when its
        answer comes or its connection is lost (never for a request forgotten first). Returns the req_id.
        From any thread (queue() and flush() are one thread's)."""
        if not self._reader_thread:
            raise ValueError("submit needs a channel with reader_thread=True")
        conn = self._conn or self.connect()
        waiter = _Waiter(conn, callback)
        msg.req_id = req_id = next(self._ids)
        with self._state:
            self._pending[req_id] = waiter
        self._send(conn, msg, time.monotonic() + (deadline_s or self.timeout_s), fds)
        return req_id

    def queue(self, msg, callback) -> int:
        """submit(), but the message waits in the outbox for flush(): the requests queued meanwhile leave in one
        write, so the daemon reads them in one turn (and batches them) at one wake-up. Returns the req_id.
        queue() and flush() are for one thread (a front's event loop)."""
        if not self._reader_thread:
            raise ValueError("submit needs a channel with reader_thread=True")
        conn = self._conn or self.connect()
        msg.req_id = req_id = next(self._ids)
        encoded = P.encode(msg)   # (first: a message that cannot be encoded leaves nothing behind)
        with self._state:
            self._pending[req_id] = _Waiter(conn, callback)
        if self._outbox_conn is not conn:
            self._outbox, self._outbox_conn = [], conn   # (what was queued on a lost connection failed with it)
        self._outbox.append(encoded)
        return req_id

    def flush(self, deadline_s: float | None = None) -> None:
        """Send what queue() queued, in one write. A lost connection fails every request in flight on it (their
        callbacks are told) and raises DaemonUnavailable."""
        frames, conn, self._outbox, self._outbox_conn = self._outbox, self._outbox_conn, [], None
        if not frames or getattr(conn, "lost", False):
            return
        self._written(conn, conn.send_frames, b"".join(frame(kind, body) for kind, body in frames),
                      time.monotonic() + (deadline_s or self.timeout_s))

    def forget(self, req_id: int) -> None:
        """Give up on a submitted request: a late answer is dropped."""
        with self._state:
            self._pending.pop(req_id, None)

    def connect(self):
        """The current connection, made (and on_connect run) if there is none; DaemonUnavailable if the
        daemon is away."""
        with self._connecting:
            if self._closed:
                raise DaemonUnavailable("this modelcache connection is closed")
            if self._conn is not None:
                return self._conn
            conn = self._open_connection()
            if self._reader_thread:
                _thread.start_new_thread(self._read_forever, (conn,))
            try:
                if self._on_connect is not None:
                    self._on_connect(conn)
            except BaseException:
                self._lost(conn)
                raise
            with self._state:
                self._conn = conn
            return conn

    def drop(self) -> None:
        """Hang up the current connection (its requests fail); the next call connects again."""
        conn = self._conn
        if conn is not None:
            self._lost(conn)

    def watch(self) -> None:
        """From now on, notice the daemon going away while idle and reconnect with backoff."""
        with self._state:
            if self._watching or self._closed:
                return
            self._watching = True
        _thread.start_new_thread(self._watch, ())   # dies with the process, as a daemon thread does

    def close(self) -> None:
        self._closed = True
        self.drop()

    # -- one request ---------------------------------------------------------------------------
    def _send(self, conn, msg, deadline: float, fds=()) -> None:
        kind, body = P.encode(msg)
        self._written(conn, conn.send, kind, body, deadline, fds)

    def _written(self, conn, send, *args) -> None:
        """send(*args) on conn, one writer at a time; a lost connection fails what waits on it."""
        try:
            with self._write:
                send(*args)
        except OSError:    # (a send timeout too: part of a frame may be out, the stream is unusable)
            self._lost(conn)
            raise DaemonUnavailable(f"lost the connection to the modelcache daemon at {self.address} "
                                    "(it stopped, crashed or stalled)") from None

    def _round_trip(self, conn, msg, expect: tuple, deadline: float, fds=()):
        waiter = _Waiter(conn)
        msg.req_id = req_id = next(self._ids)
        with self._state:
            self._pending[req_id] = waiter
        try:
            self._send(conn, msg, deadline, fds)
            self._wait(waiter, deadline)
        finally:
            with self._state:
                self._pending.pop(req_id, None)
        if waiter.error is not None:
            raise waiter.error
        reply = waiter.reply
        if reply is not None and not isinstance(reply, expect) and not isinstance(reply, P.ErrorReply):
            close_received_fds(reply)
            raise ProtocolError(f"unexpected message {reply.KIND.decode()!r} in answer to {msg.KIND.decode()!r}")
        return reply

    def _wait(self, waiter: _Waiter, deadline: float) -> None:
        """Until the waiter is answered or failed, or the deadline: reading for everyone when no one else is."""
        state = self._state
        while True:
            with state:
                if waiter.done:
                    return
                lead = not self._reading and not self._reader_thread
                if lead:
                    self._reading = True
                    self._reading_conn = waiter.conn
                else:
                    waiter.parked = True
            if lead:
                try:
                    self._lead(waiter, deadline)
                finally:
                    self._hand_over()
                return
            remaining_s = deadline - time.monotonic()
            woken = remaining_s > 0 and waiter.lock.acquire(True, remaining_s)
            with state:
                waiter.parked = False
                if not woken and waiter.signalled:   # woken between the timeout and here: re-arm the lock
                    waiter.lock.acquire()
                waiter.signalled = False
                if waiter.done:
                    return
            if not woken and time.monotonic() >= deadline:
                self._hand_over(release=False)   # in case the turn to read came to us as we gave up
                return

    def _lead(self, waiter: _Waiter, deadline: float) -> None:
        conn = waiter.conn
        try:
            while not waiter.done and time.monotonic() < deadline:
                try:
                    messages = conn.receive_all(deadline)
                except (OSError, ValueError, LaneError):   # (ValueError: our end closed under us)
                    self._lost(conn)
                    return
                for frames in messages:
                    self._dispatch(conn, frames)
        finally:
            if getattr(conn, "lost", False):
                conn.close()     # here, by its reader: closed under a poll, its number could be reused

    def _hand_over(self, release: bool = True) -> None:
        """The reader stops (release), or a caller gives up: if no one reads, wake one parked caller to."""
        with self._state:
            if release:
                self._reading = False
                self._reading_conn = None
            elif self._reading:
                return
            for w in self._pending.values():
                if w.parked and not w.done and w.callback is None:
                    self._wake(w)
                    break

    def _wake(self, waiter: _Waiter) -> None:
        """(Under _state.)"""
        if waiter.parked and not waiter.signalled:
            waiter.signalled = True
            waiter.lock.release()

    def _dispatch(self, conn, frames) -> None:
        try:
            reply = P.decode(frames)
            n_fds = getattr(reply, "ipc_fds", 0)
            if n_fds:   # (here, in the stream's order: the descriptors came in it, see LaneClient)
                reply.received_fds = conn.take_fds(n_fds)
        except (ProtocolError, LaneError, AttributeError) as e:   # the stream cannot be trusted any further
            self._lost(conn, e if isinstance(e, ProtocolError) else ProtocolError(
                f"the daemon's reply declares file descriptors this connection did not bring: {e}"))
            return
        with self._state:
            waiter = self._pending.get(getattr(reply, "req_id", None))
            if waiter is None or waiter.done or waiter.conn is not conn:
                close_received_fds(reply)
                return            # a late answer to a request given up on
            waiter.reply = reply
            waiter.done = True
            callback = waiter.callback
            if callback is None:
                self._wake(waiter)
            else:
                del self._pending[reply.req_id]
        if callback is not None:
            callback(reply, None)

    def _read_forever(self, conn) -> None:
        while True:
            try:
                messages = conn.receive_all(time.monotonic() + READER_WAIT_S)
            except (OSError, ValueError, LaneError):
                self._lost(conn)
                conn.close()
                return
            for frames in messages:
                self._dispatch(conn, frames)

    def _lost(self, conn, error: BaseException | None = None) -> None:
        """The connection is gone: fail what waits on it; the next call connects again."""
        callbacks = []
        with self._state:
            if self._conn is conn:
                self._conn = None
            first = not getattr(conn, "lost", False)
            conn.lost = True
            # Closed now only if no thread polls it; else by that reader, once it sees the shutdown.
            close_now = not self._reader_thread and self._reading_conn is not conn
            for req_id, w in list(self._pending.items()):
                if w.conn is conn and not w.done:
                    w.error = error or DaemonUnavailable(f"lost the connection to the modelcache daemon at "
                                                         f"{self.address} (it stopped or crashed)")
                    w.done = True
                    if w.callback is None:
                        self._wake(w)
                    else:
                        del self._pending[req_id]
                        callbacks.append(w)
        conn.shutdown()     # wakes a thread that polls it (a close alone does not)
        if close_now:
            conn.close()
        for w in callbacks:
            w.callback(None, w.error)
        if first and self._on_lost is not None:
            self._on_lost()

    def _watch(self) -> None:
        backoff_s = RECONNECT_BACKOFF_S[0]
        while not self._closed:
            conn = self._conn
            if conn is not None:
                try:
                    watch = select.poll()
                    watch.register(conn.fileno(), _PEER_GONE)
                    watch.poll()          # until the daemon's end closes, or ours (close, a failed call)
                except (OSError, ValueError):
                    pass                  # our end closed under us: the same news
                self._lost(conn)
                backoff_s = RECONNECT_BACKOFF_S[0]
            if self._closed:
                return
            try:
                self.connect()
            except ModelCacheError:
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, RECONNECT_BACKOFF_S[1])


def close_received_fds(reply) -> None:
    """Close the descriptors a reply brought (LaneClient.take_fds) and no one took."""
    fds = getattr(reply, "received_fds", None)
    if fds:
        reply.received_fds = []
        for fd in fds:
            os.close(fd)


def lane_connection(path: str, address: str, with_fds: bool = False):
    """open_connection for a Channel over the lane at `path`; with_fds: one whose replies may bring descriptors
    (lease opens: see LaneClient)."""
    from ..address import check_can_connect

    def open_connection() -> LaneClient:
        check_can_connect(path, address)
        try:
            return LaneClient(path, with_fds)
        except OSError as e:
            raise DaemonUnavailable(f"cannot connect to the modelcache daemon at {address}: {e.strerror}") from None
    return open_connection
