"""Many serve-mode requests in flight on one connection: send without waiting, collect answers as they come.

`Client.infer` waits for each answer, which is what an application wants but not what an
open-loop load generator needs (it must send on schedule however late the answers are), nor
a test that wants requests queued at once. An InferStream has its own DEALER socket and
borrows the identity of a connected `Client` (whose heartbeats keep it alive).
"""

from __future__ import annotations

import zmq

from .. import protocol as P
from ..errors import from_code


class InferStream:
    def __init__(self, client):
        self.client_id = client.client_id
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(client.address)

    def send(self, req_id: int, name: str, wire: list, version: int | None = None,
             deadline_ms: float | None = None, output_names: list | None = None) -> None:
        """Queue one request; `wire` is `tensors.encode(feeds)[0]` (encode once, send many times)."""
        self._sock.send_multipart(P.encode(P.Infer(req_id=req_id, client_id=self.client_id, name=name, inputs=wire,
                                                   version=version, output_names=output_names,
                                                   deadline_ms=deadline_ms)))

    def receive(self, timeout_ms: int) -> list[tuple]:
        """Answers that arrived within timeout_ms (all that are waiting, at least one if any comes):
        (req_id, wire outputs or None, timings, error or None) each."""
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
        self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
