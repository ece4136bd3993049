"""HTTP/1.1 on asyncio, parsed by llhttp (httptools): connections, keep-alive, bodies and their limit.

Why not aiohttp, which this front ran on before: a bare aiohttp server costs 296-363 µs of CPU a tiny
request here, the same server on httptools 159-188 (benchmarks/grpc/floor), and a request the front runs
itself (oip/front_runs.py) is otherwise mostly that cost. What aiohttp did for us is here, and nothing else:

- requests on a connection are answered in the order they came (pipelining), one at a time; a connection
  that queues more than PIPELINE_MAX stops being read until its answers catch up;
- keep-alive as the request says (HTTP/1.0 and `Connection: close` close after the answer); a connection
  closes once nothing came or went for KEEPALIVE_S (aiohttp's keepalive_timeout), between requests or
  halfway through one;
- a request's headers must all arrive within HEADER_TIMEOUT_S of its first byte (nginx's and Node's
  client_header_timeout/headersTimeout), else 408 and the connection closes: a client that trickles a byte
  every few seconds (slowloris) is not kept forever by the keep-alive rule, which any byte resets;
- a body is read whole before its handler runs, and refused with 413 the moment it is declared, or (chunked)
  grows, over `max_body`: a client that declared 16 GiB is not waited for;
- a body of a declared length for which `receive_into` gives a place (the v2 front: a large infer body, into a
  memory file its tensors pass to the daemon in, client/input_buffers.Received) is read from the socket straight
  into it (asyncio's BufferedProtocol: recv_into), not collected in llhttp's chunks and joined: one copy of its
  bytes where there were three before it reached the daemon (benchmarks/inputs, `--fronts`);
- `Expect: 100-continue` is answered, so a client that waits for it (curl, for bodies over 1 KiB) goes on;
- a request that does not parse gets 400 and the connection closes; an `Upgrade` request is answered in
  HTTP/1.1 and the connection closes (there is nothing to upgrade to);
- at a stop, listening ends, idle connections close, and requests in flight are answered first.

The handler is `async handler(Request) -> Response` and must not raise: the routes turn every failure into
an answer (routes.py).
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
from typing import Awaitable, Callable

import httptools

log = logging.getLogger("modelcache.http")

READ_BYTES = 256 << 10    # one read's most, into the server's buffer (asyncio's own for a plain Protocol)
KEEPALIVE_S = 75.0        # a connection with nothing in or out this long closes (aiohttp's keepalive_timeout)
HEADER_TIMEOUT_S = 60.0   # a request's headers arrive whole this long after its first byte, or 408 (nginx, Node)
PIPELINE_MAX = 16         # requests queued on one connection before it stops being read
REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


class Request:
    """One request, its body read. `target` is the raw request target (path and query, percent-encoded);
    header names are lower case, repeated headers joined with ", "; `params` are the route's captures.
    `received`: where the body was received (`Server.receive_into`'s place, whose `view` `body` is), or None
    (`body` is bytes); it is released once the request is answered."""

    __slots__ = ("method", "target", "headers", "body", "params", "received")

    def __init__(self, method: str, target: bytes, headers: dict, body, received=None):
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.params: dict = {}
        self.received = received


class Response:
    """`body`: bytes, or a list of bytes-like pieces written one after the other (a large body, not joined)."""
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int = 200, body: bytes | list = b"", content_type: str | None = None,
                 headers: dict | None = None):
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


Handler = Callable[[Request], Awaitable[Response]]
# (method, target, headers, declared length) -> a place for the body (its `view`, writable, of that length; its
# `release()`, called once the request is answered or its connection lost), or None to collect it as any other.
ReceiveInto = Callable[[str, bytes, dict, int], object]


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a connection that was answered and is closing."""


def encode(response: Response, keep_alive: bool, head_only: bool = False) -> bytes | list:
    """The response's bytes (a list of pieces for a body given as one); HEAD's answer keeps GET's Content-Length and
    drops the body."""
    pieces = response.body if isinstance(response.body, list) else None
    size = sum(map(len, pieces)) if pieces is not None else len(response.body)
    lines = [b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\n"
             % (response.status, REASONS.get(response.status, b"Unknown"), size)]
    if response.content_type:
        lines.append(b"Content-Type: %s\r\n" % response.content_type.encode("latin-1"))
    if response.headers:
        lines.extend(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items())
    if not keep_alive:
        lines.append(b"Connection: close\r\n")
    lines.append(b"\r\n")
    if head_only:
        return b"".join(lines)
    if pieces is not None:
        return [b"".join(lines), *pieces]
    lines.append(response.body)
    return b"".join(lines)


class Connection(asyncio.BufferedProtocol):
    """One client connection: llhttp's callbacks collect each request (or its headers, the body then read into the
    place `receive_into` gave); one task answers them in order."""

    def __init__(self, server: "Server"):
        self.server = server
        self.loop = None
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        # (request, keep_alive, answer): parsed, not yet answered; `answer` is set for a refusal (request None)
        self.queue: collections.deque = collections.deque()
        self.answering: asyncio.Task | None = None
        self.in_message = False          # between a request's first byte and its end
        self.closing = False             # answer what is queued, then close
        self.reading = True
        self.writable: asyncio.Future | None = None   # set while the transport's buffer is over its mark
        self.idle_timer = None           # one per connection, re-armed only when it fires (none per request)
        self.idle_since = 0.0            # when the last bytes came in or the last answer went out
        self.message_since = 0.0         # when the request being read began (its first bytes came)
        self.in_headers = False          # between a request's first byte and the end of its headers
        self._url = b""
        self._headers: dict = {}
        self._body: list = []
        self._size = 0
        self._sink = None                # where the body being read goes, past llhttp (receive_into's place)
        self._sink_got = 0               # ... bytes of it read
        self._sink_answer = ("", False)  # ... its request's method, and whether the connection is kept after it

    # --- asyncio's callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self.loop = asyncio.get_running_loop()
        self.idle_since = self.loop.time()
        self.idle_timer = self.loop.call_later(self.server.check_every_s, self._idle_check)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.closing = True
        if self._sink is not None:   # (a body cut short)
            self._sink.release()
            self._sink = None
        for request, _, _ in self.queue:
            if request is not None and request.received is not None:
                request.received.release()
        self.queue.clear()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def eof_received(self) -> bool:
        """The client sent all it will (a half close): answer what came, then close."""
        self.in_message = self.in_headers = False   # a request cut short has nothing to answer it with
        self.close_after_answers()
        return True   # the transport stays open for the answers

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def get_buffer(self, sizehint: int):
        if self._sink is not None:
            return self._sink.view[self._sink_got:]
        return self.server.read_view   # (each read is parsed before the next: one buffer serves every connection)

    def buffer_updated(self, nbytes: int) -> None:
        if self._sink is None:
            self._parse(self.server.read_view[:nbytes])   # (llhttp's callbacks copy what they keep)
            return
        self.idle_since = self.loop.time()
        self._sink_got += nbytes
        if self._sink_got == len(self._sink.view):
            self._body_received()

    def _parse(self, data: memoryview) -> None:
        if self.closing:
            return   # answered and closing (a refused body, an upgrade, a parse error): the rest is not read
        self.idle_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.close_after_answers()   # the request before the upgrade is answered, in HTTP/1.1
        except httptools.HttpParserCallbackError as e:
            if not isinstance(e.__context__, _Refused):   # a fault of ours: said, and this connection only ends
                log.error("internal error parsing a request", exc_info=e.__context__)
                self._fail(self.server.error(500, f"internal error: {type(e.__context__).__name__}"))
        except httptools.HttpParserError as e:
            self._fail(self.server.error(400, f"the request is not valid HTTP/1.1: {e}"))

    # --- llhttp's callbacks, in the order it parses

    def on_message_begin(self) -> None:
        self.in_message = self.in_headers = True
        self.message_since = self.idle_since   # (set as the bytes that begin it came in: _parse)
        self._url, self._headers, self._body, self._size = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[key] = self._headers[key] + ", " + text if key in self._headers else text

    def on_headers_complete(self) -> None:
        self.in_headers = False
        declared = self._headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > self.server.max_body:
            self._refuse(int(declared))
        if self._headers.get("expect", "").lower() == "100-continue" and self.parser.get_http_version() == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if (declared is not None and declared.isascii() and declared.isdigit() and int(declared)
                and self.server.receive_into is not None and "transfer-encoding" not in self._headers):
            method = self.parser.get_method().decode("latin-1")
            self._sink = self.server.receive_into(method, self._url, self._headers, int(declared))
            if self._sink is not None:
                self._sink_got = 0
                self._sink_answer = (method, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:   # (what came in the read that ended the headers)
            self._sink.view[self._sink_got:self._sink_got + len(body)] = body
            self._sink_got += len(body)
            return
        self._size += len(body)
        if self._size > self.server.max_body:
            self._refuse(None)   # chunked: no length was declared
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._sink is not None:   # (the whole body came with its headers)
            self._body_received(parsed=True)
            return
        self.in_message = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self.parser.get_method().decode("latin-1"), self._url, self._headers, body)
        self._queue(request, self.parser.should_keep_alive())

    def _body_received(self, parsed: bool = False) -> None:
        """The body read into its place is whole: its request is queued. Unless llhttp `parsed` it all (it came with
        the headers), llhttp still waits for it: the next request gets a parser of its own."""
        sink, self._sink = self._sink, None
        self.in_message = False
        if not parsed:
            self.parser = httptools.HttpRequestParser(self)
        method, keep_alive = self._sink_answer
        self._queue(Request(method, self._url, self._headers, sink.view, sink), keep_alive)

    def _queue(self, request: Request, keep_alive: bool) -> None:
        self.queue.append((request, keep_alive, None))
        if self.answering is None:
            self.answering = self.loop.create_task(self._answer_queued())
        elif len(self.queue) >= PIPELINE_MAX and self.reading:
            self.reading = False
            self.transport.pause_reading()

    # --- answering

    async def _answer_queued(self) -> None:
        try:
            while self.queue:
                request, keep_alive, response = self.queue.popleft()
                try:
                    if response is None:
                        response = await self.server.handler(request)
                    if self.transport.is_closing():
                        return
                    keep_alive = keep_alive and not (self.closing and not self.queue)
                    data = encode(response, keep_alive, request is not None and request.method == "HEAD")
                    for piece in (data if isinstance(data, list) else (data,)):
                        self.transport.write(piece)   # (what the socket does not take now, the transport copies)
                finally:   # (the answer is bytes of its own by now)
                    if request is not None and request.received is not None:
                        request.received.release()
                if not keep_alive:
                    self.closing = True
                    self.transport.close()
                    return
                if not self.reading and len(self.queue) < PIPELINE_MAX // 2:
                    self.reading = True
                    self.transport.resume_reading()
                if self.writable is not None:
                    await self.writable   # a slow reader: hold the next answer until the buffer drains
        finally:
            self.answering = None
        if self.closing and not self.transport.is_closing():
            self.transport.close()   # a stop or an upgrade came while these were answered
        self.idle_since = self.loop.time()

    def _refuse(self, declared: int | None) -> None:
        """A body over the limit: 413 at once (after what is queued), then close unread."""
        self._fail(self.server.too_large(declared))
        raise _Refused()

    def _fail(self, response: Response) -> None:
        """Answer `response` in turn, after the requests queued before it, then close; read nothing more."""
        self.in_message = self.in_headers = False
        self.closing = True
        if self.answering is None:
            self.transport.write(encode(response, keep_alive=False))
            self.transport.close()
        else:
            self.queue.append((None, False, response))

    def _idle_check(self) -> None:
        """Every check_every_s at most: 408 to a request whose headers are not all in header_timeout_s after its
        first byte; close the connection once nothing came or went for keepalive_s (idle between requests, or
        a client that stopped sending halfway through one); else look again when either could be due."""
        now = self.loop.time()
        if self.in_headers and now - self.message_since >= self.server.header_timeout_s:
            self.idle_timer = None
            self._fail(self.server.error(408, f"the request's headers did not arrive within "
                                              f"{self.server.header_timeout_s:g} s of its first byte"))
            return
        left = self.server.keepalive_s
        if self.answering is None:
            left = self.idle_since + self.server.keepalive_s - now
        if left > 0:
            self.idle_timer = self.loop.call_later(min(left, self.server.check_every_s), self._idle_check)
        else:
            self.idle_timer = None
            self.transport.close()

    def close_after_answers(self) -> None:
        """Close now if idle, else once what was asked is answered (a stop, an upgrade, a half close)."""
        self.closing = True
        if self.answering is None and not self.in_message:
            self.transport.close()


class Server:
    """Connections of one listening socket, and what a stop waits for."""

    def __init__(self, handler: Handler, max_body: int, error: Callable[[int, str], Response],
                 too_large: Callable[[int | None], Response], keepalive_s: float = KEEPALIVE_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S, receive_into: ReceiveInto | None = None):
        self.handler = handler
        self.receive_into = receive_into
        self.read_view = memoryview(bytearray(READ_BYTES))
        self.max_body = max_body
        self.error = error
        self.too_large = too_large
        self.keepalive_s = keepalive_s
        self.header_timeout_s = header_timeout_s
        # A connection's one timer looks this often at most, so slow headers are cut 1-1.5x header_timeout_s
        # after their first byte, with no timer armed or cancelled per request.
        self.check_every_s = min(keepalive_s, header_timeout_s / 2)
        self.connections: set[Connection] = set()
        self.listener: asyncio.Server | None = None

    async def start(self, sock=None, host: str | None = None, port: int | None = None) -> tuple:
        """Listen on `sock` (already bound and listening) or on host:port; the bound address."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            self.listener = await loop.create_server(lambda: Connection(self), sock=sock)
        else:
            self.listener = await loop.create_server(lambda: Connection(self), host, port, reuse_address=True)
        return self.listener.sockets[0].getsockname()

    async def stop(self, timeout_s: float) -> None:
        """Stop listening; answer what is in flight (up to timeout_s), then close every connection."""
        self.listener.close()
        for conn in list(self.connections):
            conn.close_after_answers()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            log.warning("closing a connection whose request did not finish within %.0f s of the stop", timeout_s)
            conn.transport.abort()
        await self.listener.wait_closed()
