"""A drop-in session's connection to the daemon, over the lane alone: attach mode's leases (open, release) and
serve mode's calls (describe, infer), and nothing else.

An attach-mode open in a fresh process should cost what a hand-tuned ORT session costs plus one
round trip (issue #16). Through the full client (connection.py) it cost ~40 ms more: importing
pyzmq, logging and the settings loader, a ZeroMQ context, a hello round trip, a heartbeat thread.
Here the first `open` is the first message: on the lane (a plain Unix socket, modelcache/wire/lane.py),
client id "" asks the daemon to make this connection its client, so the connection is the lease's
liveness: when this process dies or closes it, the kernel closes it and the daemon releases the
leases. No hello, no heartbeat, no ZeroMQ. The breakdown that led here is in benchmarks/coldstart.

What the full client does after a daemon restart, this does too, through the request core
(client/rpc.py, which imports no more than this does): a watcher thread, started with the first lease, sleeps in poll() until the daemon's end of the connection goes away, then
reconnects with backoff and re-opens the leases of the sessions still open (their mappings never
stopped working; the new leases keep the daemon's eviction accounting right). A call that the
outage cuts short is sent once more if the daemon is already back.

A serve-mode session in a fresh process paid the same: it went through the full client for a describe and its
infers, and importing pyzmq alone was 15-30 ms of its 44 ms session (benchmarks/coldstart). Its calls take the
same road now; its first infer makes the connection its client, as an open does.

Used for drop-in sessions when the daemon has a lane (ipc:// addresses); otherwise, or when the
daemon is too old to take an open or an infer without a hello, the session falls back to connection.Client.
"""

from __future__ import annotations

import _thread  # not threading, which costs ~1 ms to import
import atexit
import os
import sys

from ..address import client_settings
from ..errors import from_code
from ..wire import protocol as P
from ..wire.lane import lane_path
from .input_buffers import InputBuffers
from .lease_keeper import LeaseKeeper
from .rpc import Channel, answer_within_ms, infer_call, lane_connection

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
        self._leases = LeaseKeeper()      # re-opened on a reconnect; a close names the id of now
        self._buffers = InputBuffers()    # serve calls' large inputs
        self._channel = self._new_channel()
        self._channel.connect()
        _live.add(self)

    def _new_channel(self) -> Channel:
        # with_fds: a GPU lease under read-only sharing brings its allocations as descriptors (client/device.py).
        return Channel(self.address, lane_connection(self._path, self.address, with_fds=True), self.timeout_s,
                       on_connect=self._reopen_leases)

    def _after_fork(self) -> None:
        """In a forked child: the connection is the parent's (its replies, its leases; one read here would take a
        reply the parent waits for). This process's calls go on a connection of its own, made at its first call;
        the parent's is left as it is, never read, never shut down."""
        self._channel = self._new_channel()
        self._leases = LeaseKeeper()
        atexit.register(_leave_at_exit, self, os.getpid())

    @property
    def _closed(self) -> bool:
        return self._channel._closed

    # -- API (what InferenceSession needs of a client) -------------------------------------
    def open(self, name: str, version: int | None = None, device: str = "cpu") -> P.OpenReply:
        # descriptors: the lease's files come with the reply, so a client in another container maps them too.
        lease = self._call(P.Open(req_id=0, client_id="", name=name, version=version, device=device,
                                  client_name=self._name, deadline_ms=answer_within_ms(self.timeout_s),
                                  descriptors=True),
                           (P.OpenReply,))
        self._leases.opened(lease, device)
        self._channel.watch()   # from the first lease: a process that holds none needs no watch
        return lease

    def describe(self, name: str, version: int | None = None) -> P.DescribeReply:
        """A model's inputs, outputs and stages (connection.Client.describe's)."""
        return self._call(P.Describe(req_id=0, name=name, version=version), (P.DescribeReply,))

    def infer(self, name: str, feeds: dict, output_names: list | None = None, version: int | None = None,
              deadline_ms: float | None = None, priority: int | None = None) -> tuple[dict, dict]:
        """Serve mode (connection.Client.infer's): the daemon runs the model; (name -> output array, timings)."""
        # Large inputs in memory files passed with the request (client/input_buffers.py); to a daemon older than
        # that, in shared-memory files whose group is the daemon socket's (tensors.encode).
        return infer_call(lambda wire, fds, lent_fds: self._call(
            P.Infer(req_id=0, client_id="", name=name, inputs=wire, version=version, output_names=output_names,
                    deadline_ms=deadline_ms, priority=priority, client_name=self._name, ipc_fds=len(fds),
                    lent_fds=lent_fds),
            (P.InferReply,), fds), feeds, self.address[len("ipc://"):], name, self._buffers)

    def release(self, lease_id: str) -> None:
        self._leases.release(lease_id, lambda: self._call(P.Close(req_id=0, client_id="", lease_id=lease_id),
                                                          (P.Ack,)))

    def close(self) -> None:
        """Say goodbye and hang up: the daemon releases every lease of this connection, and counts this client as
        gone, not lost (a connection that closes without a goodbye is a process that died: `clients_lost`)."""
        conn = self._channel._conn
        if conn is not None and not self._channel._closed:
            try:   # (on this connection only: never a reconnect to say it)
                self._channel.exchange(P.Goodbye(req_id=0, client_id=""), (P.Ack,), min(self.timeout_s, 1.0),
                                       conn=conn)
            except Exception:   # (a daemon gone or stuck: the close it sees is the goodbye)
                pass
        self._channel.close()
        self._buffers.close()
        _live.discard(self)

    # -- one call --------------------------------------------------------------------------
    def _call(self, msg, expect: tuple, fds=()):
        """msg's reply, or its error raised; sent once more on a new connection if the daemon went away
        (a Close then names the lease's id on that connection). fds: passed with it (each time it is sent)."""
        reply = self._channel.exchange(msg, expect, retry_safe=True, prepare=self._leases.address_close, fds=fds)
        if isinstance(reply, P.ErrorReply):
            if reply.code == "lease" and reply.message.startswith("unknown client ''"):
                raise NoLaneOpen(reply.message)
            raise from_code(reply.code, reply.message)
        return reply

    def _reopen_leases(self, conn) -> None:
        """On a new connection, before any other call uses it: the held leases again."""
        # One not re-opened: the session keeps running on its mapping; only the daemon's accounting misses it.
        self._leases.reopen(lambda name, version, device: self._channel.exchange(
            P.Open(req_id=0, client_id="", name=name, version=version, device=device, client_name=self._name),
            (P.OpenReply,), conn=conn))


_shared: dict[str, LeaseClient] = {}
_shared_lock = _thread.allocate_lock()
_live: set = set()    # every open LeaseClient of this process (a fork gives each a connection of the child's own)


def _in_forked_child() -> None:
    global _shared_lock
    _shared_lock = _thread.allocate_lock()   # (another thread may have held it at the fork)
    _shared.clear()                          # the child's next session gets a client of its own
    for client in list(_live):               # and sessions it inherited, a connection of their own
        client._after_fork()


os.register_at_fork(after_in_child=_in_forked_child)


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
            atexit.register(_leave_at_exit, client, os.getpid())
        return client


def _leave_at_exit(client: LeaseClient, pid: int) -> None:
    """A process that exits says goodbye (connection.py's _leave_at_exit does the same): the daemon counts it as
    gone, not lost. Not from a forked child, whose copy of the connection is its parent's."""
    if os.getpid() == pid and not client._closed:
        client.close()
