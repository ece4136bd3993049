"""Many serve-mode requests in flight on one connection: send without waiting, collect answers as they come.

`Client.infer` waits for each answer, which is what an application wants but not what an
open-loop load generator needs (it must send on schedule however late the answers are), nor
a test that wants requests queued at once. An InferStream has its own connection (the serve
lane when its client uses one, else a ZeroMQ DEALER socket) and borrows the identity of a
connected `Client`, whose heartbeats keep it alive.

On the lane the stream is a request core (client/rpc.py) with a reader thread: answers are
matched by the core's ids and handed back under the caller's; a lost connection fails the
requests on it, and the next send connects again.
"""

from __future__ import annotations

import collections
import threading
import time

import zmq

from ..errors import DaemonUnavailable, from_code
from ..wire import lane as _lane
from ..wire import protocol as P
from .rpc import Channel, lane_connection

SEND_TIMEOUT_S = 60.0   # a daemon that takes no bytes for this long is stalled


class InferStream:
    def __init__(self, client):
        self.client_id = client.client_id
        self.address = client.address
        self._channel = None
        self._sock = None
        if client.uses_lane:
            self._answers: collections.deque = collections.deque()
            self._arrived = threading.Condition()
            self._lost = False
            self._channel = Channel(client.address, lane_connection(_lane.lane_path(client.address), client.address),
                                    SEND_TIMEOUT_S, reader_thread=True, on_lost=self._connection_lost)
            self._channel.connect()
        else:
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(client.address)

    def send(self, req_id: int, name: str, wire: list, version: int | None = None,
             deadline_ms: float | None = None, output_names: list | None = None) -> None:
        """Queue one request; `wire` is `tensors.encode(feeds)[0]` (encode once, send many times)."""
        msg = P.Infer(req_id=req_id, client_id=self.client_id, name=name, inputs=wire,
                      version=version, output_names=output_names, deadline_ms=deadline_ms)
        if self._sock is not None:
            self._sock.send_multipart(P.encode(msg))
            return
        self._channel.submit(msg, lambda reply, error: self._answer(req_id, reply, error))

    def _answer(self, req_id: int, reply, error) -> None:
        """(On the core's reader thread.)"""
        if error is not None:
            answer = (req_id, None, {}, error)
        elif isinstance(reply, P.ErrorReply):
            answer = (req_id, None, {}, from_code(reply.code, reply.message))
        elif isinstance(reply, P.InferReply):
            answer = (req_id, reply.outputs, reply.timings, None)
        else:
            answer = (req_id, None, {}, DaemonUnavailable(f"unexpected message {reply.KIND.decode()!r}"))
        with self._arrived:
            self._answers.append(answer)
            self._arrived.notify()

    def _connection_lost(self) -> None:
        with self._arrived:
            self._lost = True
            self._arrived.notify()

    def receive(self, timeout_ms: int) -> list[tuple]:
        """Answers that arrived within timeout_ms (all that are waiting, at least one if any comes):
        (req_id, wire outputs or None, timings, error or None) each. DaemonUnavailable once when the
        connection was lost with nothing left to answer."""
        if self._sock is not None:
            return self._receive_zmq(timeout_ms)
        deadline = time.monotonic() + timeout_ms / 1e3
        with self._arrived:
            while not self._answers and not self._lost:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return []
                self._arrived.wait(remaining_s)
            if not self._answers:
                self._lost = False
                raise DaemonUnavailable(f"lost the serve lane to the modelcache daemon at {self.address} "
                                        "(it stopped or crashed)")
            out = list(self._answers)
            self._answers.clear()
            return out

    def _receive_zmq(self, timeout_ms: int) -> list[tuple]:
        out = []
        if not self._sock.poll(timeout_ms):
            return out
        while self._sock.poll(0):
            reply = P.decode(self._sock.recv_multipart(), expect=(P.InferReply, P.ErrorReply))
            if isinstance(reply, P.ErrorReply):
                out.append((reply.req_id, None, {}, from_code(reply.code, reply.message)))
            else:
                out.append((reply.req_id, reply.outputs, reply.timings, None))
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._channel is not None:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
