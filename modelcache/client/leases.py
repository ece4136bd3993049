"""Attach mode's connection to the daemon: open and release leases over the lane, and nothing else.

An attach-mode open in a fresh process should cost what a hand-tuned ORT session costs plus one
round trip (issue #16). Through the full client (connection.py) it cost ~40 ms more: importing
pyzmq, logging and the settings loader, a ZeroMQ context, a hello round trip, a heartbeat thread.
Here the first `open` is the first message: on the lane (a plain Unix socket, modelcache/lane.py),
client id "" asks the daemon to make this connection its client, so the connection is the lease's
liveness: when this process dies or closes it, the kernel closes it and the daemon releases the
leases. No hello, no heartbeat, no ZeroMQ. The breakdown that led here is in benchmarks/coldstart.

What the full client does after a daemon restart, this does too: a watcher thread, started with
the first lease, sleeps in poll() until the daemon's end of the connection goes away, then
reconnects with backoff and re-opens the leases of the sessions still open (their mappings never
stopped working; the new leases keep the daemon's eviction accounting right). A call that the
outage cuts short is sent once more if the daemon is already back.

Used for drop-in sessions when the daemon has a lane (ipc:// addresses); otherwise, or when the
daemon is too old to take an open without a hello, the session falls back to connection.Client.
"""

from __future__ import annotations

import _thread  # not threading, which costs ~1 ms to import: a lock and one daemon thread are all this needs
import itertools
import os
import select
import sys
import time

from .. import protocol as P
from ..address import check_can_connect, client_settings
from ..errors import DaemonUnavailable, ModelCacheError, ProtocolError, RequestTimeout, from_code
from ..lane import LaneClient, lane_path

RECONNECT_BACKOFF_S = (0.05, 2.0)    # the watcher's first retry, and the longest wait between retries
# Linux reports a peer's close as POLLRDHUP; POLLHUP and POLLERR come whatever the mask.
_PEER_GONE = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR


class NoLaneOpen(Exception):
    """The daemon does not take an open without a hello (it predates client/leases.py): use the full client."""


class LeaseClient:
    def __init__(self, address: str, timeout_s: float, name: str = ""):
        self.address = address
        self.timeout_s = timeout_s
        self._path = lane_path(address)
        if self._path is None:
            raise ValueError(f"{address} has no lane (only an ipc:// daemon has one)")
        self._name = name or os.path.basename(sys.argv[0] or "python")
        self._lock = _thread.allocate_lock()
        self._ids = itertools.count(1)
        # Leases by the id open() returned -> [id at the daemon now (None: lost in a restart), name, version,
        # device]: a reconnect re-opens them, and release() maps the first id to the current one.
        self._held: dict[str, list] = {}
        self._lane: LaneClient | None = None
        self._closed = False
        self._watching = False
        self._lane = self._connect()

    def _connect(self) -> LaneClient:
        check_can_connect(self._path, self.address)
        try:
            return LaneClient(self._path)
        except OSError as e:
            raise DaemonUnavailable(f"cannot connect to the modelcache daemon at {self.address}: {e.strerror}") from None

    # -- API (what InferenceSession needs of a client) -------------------------------------
    def open(self, name: str, version: int | None = None, device: str = "cpu") -> P.OpenReply:
        lease = self._call(P.Open(req_id=0, client_id="", name=name, version=version, device=device,
                                  client_name=self._name), (P.OpenReply,))
        self._held[lease.lease_id] = [lease.lease_id, lease.name, lease.version, device]
        if not self._watching:   # started with the first lease: a process that holds none needs no watch
            self._watching = True
            _thread.start_new_thread(self._watch, ())   # dies with the process, as a daemon thread does
        return lease

    def release(self, lease_id: str) -> None:
        self._call(P.Close(req_id=0, client_id="", lease_id=lease_id), (P.Ack,), lease_id)
        self._held.pop(lease_id, None)

    def close(self) -> None:
        """Hang up: the daemon releases every lease of this connection."""
        with self._lock:
            self._closed = True
            self._hang_up()

    # -- one call --------------------------------------------------------------------------
    def _call(self, msg, expect: tuple, lease_id: str | None = None):
        """msg's reply, or its error raised. For a Close, lease_id is the id open() returned: the
        lease may have another since a reconnect, or none (then there is nothing to release)."""
        if self._closed:
            raise DaemonUnavailable("this modelcache connection is closed")
        with self._lock:
            for retry in (False, True):
                try:
                    if self._lane is None:
                        self._reconnect()
                    if lease_id in self._held:
                        msg.lease_id = self._held[lease_id][0]
                        if msg.lease_id is None:   # lost in a restart: the daemon has nothing to release
                            return None
                    reply = self._exchange(msg, expect)
                    break
                except DaemonUnavailable:
                    self._hang_up()
                    if retry:
                        raise
        if reply is None:
            raise RequestTimeout(f"the modelcache daemon at {self.address} did not answer "
                                 f"{msg.KIND.decode()} within {self.timeout_s:g} s")
        if isinstance(reply, P.ErrorReply):
            if reply.code == "lease" and reply.message.startswith("unknown client ''"):
                raise NoLaneOpen(reply.message)
            raise from_code(reply.code, reply.message)
        return reply

    def _exchange(self, msg, expect: tuple):
        """msg's reply on the current connection (under the lock); None at the deadline."""
        msg.req_id = next(self._ids)
        deadline = time.monotonic() + self.timeout_s
        try:
            self._lane.send(*P.encode(msg), deadline)
            while True:
                try:
                    reply = P.decode(self._lane.receive(deadline))
                except TimeoutError:
                    return None     # a late reply is read and skipped by the next call
                if getattr(reply, "req_id", None) != msg.req_id:
                    continue        # a late answer to a request we gave up on
                if not isinstance(reply, (*expect, P.ErrorReply)):
                    raise ProtocolError(f"unexpected message {reply.KIND.decode()!r} in answer to "
                                        f"{msg.KIND.decode()!r}")
                return reply
        except OSError:   # (a send timeout too: part of a frame may be out, the stream is unusable)
            raise DaemonUnavailable(f"lost the connection to the modelcache daemon at {self.address} "
                                    "(it stopped or crashed)") from None

    # -- the daemon going away -------------------------------------------------------------
    def _hang_up(self) -> None:
        if self._lane is not None:
            self._lane.shutdown()   # wakes the watcher's poll, which a bare close() would not
            self._lane.close()
            self._lane = None

    def _reconnect(self) -> None:
        """Under the lock: a new connection, and the held leases again. DaemonUnavailable while the daemon is away."""
        self._lane = self._connect()
        for held in self._held.values():
            if held[0] is None:
                continue
            _, name, version, device = held
            try:
                reply = self._exchange(P.Open(req_id=0, client_id="", name=name, version=version, device=device,
                                              client_name=self._name), (P.OpenReply,))
            except DaemonUnavailable:
                self._hang_up()
                raise
            # Not re-opened: the session keeps running on its mapping; only the daemon's accounting misses it.
            held[0] = reply.lease_id if isinstance(reply, P.OpenReply) else None

    def _watch(self) -> None:
        backoff_s = RECONNECT_BACKOFF_S[0]
        while not self._closed:
            lane = self._lane
            if lane is not None:
                try:
                    watch = select.poll()
                    watch.register(lane.fileno(), _PEER_GONE)
                    watch.poll()          # until the daemon's end closes, or ours (close, a failed call)
                except (OSError, ValueError):
                    pass                  # our end closed under us: the same news
                backoff_s = RECONNECT_BACKOFF_S[0]
            if self._closed:
                return
            # Never wait on a caller: one in a call reconnects by itself.
            if self._lock.acquire(blocking=False):
                try:
                    if not self._closed and (self._lane is None or self._lane is lane):
                        self._hang_up()
                        self._reconnect()
                except ModelCacheError:
                    pass
                finally:
                    self._lock.release()
            if self._lane is None or self._lane is lane:
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, RECONNECT_BACKOFF_S[1])


_shared: dict[str, LeaseClient] = {}
_shared_lock = _thread.allocate_lock()


def shared_lease_client(socket: str | None = None) -> LeaseClient | None:
    """This process's lease client for the daemon at `socket` (default: the settings'), or None where
    the daemon has no lane (a tcp:// address): then the caller uses the full client."""
    address, timeout_s = client_settings(socket)
    path = lane_path(address)
    if path is None or (not os.path.exists(path) and os.path.exists(address[len("ipc://"):])):
        return None   # (a daemon with no lane at all predates lanes; with no socket either, we say so)
    with _shared_lock:
        client = _shared.get(address)
        if client is None or client._closed:
            client = _shared[address] = LeaseClient(address, timeout_s)
        return client
