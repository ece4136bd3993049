"""Many serve-mode requests in flight on one connection: send without waiting, collect answers as they come.

`Client.infer` waits for each answer, which is what an application wants but not what an
open-loop load generator needs (it must send on schedule however late the answers are), nor
a test that wants requests queued at once. An InferStream has its own connection (the serve
lane when its client uses one, else a ZeroMQ DEALER socket) and borrows the identity of a
connected `Client`, whose heartbeats keep it alive.
"""

from __future__ import annotations

import time

import zmq

from .. import lane as _lane
from .. import protocol as P
from ..errors import DaemonUnavailable, from_code

SEND_TIMEOUT_S = 60.0   # a daemon that takes no bytes for this long is stalled


class InferStream:
    def __init__(self, client):
        self.client_id = client.client_id
        self.address = client.address
        self._lane = _lane.connect(client.address) if client.uses_lane else None
        self._sock = None
        if self._lane is None:
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(client.address)

    def send(self, req_id: int, name: str, wire: list, version: int | None = None,
             deadline_ms: float | None = None, output_names: list | None = None) -> None:
        """Queue one request; `wire` is `tensors.encode(feeds)[0]` (encode once, send many times)."""
        frames = P.encode(P.Infer(req_id=req_id, client_id=self.client_id, name=name, inputs=wire,
                                  version=version, output_names=output_names, deadline_ms=deadline_ms))
        if self._sock is not None:
            self._sock.send_multipart(frames)
            return
        try:
            self._lane.send(*frames, time.monotonic() + SEND_TIMEOUT_S)
        except OSError:   # (a send timeout too)
            raise DaemonUnavailable(f"lost the serve lane to the modelcache daemon at {self.address}") from None

    def receive(self, timeout_ms: int) -> list[tuple]:
        """Answers that arrived within timeout_ms (all that are waiting, at least one if any comes):
        (req_id, wire outputs or None, timings, error or None) each."""
        out = []
        for frames in self._receive_frames(timeout_ms):
            reply = P.decode(frames, expect=(P.InferReply, P.ErrorReply))
            if isinstance(reply, P.ErrorReply):
                out.append((reply.req_id, None, {}, from_code(reply.code, reply.message)))
            else:
                out.append((reply.req_id, reply.outputs, reply.timings, None))
        return out

    def _receive_frames(self, timeout_ms: int) -> list:
        if self._sock is None:
            try:
                return self._lane.receive_all(time.monotonic() + timeout_ms / 1e3)
            except OSError:
                raise DaemonUnavailable(f"lost the serve lane to the modelcache daemon at {self.address} "
                                        "(it stopped or crashed)") from None
        if not self._sock.poll(timeout_ms):
            return []
        frames = []
        while self._sock.poll(0):
            frames.append(self._sock.recv_multipart())
        return frames

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._lane is not None:
            self._lane.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
