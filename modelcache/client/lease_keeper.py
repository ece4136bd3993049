"""The leases one client holds, kept across a daemon restart: both client stacks keep them here (the full
client over ZeroMQ, connection.py, and the drop-in session's lane client, leases.py).

A lease is known to its caller by the id its open returned. After a restart the daemon knows none of
them: the client re-opens each on its new connection (`reopen`), and from then on a close names the
new id (`address_close`, called as the Close is sent, so a Close sent again after a reconnect names
the id of then). A lease the daemon would not give back is lost: the session keeps running on its
mapping, only the daemon's accounting misses it, and releasing it sends nothing.
"""

from __future__ import annotations

from ..wire import protocol as P
from .rpc import close_received_fds


class LeaseKeeper:
    def __init__(self):
        # id open() returned -> [id at the daemon now (None: lost in a restart), name, version, device]
        self._held: dict[str, list] = {}

    def opened(self, lease: P.OpenReply, device: str) -> None:
        self._held[lease.lease_id] = [lease.lease_id, lease.name, lease.version, device]

    def address_close(self, msg) -> None:
        """A Close about to be sent names the lease's id at the daemon now (a `prepare` of rpc.Channel)."""
        if isinstance(msg, P.Close) and msg.lease_id in self._held:
            msg.lease_id = self._held[msg.lease_id][0] or msg.lease_id

    def release(self, lease_id: str, send_close) -> None:
        """Let go of a lease: send_close() sends its Close (see address_close), unless a restart lost it."""
        held = self._held.get(lease_id)
        if held is None or held[0] is not None:   # (an id this client never opened: the daemon says so)
            send_close()
        self._held.pop(lease_id, None)

    def reopen(self, send_open) -> tuple[int, list[str]]:
        """On a new connection, before any other call uses it: send_open(name, version, device) -> its reply,
        for each lease not lost. Returns how many were re-opened, and why each other one was not."""
        relet, failed = 0, []
        for held in self._held.values():
            if held[0] is None:
                continue
            _, name, version, device = held
            reply = send_open(name, version, device)
            close_received_fds(reply)   # the session runs on what it mapped; this lease is for the accounting
            if isinstance(reply, P.OpenReply):
                held[0] = reply.lease_id
                relet += 1
            else:
                held[0] = None
                failed.append(f"{name}: {getattr(reply, 'message', reply)}")
        return relet, failed
