"""A protocol front's link to the daemon: one serve-lane connection, many requests in flight.

Every v2 operation (HTTP endpoint, gRPC method) is a daemon message (infer, describe, list, load, evict)
sent over the lane from the front's asyncio loop through the client's request core (client/rpc.py):
replies are matched by request id on the core's reader thread and handed to the loop, so concurrent
requests reach the daemon's engine together and batch there. The connection is the client: an
infer with client id "" makes it one on the daemon's side (no hello, no heartbeat, no ZeroMQ),
and the daemon releases what it held when the connection closes. A lost connection fails the
requests on it (HTTP 503, gRPC UNAVAILABLE) and the next request connects again.
"""

from __future__ import annotations

import asyncio
import threading

from ..client.input_buffers import InputBuffers
from ..client.rpc import Channel, lane_connection
from ..errors import DaemonUnavailable, ModelCacheError, ProtocolError, RequestTimeout, from_code
from ..wire import protocol as P
from ..wire.lane import lane_path

BIG_REQUEST_BYTES = 1 << 20   # a request this big is written from a thread: the daemon may take it slowly


class DaemonLink:
    def __init__(self, address: str, timeout_s: float, front: str = "http"):
        self.address = address
        self.path = lane_path(address)
        self.client_name = f"{front}-front"   # what `modelcache status` calls this connection's client
        if self.path is None:
            raise DaemonUnavailable(f"the {front} front needs the daemon's local serve lane (an ipc:// socket); "
                                    f"{address} has none: run `modelcache {front}` on the daemon's host")
        self.timeout_s = timeout_s
        self._channel = Channel(address, lane_connection(self.path, address), timeout_s, reader_thread=True)
        self.buffers = InputBuffers()   # requests' large inputs, passed as memory files (client/input_buffers.py)
        self._flush_due = False   # a _flush is scheduled for the end of this pass of the loop
        self._inbox: list = []    # (future, reply, error) from the reader thread, waiting for _settle_inbox
        self._inbox_lock = threading.Lock()

    async def call(self, msg, expect: tuple, timeout_s: float | None = None, on_sent=None, fds=()):
        """Send `msg`, wait for its reply; a typed ModelCacheError for an error reply, a lost daemon or a timeout.
        `on_sent()`: called once the message is on its way, before the reply (a stream's order, Operations.infer).
        `fds`: passed with it (an Infer's memory files), in a write of its own.

        A request waits in the channel's outbox for the end of the loop's current pass (call_soon), then leaves with
        every other one queued meanwhile in one write (_flush): requests that came together reach the daemon in
        one turn, where its engine batches them, and cost it one wake-up."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def answered(reply, error):   # on the core's reader thread: replies read together wake the loop once
            with self._inbox_lock:
                self._inbox.append((fut, reply, error))
                if len(self._inbox) > 1:
                    return
            loop.call_soon_threadsafe(self._settle_inbox)

        if getattr(msg, "client_name", None) == "":   # (an Infer's) names this front's client in `status`
            msg.client_name = self.client_name
        inputs = getattr(msg, "inputs", None)
        big = isinstance(inputs, list) and sum(len(t.get("data", b"")) for t in inputs if isinstance(t, dict)) \
            > BIG_REQUEST_BYTES
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if big:
            self._flush()   # (those queued before it go first: a stream's order)
            req_id = await loop.run_in_executor(None, self._channel.submit, msg, answered, timeout_s, fds)
        elif fds:       # a small message (its inputs are in the files), with its descriptors: sent now, after the queued
            self._flush()
            req_id = self._channel.submit(msg, answered, timeout_s, fds)
        else:
            if not self._flush_due:
                self._flush_due = True
                loop.call_soon(self._flush)
            req_id = self._channel.queue(msg, answered)   # (DaemonUnavailable here: no daemon to connect to)
        if on_sent is not None:
            on_sent()
        # call_later rather than asyncio.wait_for: no task per request on the hot path
        timer = loop.call_later(timeout_s, _expire, fut)
        try:
            reply = await fut
        finally:
            timer.cancel()
            self._channel.forget(req_id)
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise ProtocolError(f"unexpected reply {reply.KIND.decode()!r} to {msg.KIND.decode()!r}")
        return reply

    def _settle_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for fut, reply, error in inbox:
            _settle(fut, reply, error)

    def _flush(self) -> None:
        """Send the requests queued in this pass of the loop, in one write. A lost connection has already
        failed them through their callbacks (Channel.flush)."""
        self._flush_due = False
        try:
            self._channel.flush()
        except ModelCacheError:
            pass

    async def close(self) -> None:
        self._channel.close()
        self.buffers.close()


def _settle(fut: asyncio.Future, reply, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(reply)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(RequestTimeout("the modelcache daemon did not answer in time"))
