"""Run the v2 front: an HTTP/1.1 server (http1.py, over llhttp) on host:port, one DaemonLink to the daemon's
serve lane. Request bodies are bounded by the daemon's max_message_size, the largest request it takes anyway.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from ..oip.lifecycle import SHUTDOWN_TIMEOUT_S, until_stopped
from ..oip.link import DaemonLink
from ..oip.operations import Operations
from .http1 import Server
from .routes import Endpoints, error, too_large

log = logging.getLogger("modelcache.http")


async def serve(settings, host: str, port: int, on_ready=None, sock=None) -> None:
    """Serve until SIGTERM or SIGINT; `on_ready(url)` once the port accepts connections. `sock`: a listening
    socket to serve on instead of binding host:port (the CLI and the daemon bind it first: see listen_tcp)."""
    max_body = settings.max_message_bytes()
    ops = Operations(DaemonLink(settings.socket, settings.request_timeout_s, front="http"), settings)
    endpoints = Endpoints(ops)
    server = Server(endpoints.handle, max_body, error, functools.partial(too_large, max_body),
                    receive_into=endpoints.receive_into)
    try:
        bound = await server.start(sock, host, port)
        url = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
        log.info("Open Inference Protocol (v2) on %s for the daemon at %s", url, settings.socket)
        if on_ready:
            on_ready(url)
        await until_stopped()
        await server.stop(SHUTDOWN_TIMEOUT_S)   # in-flight requests finish, then connections close
    finally:
        await ops.close()
    log.info("HTTP front stopped")


def run(settings, host: str, port: int, on_ready=None, sock=None) -> None:
    asyncio.run(serve(settings, host, port, on_ready, sock))
