"""Run the v2 front: aiohttp's server on host:port, one DaemonLink to the daemon's serve lane.

aiohttp parses HTTP/1.1 (its C parser, llhttp), keeps connections alive and bounds request
bodies (client_max_size: the daemon's max_message_size, the largest request it takes anyway).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..oip.lifecycle import SHUTDOWN_TIMEOUT_S, until_stopped
from ..oip.link import DaemonLink
from ..oip.operations import Operations
from .routes import MAX_BODY, OPS, add_routes, v2_errors

log = logging.getLogger("modelcache.http")


def build_app(settings) -> web.Application:
    max_body = settings.max_message_bytes()
    app = web.Application(middlewares=[v2_errors], client_max_size=max_body)
    app[MAX_BODY] = max_body
    add_routes(app)

    async def link_ctx(app):
        app[OPS] = Operations(DaemonLink(settings.socket, settings.request_timeout_s, front="http"), settings)
        yield
        await app[OPS].close()

    app.cleanup_ctx.append(link_ctx)
    return app


async def serve(settings, host: str, port: int, on_ready=None, sock=None) -> None:
    """Serve until SIGTERM or SIGINT; `on_ready(url)` once the port accepts connections. `sock`: a listening
    socket to serve on instead of binding host:port (the CLI and the daemon bind it first: see listen_tcp)."""
    runner = web.AppRunner(build_app(settings), access_log=None, handle_signals=False,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0]
    url = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
    log.info("Open Inference Protocol (v2) on %s for the daemon at %s", url, settings.socket)
    if on_ready:
        on_ready(url)
    try:
        await until_stopped()
    finally:
        await runner.cleanup()   # in-flight requests finish, then connections close
    log.info("HTTP front stopped")


def run(settings, host: str, port: int, on_ready=None, sock=None) -> None:
    asyncio.run(serve(settings, host, port, on_ready, sock))
