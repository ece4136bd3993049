"""The HTTP front's link to the daemon: one serve-lane connection, many requests in flight.

Every v2 endpoint is a daemon message (infer, describe, list, load, evict) sent over the lane
(modelcache/lane.py framing) from the front's asyncio loop, with replies matched by request id,
so concurrent HTTP requests reach the daemon's engine together and batch there. The connection
is the client: an infer with client id "" makes it one on the daemon's side (no hello, no
heartbeat, no ZeroMQ), and the daemon releases what it held when the connection closes. A lost
connection fails the requests on it (503) and the next request connects again.
"""

from __future__ import annotations

import asyncio
import itertools

from .. import protocol as P
from ..errors import DaemonUnavailable, ProtocolError, RequestTimeout, from_code
from ..lane import HEADER, frame, lane_path


class DaemonLink:
    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.path = lane_path(address)
        if self.path is None:
            raise DaemonUnavailable(f"the HTTP front needs the daemon's local serve lane (an ipc:// socket); "
                                    f"{address} has none: run `modelcache http` on the daemon's host")
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()

    async def call(self, msg, expect: tuple, timeout_s: float | None = None):
        """Send `msg`, wait for its reply; a typed ModelCacheError for an error reply, a lost daemon or a timeout."""
        writer = self._writer if self._writer is not None else await self._connect()
        msg.req_id = req_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = self._pending[req_id] = loop.create_future()
        # call_later rather than asyncio.wait_for: no task per request on the hot path
        timer = loop.call_later(self.timeout_s if timeout_s is None else timeout_s, _expire, fut)
        try:
            kind, body = P.encode(msg)
            writer.write(frame(kind, body))
            if writer.transport.get_write_buffer_size() > 1 << 20:   # a big request: let the socket drain
                await writer.drain()
            reply = await fut
        except (ConnectionError, OSError):
            self._lost()
            raise DaemonUnavailable(f"lost the serve lane to the modelcache daemon at {self.address}") from None
        finally:
            timer.cancel()
            self._pending.pop(req_id, None)
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise ProtocolError(f"unexpected reply {reply.KIND.decode()!r} to {msg.KIND.decode()!r}")
        return reply

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is None:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path)
                except OSError as e:
                    raise DaemonUnavailable(f"no modelcache daemon answers at {self.address} ({e.strerror})") \
                        from None
                self._writer = writer
                self._reader_task = asyncio.get_running_loop().create_task(self._read_replies(reader, writer))
            return self._writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                kind_len, body_len = HEADER.unpack(await reader.readexactly(HEADER.size))
                data = await reader.readexactly(kind_len + body_len)
                reply = P.decode([data[:kind_len], data[kind_len:]])
                fut = self._pending.get(getattr(reply, "req_id", None))
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                # else: the answer to a request that timed out here
        except (asyncio.IncompleteReadError, OSError, ProtocolError):
            pass
        finally:
            if self._writer is writer:
                self._lost()

    def _lost(self) -> None:
        """The connection is gone: fail what waits on it; the next call connects again."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DaemonUnavailable(f"lost the connection to the modelcache daemon at "
                                                    f"{self.address} (it stopped or crashed)"))

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except BaseException:
                pass


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(RequestTimeout("the modelcache daemon did not answer in time"))
