"""The HTTP/1.1 server under the v2 front (modelcache/http/http1.py), over real loopback sockets.

The server runs on its own event loop in a thread, with a handler that echoes what it got (or sleeps first,
for `/slow`); each test speaks raw HTTP to it, as clients that aiohttp used to cope with do: pipelined,
HTTP/1.0, chunked, `Expect: 100-continue`, malformed, too large, idle, and a stop with a request in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import select
import socket
import threading
import time

import pytest

pytest.importorskip("httptools")   # the [http] extra
from conftest import wait_until  # noqa: E402
from modelcache.client.input_buffers import InputBuffers  # noqa: E402
from modelcache.http.http1 import Response, Server  # noqa: E402

LIMIT = 1000


async def echo(request) -> Response:
    if request.target.startswith(b"/slow"):
        await asyncio.sleep(0.3)
    if request.target.startswith(b"/pieces"):   # a body given as pieces, not joined (a large infer answer)
        return Response(200, [b"head:", memoryview(bytearray(b"x" * 300_000)), b":tail"], "application/octet-stream")
    doc = {"method": request.method, "target": request.target.decode(), "body": bytes(request.body).decode("latin-1"),
           "headers": request.headers, "received": request.received is not None}
    return Response(200, json.dumps(doc).encode(), "application/json", {"X-Echo": "1"})


def error(status: int, message: str) -> Response:
    return Response(status, json.dumps({"error": message}).encode(), "application/json")


class Running:
    """A Server on a loop in a thread; `stop()` runs its stop from that loop."""

    def __init__(self, keepalive_s: float = 75.0, header_timeout_s: float = 60.0, limit: int = LIMIT,
                 receive_into=None):
        self.loop = asyncio.new_event_loop()
        self.server = Server(echo, limit, error, lambda n: error(413, f"too large: {n}"), keepalive_s,
                             header_timeout_s, receive_into)
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.address = self.loop.run_until_complete(self.server.start(host="127.0.0.1", port=0))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self, timeout_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(timeout_s), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address[:2], timeout=5)


@pytest.fixture
def srv():
    s = Running()
    yield s
    s.stop()


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict, bytes]:
    """One response off `sock` (what is left over stays in buf); status 0 if the connection closed first."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, {}, b""
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", 0))
    del buf[:len(head) + 4]
    while len(buf) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    body = bytes(buf[:n])
    del buf[:n]
    return int(lines[0].split()[1]), headers, body


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_and_pipelined_requests_are_answered_in_order(srv):
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(b"".join(b"POST /slow%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (i, i)
                           if i % 2 else b"GET /fast%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(6)))
        for i in range(6):
            status, headers, body = read_response(s, buf)
            doc = json.loads(body)
            assert status == 200 and headers["x-echo"] == "1" and "connection" not in headers
            assert doc["target"] == (f"/slow{i}" if i % 2 else f"/fast{i}") and doc["body"] == (str(i) if i % 2 else "")
        s.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")   # and the connection goes on
        assert json.loads(read_response(s, buf)[2])["target"] == "/again"


def test_connection_close_and_http10_close_after_the_answer(srv):
    for request in (b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"GET /a HTTP/1.0\r\n\r\n"):
        with srv.connect() as s:
            s.sendall(request)
            buf = bytearray()
            status, headers, _ = read_response(s, buf)
            assert status == 200 and headers["connection"] == "close" and closed(s)


def test_chunked_body_is_read_whole_and_bounded(srv):
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        status, _, body = read_response(s, buf)
        assert status == 200 and json.loads(body)["body"] == "abcde"
        s.sendall(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + b"%x\r\n%s\r\n" % (LIMIT, b"a" * LIMIT) + b"1\r\nb\r\n")   # one byte over, never finished
        status, headers, body = read_response(s, buf)
        assert status == 413 and json.loads(body)["error"] == "too large: None" and headers["connection"] == "close"
        assert closed(s)


def test_a_declared_body_over_the_limit_is_refused_before_it_arrives(srv):
    with srv.connect() as s:
        t0 = time.monotonic()
        s.sendall(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 17179869184\r\n\r\nabc")
        status, headers, body = read_response(s, bytearray())
        assert status == 413 and "17179869184" in json.loads(body)["error"] and time.monotonic() - t0 < 1.0
        assert closed(s)


def test_expect_100_continue_is_answered_before_the_body(srv):
    with srv.connect() as s:
        s.sendall(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        buf = bytearray()
        assert read_response(s, buf)[0] == 100
        s.sendall(b"hello")
        status, _, body = read_response(s, buf)
        assert status == 200 and json.loads(body)["body"] == "hello"


def test_malformed_request_is_400_and_closes_then_others_go_on(srv):
    with srv.connect() as s:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
        buf = bytearray()
        assert read_response(s, buf)[0] == 200                  # the good request before it is answered
        status, headers, body = read_response(s, buf)
        assert status == 400 and "not valid HTTP/1.1" in json.loads(body)["error"] and closed(s)
    with srv.connect() as s:
        s.sendall(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s, bytearray())[0] == 200


def test_upgrade_is_answered_in_http11_and_closes(srv):
    with srv.connect() as s:
        s.sendall(b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                  b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        status, headers, body = read_response(s, bytearray())
        assert status == 200 and json.loads(body)["target"] == "/u" and headers["connection"] == "close"
        assert closed(s)


def test_head_keeps_the_length_and_drops_the_body(srv):
    with srv.connect() as s:
        s.sendall(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            data += s.recv(65536)
        first, _, rest = data.partition(b"\r\n\r\n")
        assert int(dict(line.split(b": ", 1) for line in first.split(b"\r\n")[1:])[b"Content-Length"]) > 0
        assert rest.startswith(b"HTTP/1.1 200")                 # no body after HEAD's head: the next answer
        assert b'"target": "/after"' in rest


def test_idle_connection_closes_after_keepalive():
    s = Running(keepalive_s=0.3)
    try:
        with s.connect() as c:
            c.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(c, bytearray())[0] == 200
            t0 = time.monotonic()
            assert closed(c) and 0.2 < time.monotonic() - t0 < 3
        wait_until(lambda: not s.server.connections, 5, what="the server forgetting the closed connection")
    finally:
        s.stop()


def test_stop_answers_the_request_in_flight_and_closes_idle_connections():
    s = Running()
    idle, busy = s.connect(), s.connect()
    try:
        busy.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        status, headers, body = read_response(busy, bytearray())
        assert status == 200 and json.loads(body)["target"] == "/slow" and headers["connection"] == "close"
        assert closed(busy) and closed(idle)
        stopper.join(10)
        with pytest.raises(OSError):
            s.connect()                                          # no longer listening
    finally:
        idle.close()
        busy.close()


def test_a_pipelined_flood_is_answered_whole_and_in_order(srv):
    """Far more requests than PIPELINE_MAX in one write: reading pauses and resumes, nothing is lost."""
    n = 200
    with srv.connect() as s:
        s.sendall(b"".join(b"GET /p%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n)))
        buf = bytearray()
        targets = [json.loads(read_response(s, buf)[2])["target"] for _ in range(n)]
    assert targets == [f"/p{i}" for i in range(n)]


def test_router_resolves_decodes_and_says_which_methods():
    from modelcache.http.routes import HttpError, Router
    r = Router()

    async def get(request): ...

    async def post(request): ...

    r.add("GET", "/v2/models/stats", get)
    r.add("GET", "/v2/models/{name}", get)
    r.add("POST", "/v2/models/{name}/infer", post)
    assert r.resolve("GET", "/v2/models/stats") == (get, {})
    assert r.resolve("HEAD", "/v2/models/a%20b") == (get, {"name": "a b"})
    assert r.resolve("POST", "/v2/models/m/infer") == (post, {"name": "m"})
    with pytest.raises(HttpError) as e:
        r.resolve("GET", "/v2/models/m/infer")
    assert e.value.status == 405 and e.value.headers == {"Allow": "POST"}
    with pytest.raises(HttpError) as e:
        r.resolve("GET", "/v2/models/m/nothing")
    assert e.value.status == 404


VALID = [b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
         b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
         b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
         b"GET /a HTTP/1.0\r\n\r\n"]


def test_any_bytes_get_an_answer_or_a_close_and_the_server_goes_on():
    """Hypothesis: valid requests, cut, spliced and with bytes changed or added, on one connection each. The
    server answers or closes within the timeout, never hangs up half an answer, and serves the next client."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    pieces = st.one_of(st.sampled_from(VALID), st.binary(max_size=64),
                       st.sampled_from([b"\r\n", b"Content-Length: 99999999999\r\n", b"Content-Length: -1\r\n",
                                        b"Transfer-Encoding: chunked\r\n", b"Expect: 100-continue\r\n",
                                        b"Connection: Upgrade\r\nUpgrade: h2c\r\n", b"\x00\xff", b"zz\r\n"]))
    s = Running()
    try:
        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(pieces, min_size=1, max_size=6))
        def one(parts):
            with s.connect() as c:
                c.sendall(b"".join(parts))
                c.shutdown(socket.SHUT_WR)   # no more is coming: the server answers what it has, then closes
                c.settimeout(3)
                buf = bytearray()
                while True:
                    status, headers, body = read_response(c, buf)
                    if status == 0:
                        assert not buf, bytes(buf[:200])   # no half answer
                        break
                    assert 100 <= status < 600 and len(body) == int(headers.get("content-length", 0))
        one()
        with s.connect() as c:
            c.sendall(VALID[0])
            assert read_response(c, bytearray())[0] == 200
    finally:
        s.stop()


def test_a_half_closed_connection_gets_its_answers(srv):
    """A client that shuts its sending side after its requests (nc -N, some scripts) still reads the answers."""
    with srv.connect() as s:
        s.sendall(VALID[0] + VALID[1] + b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        buf = bytearray()
        assert [read_response(s, buf)[0] for _ in range(3)] == [200, 200, 200]
        assert closed(s)


def test_a_client_that_stops_halfway_through_a_request_is_closed():
    s = Running(keepalive_s=0.3)
    try:
        with s.connect() as c:
            c.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")   # 7 bytes never come
            t0 = time.monotonic()
            assert closed(c) and 0.2 < time.monotonic() - t0 < 3
    finally:
        s.stop()


def test_headers_trickled_past_their_deadline_get_408_and_a_close_a_slow_body_does_not():
    """Slowloris: a byte now and then resets the keep-alive rule, so a request's headers have their own
    deadline from its first byte. Only the headers: a body may come as slowly as keep-alive allows, and a
    connection idle between requests is not a request."""
    s = Running(header_timeout_s=0.4)
    try:
        with s.connect() as c:
            t0 = time.monotonic()
            c.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
            status = None
            for i in range(40):                       # a header line every 0.1 s, never the blank line
                time.sleep(0.1)
                try:
                    c.sendall(b"X-Trickle-%d: 1\r\n" % i)
                except OSError:                       # closed under us: the answer is in the socket
                    break
                if select.select([c], [], [], 0)[0]:
                    break
            status, _, body = read_response(c, bytearray())
            assert status == 408 and b"did not arrive within 0.4 s" in body, (status, body)
            assert closed(c) and 0.35 < time.monotonic() - t0 < 3
        with s.connect() as c:
            buf = bytearray()
            c.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
            time.sleep(0.8)                           # past the header deadline, within keep-alive
            c.sendall(b"def")
            assert read_response(c, buf)[0] == 200
            time.sleep(0.8)                           # idle between requests: not a request's headers
            c.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(c, buf)[0] == 200
    finally:
        s.stop()


class Places:
    """receive_into over a real pool of memory files (client/input_buffers.py) for targets under /into."""

    def __init__(self):
        self.pool = InputBuffers()
        self.given = 0

    def __call__(self, method: str, target: bytes, headers: dict, length: int):
        if not target.startswith(b"/into"):
            return None
        self.given += 1
        return self.pool.receive(length)

    @property
    def out(self) -> int:
        """Places given and not yet given back."""
        return len(self.pool._out)


def post(target: bytes, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (target, len(body), body)


def letters(n: int, seed: int) -> bytes:
    return bytes(random.Random(seed).choices(b"abcdefghijklmnopqrstuvwxyz", k=n))


def test_a_body_is_received_into_its_place_in_pieces_and_pipelined_and_the_place_goes_back():
    """A body the server is given a place for is read into it past llhttp: sent in pieces, pipelined with others
    after it, or whole with its headers; each request is answered with its own bytes, in order, the connection
    goes on, and every place is back in its pool once answered."""
    places = Places()
    srv = Running(limit=1 << 22, receive_into=places)
    try:
        with srv.connect() as s:
            buf = bytearray()
            big = letters(600_000, 1)
            request = post(b"/into/a", big)
            for piece in (request[:60], request[60:200], request[200:300_000], request[300_000:]):
                s.sendall(piece)
                time.sleep(0.05)
            doc = json.loads(read_response(s, buf)[2])
            assert doc["received"] and doc["body"] == big.decode()
            second, small = letters(300_000, 2), letters(10, 3)
            s.sendall(post(b"/into/b", second) + post(b"/plain", small) + post(b"/into/c", small)
                      + b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
            answers = [json.loads(read_response(s, buf)[2]) for _ in range(4)]
            assert [(a["target"], a["received"], a["body"]) for a in answers] == [
                ("/into/b", True, second.decode()), ("/plain", False, small.decode()),
                ("/into/c", True, small.decode()), ("/again", False, "")]
        assert places.given == 3
        wait_until(lambda: places.out == 0, 5, "every place given back")
    finally:
        srv.stop()
        places.pool.close()


def test_a_connection_lost_halfway_through_a_received_body_gives_its_place_back():
    places = Places()
    srv = Running(limit=1 << 22, receive_into=places)
    try:
        with srv.connect() as s:
            s.sendall(post(b"/into/a", letters(500_000, 4))[:250_000])
            wait_until(lambda: places.given == 1, 5, "a place given")
            assert places.out == 1
        wait_until(lambda: places.out == 0, 5, "the place given back")
        with srv.connect() as s:   # and the server goes on
            s.sendall(post(b"/into/b", b"xyz"))
            assert json.loads(read_response(s, bytearray())[2])["body"] == "xyz"
    finally:
        srv.stop()
        places.pool.close()


def test_a_body_in_pieces_is_sent_whole_with_its_length_and_head_drops_it(srv):
    with srv.connect() as s:
        buf = bytearray()
        s.sendall(b"GET /pieces HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(s, buf)
        assert status == 200 and body == b"head:" + b"x" * 300_000 + b":tail" and not buf
        s.sendall(b"HEAD /pieces HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b'"/after"' not in data:
            data += s.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert b"Content-Length: 300010" in head and rest.startswith(b"HTTP/1.1 200")   # no body after HEAD's head
